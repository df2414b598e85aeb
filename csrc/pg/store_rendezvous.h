// The engine's Rendezvous over a c10d::Store (the group's prefix store, so
// keys are already unique per group).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "engine/rendezvous.h"

namespace reccl {

class StoreRendezvous : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  void erase(const std::string& key) override;

  // Store requests every StoreRendezvous of the process has made.
  static uint64_t requests();
  void setMany(const std::vector<std::string>& keys,
               const std::vector<std::vector<uint8_t>>& values) override;
  std::vector<std::vector<uint8_t>> getMany(const std::vector<std::string>& keys,
                                            Millis timeout) override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace reccl
