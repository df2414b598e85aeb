// Unpredictable bytes from the kernel, for handshake secrets and ids.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <random>

namespace reccl {

// Fills `out` from getrandom(2); throws Error if the kernel refuses.
void randomBytes(uint8_t* out, size_t length);

// Ids (listeners, connections, path nonces) from a generator seeded by the
// kernel; safe to call from any thread.
class RandomIds {
 public:
  RandomIds();
  uint64_t next();

 private:
  std::mutex mutex_;
  std::mt19937_64 generator_;
};

}  // namespace reccl
