// The out-of-band key-value store the engine publishes listener handles in
// (the torch layer adapts c10d::Store to it). Keys are already group-unique.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/clock.h"

namespace reccl {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until `key` exists; throws TimeoutError after `timeout`.
  virtual std::vector<uint8_t> get(const std::string& key, Millis timeout) = 0;
  // Several keys in one round trip where the store can.
  virtual void setMany(const std::vector<std::string>& keys,
                       const std::vector<std::vector<uint8_t>>& values) = 0;
  virtual std::vector<std::vector<uint8_t>> getMany(const std::vector<std::string>& keys,
                                                    Millis timeout) = 0;
  // Atomically adds `delta` to the integer at `key` (0 when absent); returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Deletes `key` (no error when absent).
  virtual void erase(const std::string& key) = 0;
};

}  // namespace reccl
