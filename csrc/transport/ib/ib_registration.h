// Registered memory of the IB transport: one memory region per RDMA device
// (every NIC of the transport, primary and backup), so whichever path a
// connection uses, before or after a failover, has its key at hand. A device
// that refuses (a fatal error, a dma-buf it cannot import) leaves its NIC
// without a region; the others still carry the buffer. The placement a
// receiver sends for a registered buffer (IbPlacement) carries the buffer's
// address and capacity and the rkey of each of its NICs that has one; the
// sender's path picks the rkey of the NIC it reaches.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/memory_registration.h"
#include "transport/ib/verbs_api.h"
#include "transport/socket.h"

namespace reccl {

// What a receiver's registration tells the sender (the bytes of a Placement).
struct IbPlacement {
  uint64_t address = 0;   // the receive buffer's first byte, as its NICs address it
  uint64_t capacity = 0;  // bytes the sender may write from `address`
  std::vector<uint32_t> rkeys;  // by the receiver's NIC index
  uint32_t present = 0;         // bit i: NIC i has a region (rkeys[i] is meaningful)

  // The rkey of the receiver's NIC `nic`, nullopt where it has no region.
  std::optional<uint32_t> rkeyOf(int nic) const;
  std::vector<uint8_t> encode() const;
  // Throws ProtocolError naming what is wrong with `bytes`.
  static IbPlacement decode(const std::vector<uint8_t>& bytes);
};

class IbRegistration;

// The live registrations of one transport, so a device reopened after a
// fatal error gets every one of them registered again. Shared: a
// registration may outlive its transport's table owner.
class IbRegistrationTable {
 public:
  void add(IbRegistration* registration);
  void remove(IbRegistration* registration);
  // Registers each live registration on `device`, the reopened NIC `nic`.
  void reregisterAll(int nic, const std::shared_ptr<VerbsDevice>& device);

 private:
  std::mutex mutex_;
  std::set<IbRegistration*> live_;
};

class IbRegistration : public MemoryRegistration {
 public:
  // Registers host memory on every device in `devices` (local + remote write).
  // `registrar`: the transport that owns `devices`; `table`: its live
  // registrations. `relaxedOrdering`: ask for IBV_ACCESS_RELAXED_ORDERING on
  // each device that supports asking (RECCL_IB_RELAXED_ORDERING=auto), here
  // and below. Each device that refuses is skipped (logged); only when every
  // one refuses does this throw, naming each device's reason.
  static std::unique_ptr<IbRegistration> host(
      const void* registrar, std::shared_ptr<IbRegistrationTable> table,
      const std::vector<std::shared_ptr<VerbsDevice>>& devices, void* base, uint64_t bytes,
      bool relaxedOrdering);
  // Registers GPU memory by pointer (peer memory) on every device.
  static std::unique_ptr<IbRegistration> peer(
      const void* registrar, std::shared_ptr<IbRegistrationTable> table,
      const std::vector<std::shared_ptr<VerbsDevice>>& devices, void* address, uint64_t bytes,
      bool relaxedOrdering);
  // Registers `bytes` of dma-buf `fd` from `offset` on every device, addressed
  // as `address`. Keeps a duplicate of `fd` (to register again on a reopened
  // device; the caller may close its own).
  static std::unique_ptr<IbRegistration> dmaBuf(
      const void* registrar, std::shared_ptr<IbRegistrationTable> table,
      const std::vector<std::shared_ptr<VerbsDevice>>& devices, int fd, uint64_t offset,
      uint64_t bytes, uint64_t address, bool relaxedOrdering);
  ~IbRegistration() override;

  uint64_t address() const override { return address_; }
  uint64_t bytes() const override { return bytes_; }
  bool hostAccessible() const override { return hostAccessible_; }
  Placement placementFor(uint64_t address, uint64_t capacity) const override;
  const void* registrar() const override { return registrar_; }
  // The local / remote key of this memory on device `nic`; nullopt where that
  // device refused it (refusal() says why).
  std::optional<uint32_t> lkey(int nic) const;
  std::optional<uint32_t> rkey(int nic) const;
  std::string refusal(int nic) const;
  size_t nicCount() const { return nics_.size(); }
  // Registers this memory on `device`, NIC `nic` reopened after a fatal
  // error, in place of what the dead context held (its keys are void).
  void reregister(int nic, const std::shared_ptr<VerbsDevice>& device);

 private:
  using RegisterOn = std::function<std::unique_ptr<VerbsMemoryRegion>(VerbsDevice&)>;
  // One NIC's share. The region goes before the device that made it (member
  // order): a region never outlives its context (no dereg after close).
  struct NicRegion {
    std::shared_ptr<VerbsDevice> device;
    std::unique_ptr<VerbsMemoryRegion> region;  // nullptr: refused
    std::string refusal;
  };

  IbRegistration(const void* registrar, uint64_t address, uint64_t bytes, bool hostAccessible)
      : registrar_(registrar), address_(address), bytes_(bytes), hostAccessible_(hostAccessible) {}
  static std::unique_ptr<IbRegistration> onEveryDevice(
      std::unique_ptr<IbRegistration> out, std::shared_ptr<IbRegistrationTable> table,
      const std::vector<std::shared_ptr<VerbsDevice>>& devices, RegisterOn registerOn);
  NicRegion registerOn(const std::shared_ptr<VerbsDevice>& device) const;

  const void* const registrar_;
  const uint64_t address_;
  const uint64_t bytes_;
  const bool hostAccessible_;
  Fd dmaBufFd_;  // dma-buf memory: our duplicate of the caller's fd
  RegisterOn registerOn_;
  std::shared_ptr<IbRegistrationTable> table_;
  mutable std::mutex mutex_;     // guards nics_' regions (reregister replaces one)
  std::vector<NicRegion> nics_;  // by NIC index
};

}  // namespace reccl
