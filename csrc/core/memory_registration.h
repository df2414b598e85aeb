// Memory a transport has registered for zero-copy transfers, on every one of
// its NICs (primary and backup alike, so a failover needs no registration on
// the data path). The core only carries it: what "registered" means (verbs
// memory regions, keys) is the transport's. The caller owns it; destroying it
// deregisters, and the caller must not do that while a request that names it
// is still pending (the same rule as for the buffer itself).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"

namespace reccl {

// What a receiver tells the sender about a registered receive buffer, so the
// sender's transport can write into it directly (PLACE frame). `bytes` is the
// transport's own encoding (for IB: address, capacity and one rkey per NIC of
// the receiver); the core never looks inside.
struct Placement {
  std::vector<uint8_t> bytes;
  bool hostAccessible = true;  // false: device memory, no CPU copy may touch it
};

class MemoryRegistration {
 public:
  virtual ~MemoryRegistration() = default;  // deregisters on every NIC
  // The first registered byte and the length, as the caller addresses them
  // (for dma-buf memory: the device address the caller uses for its buffers).
  virtual uint64_t address() const = 0;
  virtual uint64_t bytes() const = 0;
  // False for device memory (dma-buf): only the NIC may read or write it, so
  // it travels by direct placement only, never through a CPU copy.
  virtual bool hostAccessible() const = 0;
  // What the peer needs to write [address, address + capacity) directly.
  virtual Placement placementFor(uint64_t address, uint64_t capacity) const = 0;
  // The transport that made it: only its connections can use it (its keys
  // belong to that transport's protection domains).
  virtual const void* registrar() const = 0;

  bool covers(uint64_t start, uint64_t length) const {
    return start >= address() && length <= bytes() && start - address() <= bytes() - length;
  }
  // Throws Error naming `what` (e.g. "send buffer") unless this registration
  // was made by `transport` and covers the buffer.
  void requireUsable(const void* transport, const void* data, uint64_t length,
                     const char* what) const {
    if (registrar() != transport) {
      throw Error(std::string(what) +
                  ": its registration was made by another transport; register "
                  "it with the transport of this connection");
    }
    const uint64_t start = reinterpret_cast<uint64_t>(data);
    if (length == 0 || covers(start, length)) return;
    throw Error(std::string(what) + " [" + std::to_string(start) + ", +" + std::to_string(length) +
                ") lies outside its registration [" + std::to_string(address()) + ", +" +
                std::to_string(bytes()) + ")");
  }
};

}  // namespace reccl
