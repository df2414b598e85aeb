#include "transport/ib/ib_registration.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/frame.h"
#include "core/log.h"

namespace reccl {

namespace {

// address, capacity, NIC count, the mask of NICs with a region, then one rkey per NIC.
constexpr size_t kPlacementHead = 2 * sizeof(uint64_t) + 2 * sizeof(uint32_t);
constexpr size_t kMaxPlacementNics = (kMaxPlacementBytes - kPlacementHead) / sizeof(uint32_t);

}  // namespace

std::optional<uint32_t> IbPlacement::rkeyOf(int nic) const {
  if (nic < 0 || static_cast<size_t>(nic) >= rkeys.size() || !(present & (1u << nic)))
    return std::nullopt;
  return rkeys[static_cast<size_t>(nic)];
}

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
  std::memcpy(out.data() + 20, &present, sizeof(present));
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
  std::memcpy(&out.present, bytes.data() + 20, sizeof(out.present));
  if (count == 0 || count > kMaxPlacementNics ||
      bytes.size() != kPlacementHead + count * sizeof(uint32_t)) {
    throw ProtocolError("IB placement names " + std::to_string(count) + " NICs in " +
                        std::to_string(bytes.size()) + " bytes (1.." +
                        std::to_string(kMaxPlacementNics) + " NICs, 4 bytes each after " +
                        std::to_string(kPlacementHead) + ")");
  }
  if (out.present == 0 || (out.present >> count) != 0) {
    throw ProtocolError("IB placement of " + std::to_string(count) + " NICs marks NICs " +
                        std::to_string(out.present) + " (a bit mask) as registered");
  }
  if (out.address + out.capacity < out.address) {
    throw ProtocolError("IB placement wraps the address space");
  }
  out.rkeys.resize(count);
  std::memcpy(out.rkeys.data(), bytes.data() + kPlacementHead, count * sizeof(uint32_t));
  return out;
}

void IbRegistrationTable::add(IbRegistration* registration) {
  std::lock_guard<std::mutex> lock(mutex_);
  live_.insert(registration);
}

void IbRegistrationTable::remove(IbRegistration* registration) {
  std::lock_guard<std::mutex> lock(mutex_);
  live_.erase(registration);
}

void IbRegistrationTable::reregisterAll(int nic, const std::shared_ptr<VerbsDevice>& device) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (IbRegistration* registration : live_) registration->reregister(nic, device);
}

IbRegistration::NicRegion IbRegistration::registerOn(
    const std::shared_ptr<VerbsDevice>& device) const {
  NicRegion out;
  out.device = device;
  try {
    out.region = registerOn_(*device);
  } catch (const Error& error) {
    out.refusal = error.what();
  }
  return out;
}

std::unique_ptr<IbRegistration> IbRegistration::onEveryDevice(
    std::unique_ptr<IbRegistration> out, std::shared_ptr<IbRegistrationTable> table,
    const std::vector<std::shared_ptr<VerbsDevice>>& devices, RegisterOn registerOn) {
  out->registerOn_ = std::move(registerOn);
  std::string refusals;
  size_t registered = 0;
  for (const auto& device : devices) {
    out->nics_.push_back(out->registerOn(device));
    const NicRegion& added = out->nics_.back();
    if (added.region) {
      ++registered;
    } else {
      refusals += (refusals.empty() ? "" : "; ") + device->name() + ": " + added.refusal;
    }
  }
  if (registered == 0) throw Error("no RDMA device could register the memory: " + refusals);
  if (!refusals.empty()) {
    // The failure case itself: the other NICs carry it; paths on these fail over.
    RECCL_LOG(kWarn, "memory registered on " + std::to_string(registered) + " of " +
                         std::to_string(devices.size()) + " RDMA devices; refused by " + refusals);
  }
  out->table_ = std::move(table);
  out->table_->add(out.get());
  return out;
}

IbRegistration::~IbRegistration() {
  if (table_) table_->remove(this);
}

std::unique_ptr<IbRegistration> IbRegistration::host(
    const void* registrar, std::shared_ptr<IbRegistrationTable> table,
    const std::vector<std::shared_ptr<VerbsDevice>>& devices, void* base, uint64_t bytes,
    bool relaxedOrdering) {
  if (base == nullptr || bytes == 0) throw ConfigError("cannot register an empty buffer");
  std::unique_ptr<IbRegistration> out(
      new IbRegistration(registrar, reinterpret_cast<uint64_t>(base), bytes, true));
  return onEveryDevice(std::move(out), std::move(table), devices, [=](VerbsDevice& device) {
    return device.registerMemory(base, bytes, true,
                                 relaxedOrdering && device.supportsRelaxedOrdering());
  });
}

std::unique_ptr<IbRegistration> IbRegistration::peer(
    const void* registrar, std::shared_ptr<IbRegistrationTable> table,
    const std::vector<std::shared_ptr<VerbsDevice>>& devices, void* address, uint64_t bytes,
    bool relaxedOrdering) {
  if (address == nullptr || bytes == 0) throw ConfigError("cannot register an empty buffer");
  std::unique_ptr<IbRegistration> out(
      new IbRegistration(registrar, reinterpret_cast<uint64_t>(address), bytes, false));
  return onEveryDevice(std::move(out), std::move(table), devices, [=](VerbsDevice& device) {
    return device.registerPeerMemory(address, bytes,
                                     relaxedOrdering && device.supportsRelaxedOrdering());
  });
}

std::unique_ptr<IbRegistration> IbRegistration::dmaBuf(
    const void* registrar, std::shared_ptr<IbRegistrationTable> table,
    const std::vector<std::shared_ptr<VerbsDevice>>& devices, int fd, uint64_t offset,
    uint64_t bytes, uint64_t address, bool relaxedOrdering) {
  if (fd < 0) throw ConfigError("dma-buf fd " + std::to_string(fd) + " is not a file descriptor");
  if (bytes == 0 || address == 0) throw ConfigError("cannot register an empty dma-buf range");
  std::unique_ptr<IbRegistration> out(new IbRegistration(registrar, address, bytes, false));
  out->dmaBufFd_ = Fd(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (!out->dmaBufFd_.valid()) {
    throw Error("dma-buf fd " + std::to_string(fd) +
                " cannot be duplicated: " + std::strerror(errno));
  }
  const int held = out->dmaBufFd_.get();
  return onEveryDevice(std::move(out), std::move(table), devices, [=](VerbsDevice& device) {
    return device.registerDmaBuf(held, offset, bytes, address,
                                 relaxedOrdering && device.supportsRelaxedOrdering());
  });
}

void IbRegistration::reregister(int nic, const std::shared_ptr<VerbsDevice>& device) {
  NicRegion fresh = registerOn(device);
  if (!fresh.region) {
    RECCL_LOG(kWarn,
              "re-registering memory on reopened " + device->name() + " failed: " + fresh.refusal);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  std::swap(nics_.at(static_cast<size_t>(nic)), fresh);
  // `fresh` now holds the dead context's region and device: the region goes first.
}

Placement IbRegistration::placementFor(uint64_t address, uint64_t capacity) const {
  if (!covers(address, capacity)) {
    throw Error("placement [" + std::to_string(address) + ", +" + std::to_string(capacity) +
                ") outside the registered range");
  }
  IbPlacement placement;
  placement.address = address;
  placement.capacity = capacity;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < nics_.size(); ++i) {
      placement.rkeys.push_back(nics_[i].region ? nics_[i].region->rkey() : 0);
      if (nics_[i].region) placement.present |= 1u << i;
    }
  }
  Placement out;
  out.bytes = placement.encode();
  out.hostAccessible = hostAccessible_;
  return out;
}

std::optional<uint32_t> IbRegistration::lkey(int nic) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const NicRegion& share = nics_.at(static_cast<size_t>(nic));
  if (!share.region) return std::nullopt;
  return share.region->lkey();
}

std::optional<uint32_t> IbRegistration::rkey(int nic) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const NicRegion& share = nics_.at(static_cast<size_t>(nic));
  if (!share.region) return std::nullopt;
  return share.region->rkey();
}

std::string IbRegistration::refusal(int nic) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return nics_.at(static_cast<size_t>(nic)).refusal;
}

}  // namespace reccl
