// Registered memory of the IB transport: one memory region per RDMA device
// (every NIC of the transport, primary and backup), so whichever path a
// connection uses, before or after a failover, has its key at hand. The
// placement a receiver sends for a registered buffer (IbPlacement) carries
// the buffer's address and capacity and the rkey of each of its NICs; the
// sender's path picks the rkey of the NIC it reaches.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/memory_registration.h"
#include "transport/ib/verbs_api.h"

namespace reccl {

// What a receiver's registration tells the sender (the bytes of a Placement).
struct IbPlacement {
  uint64_t address = 0;   // the receive buffer's first byte, as its NICs address it
  uint64_t capacity = 0;  // bytes the sender may write from `address`
  std::vector<uint32_t> rkeys;  // by the receiver's NIC index

  std::vector<uint8_t> encode() const;
  // Throws ProtocolError naming what is wrong with `bytes`.
  static IbPlacement decode(const std::vector<uint8_t>& bytes);
};

class IbRegistration : public MemoryRegistration {
 public:
  // Registers host memory on every device in `devices` (local + remote write).
  // `registrar`: the transport that owns `devices`.
  // `relaxedOrdering`: ask for IBV_ACCESS_RELAXED_ORDERING on each device
  // that supports asking (RECCL_IB_RELAXED_ORDERING=auto), here and below.
  static std::unique_ptr<IbRegistration> host(const void* registrar,
                                              const std::vector<std::shared_ptr<VerbsDevice>>& devices,
                                              void* base, uint64_t bytes, bool relaxedOrdering);
  // Registers GPU memory by pointer (peer memory) on every device.
  static std::unique_ptr<IbRegistration> peer(const void* registrar,
                                              const std::vector<std::shared_ptr<VerbsDevice>>& devices,
                                              void* address, uint64_t bytes, bool relaxedOrdering);
  // Registers `bytes` of dma-buf `fd` from `offset` on every device, addressed as `address`.
  static std::unique_ptr<IbRegistration> dmaBuf(const void* registrar,
                                                const std::vector<std::shared_ptr<VerbsDevice>>& devices,
                                                int fd, uint64_t offset, uint64_t bytes, uint64_t address,
                                                bool relaxedOrdering);

  uint64_t address() const override { return address_; }
  uint64_t bytes() const override { return bytes_; }
  bool hostAccessible() const override { return hostAccessible_; }
  Placement placementFor(uint64_t address, uint64_t capacity) const override;
  const void* registrar() const override { return registrar_; }
  // The local / remote key of this memory on device `nic`.
  uint32_t lkey(int nic) const;
  uint32_t rkey(int nic) const;
  size_t nicCount() const { return regions_.size(); }

 private:
  IbRegistration(const void* registrar, uint64_t address, uint64_t bytes, bool hostAccessible)
      : registrar_(registrar), address_(address), bytes_(bytes), hostAccessible_(hostAccessible) {}
  // One region per device, each made by `registerOn(device)`.
  template <typename RegisterOn>
  static std::unique_ptr<IbRegistration> onEveryDevice(
      const void* registrar, const std::vector<std::shared_ptr<VerbsDevice>>& devices,
      uint64_t address, uint64_t bytes, bool hostAccessible, RegisterOn registerOn) {
    std::unique_ptr<IbRegistration> out(new IbRegistration(registrar, address, bytes, hostAccessible));
    for (const auto& device : devices) out->regions_.push_back(registerOn(*device));
    return out;
  }

  const void* const registrar_;
  const uint64_t address_;
  const uint64_t bytes_;
  const bool hostAccessible_;
  std::vector<std::unique_ptr<VerbsMemoryRegion>> regions_;  // by NIC index
};

}  // namespace reccl
