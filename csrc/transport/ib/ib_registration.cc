#include "transport/ib/ib_registration.h"

#include <cstring>

#include "core/error.h"
#include "core/frame.h"

namespace reccl {

namespace {

// address, capacity, NIC count, then one rkey per NIC.
constexpr size_t kPlacementHead = 2 * sizeof(uint64_t) + sizeof(uint32_t);
constexpr size_t kMaxPlacementNics = (kMaxPlacementBytes - kPlacementHead) / sizeof(uint32_t);

}  // namespace

std::vector<uint8_t> IbPlacement::encode() const {
  if (rkeys.empty() || rkeys.size() > kMaxPlacementNics) {
    throw Error("a placement names 1.." + std::to_string(kMaxPlacementNics) + " NICs, not " +
                std::to_string(rkeys.size()));
  }
  std::vector<uint8_t> out(kPlacementHead + rkeys.size() * sizeof(uint32_t));
  const uint32_t count = static_cast<uint32_t>(rkeys.size());
  std::memcpy(out.data(), &address, sizeof(address));
  std::memcpy(out.data() + 8, &capacity, sizeof(capacity));
  std::memcpy(out.data() + 16, &count, sizeof(count));
  std::memcpy(out.data() + kPlacementHead, rkeys.data(), rkeys.size() * sizeof(uint32_t));
  return out;
}

IbPlacement IbPlacement::decode(const std::vector<uint8_t>& bytes) {
  if (bytes.size() < kPlacementHead) {
    throw ProtocolError("IB placement of " + std::to_string(bytes.size()) + " bytes; at least " +
                        std::to_string(kPlacementHead) + " expected");
  }
  IbPlacement out;
  uint32_t count = 0;
  std::memcpy(&out.address, bytes.data(), sizeof(out.address));
  std::memcpy(&out.capacity, bytes.data() + 8, sizeof(out.capacity));
  std::memcpy(&count, bytes.data() + 16, sizeof(count));
  if (count == 0 || count > kMaxPlacementNics ||
      bytes.size() != kPlacementHead + count * sizeof(uint32_t)) {
    throw ProtocolError("IB placement names " + std::to_string(count) + " NICs in " +
                        std::to_string(bytes.size()) + " bytes (1.." +
                        std::to_string(kMaxPlacementNics) + " NICs, 4 bytes each after " +
                        std::to_string(kPlacementHead) + ")");
  }
  if (out.address + out.capacity < out.address) {
    throw ProtocolError("IB placement wraps the address space");
  }
  out.rkeys.resize(count);
  std::memcpy(out.rkeys.data(), bytes.data() + kPlacementHead, count * sizeof(uint32_t));
  return out;
}

std::unique_ptr<IbRegistration> IbRegistration::host(
    const void* registrar, const std::vector<std::shared_ptr<VerbsDevice>>& devices, void* base,
    uint64_t bytes, bool relaxedOrdering) {
  if (base == nullptr || bytes == 0) throw ConfigError("cannot register an empty buffer");
  return onEveryDevice(registrar, devices, reinterpret_cast<uint64_t>(base), bytes, true, [&](VerbsDevice& device) {
    return device.registerMemory(base, bytes, true, relaxedOrdering && device.supportsRelaxedOrdering());
  });
}

std::unique_ptr<IbRegistration> IbRegistration::peer(
    const void* registrar, const std::vector<std::shared_ptr<VerbsDevice>>& devices, void* address,
    uint64_t bytes, bool relaxedOrdering) {
  if (address == nullptr || bytes == 0) throw ConfigError("cannot register an empty buffer");
  return onEveryDevice(registrar, devices, reinterpret_cast<uint64_t>(address), bytes, false, [&](VerbsDevice& device) {
    return device.registerPeerMemory(address, bytes, relaxedOrdering && device.supportsRelaxedOrdering());
  });
}

std::unique_ptr<IbRegistration> IbRegistration::dmaBuf(
    const void* registrar, const std::vector<std::shared_ptr<VerbsDevice>>& devices, int fd,
    uint64_t offset, uint64_t bytes, uint64_t address, bool relaxedOrdering) {
  if (fd < 0) throw ConfigError("dma-buf fd " + std::to_string(fd) + " is not a file descriptor");
  if (bytes == 0 || address == 0) throw ConfigError("cannot register an empty dma-buf range");
  return onEveryDevice(registrar, devices, address, bytes, false, [&](VerbsDevice& device) {
    return device.registerDmaBuf(fd, offset, bytes, address,
                                 relaxedOrdering && device.supportsRelaxedOrdering());
  });
}

Placement IbRegistration::placementFor(uint64_t address, uint64_t capacity) const {
  if (!covers(address, capacity)) {
    throw Error("placement [" + std::to_string(address) + ", +" + std::to_string(capacity) +
                ") outside the registered range");
  }
  IbPlacement placement;
  placement.address = address;
  placement.capacity = capacity;
  for (const auto& region : regions_) placement.rkeys.push_back(region->rkey());
  Placement out;
  out.bytes = placement.encode();
  out.hostAccessible = hostAccessible_;
  return out;
}

uint32_t IbRegistration::lkey(int nic) const { return regions_.at(static_cast<size_t>(nic))->lkey(); }
uint32_t IbRegistration::rkey(int nic) const { return regions_.at(static_cast<size_t>(nic))->rkey(); }

}  // namespace reccl
