#include "gpu/device_stager.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"

namespace reccl {

DeviceStager::DeviceStager(std::shared_ptr<CudaApi> cuda, int64_t maxTransitBytes, int timeoutMs)
    : cuda_(std::move(cuda)),
      maxTransitBytes_(static_cast<size_t>(maxTransitBytes)),
      timeoutMs_(timeoutMs) {}

DeviceStager::~DeviceStager() {
  try {
    // Copies still queued (a connection that failed mid-message) finish
    // before their memory goes.
    for (auto& [device, slots] : completions_) {
      for (size_t slot = 0; slot < slots.size(); ++slot) {
        if (slots[slot].busy)
          wait(Transfer{device, static_cast<int>(slot), Clock::now() + Millis(timeoutMs_)});
      }
    }
    for (auto& [key, route] : routes_) {
      if (route.buffer != nullptr) cuda_->deviceFree(key.second, route.buffer);
      for (Lane& lane : route.lanes) {
        if (lane.bufferStream.handle == nullptr) continue;
        cuda_->destroyEvent(lane.bufferDone);
        cuda_->destroyEvent(lane.transitDone);
        cuda_->destroyStream(lane.bufferStream);
        cuda_->destroyStream(lane.transitStream);
      }
    }
    for (const auto& [gpu, stream] : direct_) cuda_->destroyStream(stream);
    for (const auto& [device, slots] : completions_) {
      for (const Completion& completion : slots) cuda_->destroyEvent(completion.event);
    }
  } catch (const std::exception& error) {
    RECCL_LOG(kWarn, std::string("releasing NVL staging: ") + error.what());
  }
  NicHealth::instance().addTransitBytes(-transitBytes_);
}

const CudaStream& DeviceStager::directStream(int gpu) {
  auto found = direct_.find(gpu);
  if (found != direct_.end()) return found->second;
  return direct_.emplace(gpu, cuda_->createStream(gpu)).first->second;
}

void DeviceStager::prepare(int bufferGpu, size_t messageBytes,
                           const std::vector<int>& transitGpus) {
  if (prepared_) throw Error("DeviceStager::prepare called twice");
  prepared_ = true;
  directStream(bufferGpu);
  auto completionsOn = [&](int device) {
    std::vector<Completion>& slots = completions_[device];
    if (!slots.empty()) return;
    slots.resize(kMaxInFlight);
    for (Completion& completion : slots) completion.event = cuda_->createEvent(device);
  };
  completionsOn(bufferGpu);
  const size_t size = std::max<size_t>(1, std::min(messageBytes, maxTransitBytes_));
  for (int transitGpu : transitGpus) {
    if (transitGpu < 0 || transitGpu == bufferGpu || routes_.count({bufferGpu, transitGpu}))
      continue;
    cuda_->enablePeerAccess(bufferGpu, transitGpu);
    completionsOn(transitGpu);
    Route& route = routes_[{bufferGpu, transitGpu}];
    for (Lane& lane : route.lanes) {
      lane.bufferStream = cuda_->createStream(bufferGpu);
      lane.transitStream = cuda_->createStream(transitGpu);
      lane.bufferDone = cuda_->createEvent(bufferGpu);
      lane.transitDone = cuda_->createEvent(transitGpu);
    }
    route.buffer = cuda_->deviceAlloc(transitGpu, size);
    route.bytes = size;
    transitBytes_ += static_cast<int64_t>(size);
    NicHealth::instance().addTransitBytes(static_cast<int64_t>(size));
  }
}

DeviceStager::Route* DeviceStager::routeFor(int bufferGpu, int transitGpu) {
  auto found = routes_.find({bufferGpu, transitGpu});
  return found == routes_.end() ? nullptr : &found->second;
}

int DeviceStager::freeSlot(int device) {
  auto found = completions_.find(device);
  if (found == completions_.end()) {
    throw Error("NVL staging: GPU " + std::to_string(device) + " was not prepared for this buffer");
  }
  for (size_t slot = 0; slot < found->second.size(); ++slot) {
    if (!found->second[slot].busy) return static_cast<int>(slot);
  }
  return -1;
}

DeviceStager::Transfer DeviceStager::finish(int device, int slot, const CudaStream& stream) {
  Completion& completion = completions_[device][static_cast<size_t>(slot)];
  cuda_->recordEvent(completion.event, stream);
  completion.busy = true;
  ++inFlight_;
  return Transfer{device, slot, Clock::now() + Millis(timeoutMs_)};
}

void DeviceStager::checkDirection(Direction direction) {
  if (inFlight_ > 0 && direction_ != direction) {
    throw Error(
        "NVL staging: copies to the GPU and to the host may not be in flight at once on one "
        "buffer");
  }
  direction_ = direction;
}

bool DeviceStager::done(Transfer& transfer) {
  if (transfer.slot < 0) return true;
  Completion& completion = completions_[transfer.device][static_cast<size_t>(transfer.slot)];
  if (!cuda_->eventDone(completion.event)) {
    if (Clock::now() > transfer.deadline) {
      throw Error("GPU copies on device " + std::to_string(transfer.device) + " not done after " +
                  std::to_string(timeoutMs_) + " ms");
    }
    return false;
  }
  completion.busy = false;
  --inFlight_;
  transfer.slot = -1;
  return true;
}

void DeviceStager::wait(Transfer transfer) {
  // Polled with a bound, never a blocking synchronise (done() throws past the deadline).
  for (int polls = 0; !done(transfer); ++polls) {
    if (polls > 200) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

template <typename CopyPiece>
int DeviceStager::inPieces(Route& route, size_t bytes, CopyPiece&& copyPiece) {
  const bool fits = bytes <= route.bytes;
  const size_t slotBytes = fits ? route.bytes : route.bytes / 2;
  size_t index = 0;
  for (size_t offset = 0; offset < bytes; offset += slotBytes, ++index) {
    const int lane = fits ? 0 : static_cast<int>(index % 2);
    uint8_t* slot = static_cast<uint8_t*>(route.buffer) + lane * slotBytes;
    copyPiece(route.lanes[lane], offset, std::min(slotBytes, bytes - offset), slot);
  }
  return index > 1 ? 2 : 1;
}

std::optional<DeviceStager::Transfer> DeviceStager::startToHost(uint8_t* host, const uint8_t* src,
                                                                int srcGpu, size_t bytes,
                                                                int transitGpu) {
  if (bytes == 0) return Transfer{};
  checkDirection(Direction::kToHost);
  Route* route = transitGpu < 0 ? nullptr : routeFor(srcGpu, transitGpu);
  const int device = route == nullptr ? srcGpu : transitGpu;
  const int slot = freeSlot(device);
  if (slot < 0) return std::nullopt;
  if (route == nullptr) {
    const CudaStream& stream = directStream(srcGpu);
    cuda_->copyToHostAsync(host, src, bytes, stream);
    return finish(device, slot, stream);
  }
  const int lanes =
      inPieces(*route, bytes, [&](Lane& lane, size_t offset, size_t piece, uint8_t* staging) {
        // The staging slot is free once this lane's previous host copy is done.
        if (lane.used) cuda_->streamWaitEvent(lane.bufferStream, lane.transitDone);
        cuda_->copyPeerAsync(staging, transitGpu, src + offset, srcGpu, piece, lane.bufferStream);
        cuda_->recordEvent(lane.bufferDone, lane.bufferStream);
        cuda_->streamWaitEvent(lane.transitStream, lane.bufferDone);
        cuda_->copyToHostAsync(host + offset, staging, piece, lane.transitStream);
        cuda_->recordEvent(lane.transitDone, lane.transitStream);
        lane.used = true;
      });
  // The message is in `host` when both lanes' host copies are: join them.
  Lane& first = route->lanes[0];
  if (lanes == 2) cuda_->streamWaitEvent(first.transitStream, route->lanes[1].transitDone);
  return finish(device, slot, first.transitStream);
}

std::optional<DeviceStager::Transfer> DeviceStager::startToDevice(uint8_t* dst, int dstGpu,
                                                                  const uint8_t* host, size_t bytes,
                                                                  int transitGpu) {
  if (bytes == 0) return Transfer{};
  checkDirection(Direction::kToDevice);
  Route* route = transitGpu < 0 ? nullptr : routeFor(dstGpu, transitGpu);
  const int slot = freeSlot(dstGpu);
  if (slot < 0) return std::nullopt;
  if (route == nullptr) {
    const CudaStream& stream = directStream(dstGpu);
    cuda_->copyToDeviceAsync(dst, host, bytes, stream);
    return finish(dstGpu, slot, stream);
  }
  const int lanes =
      inPieces(*route, bytes, [&](Lane& lane, size_t offset, size_t piece, uint8_t* staging) {
        // The staging slot is free once this lane's previous NVLink copy out of it is done.
        if (lane.used) cuda_->streamWaitEvent(lane.transitStream, lane.bufferDone);
        cuda_->copyToDeviceAsync(staging, host + offset, piece, lane.transitStream);
        cuda_->recordEvent(lane.transitDone, lane.transitStream);
        cuda_->streamWaitEvent(lane.bufferStream, lane.transitDone);
        cuda_->copyPeerAsync(dst + offset, dstGpu, staging, transitGpu, piece, lane.bufferStream);
        cuda_->recordEvent(lane.bufferDone, lane.bufferStream);
        lane.used = true;
      });
  // The message is in `dst` when both lanes' NVLink copies are: join them.
  Lane& first = route->lanes[0];
  if (lanes == 2) cuda_->streamWaitEvent(first.bufferStream, route->lanes[1].bufferDone);
  return finish(dstGpu, slot, first.bufferStream);
}

void DeviceStager::toHost(uint8_t* host, const uint8_t* src, int srcGpu, size_t bytes,
                          int transitGpu) {
  std::optional<Transfer> transfer = startToHost(host, src, srcGpu, bytes, transitGpu);
  if (!transfer)
    throw Error("NVL staging: " + std::to_string(kMaxInFlight) + " transfers already in flight");
  wait(*transfer);
}

void DeviceStager::toDevice(uint8_t* dst, int dstGpu, const uint8_t* host, size_t bytes,
                            int transitGpu) {
  std::optional<Transfer> transfer = startToDevice(dst, dstGpu, host, bytes, transitGpu);
  if (!transfer)
    throw Error("NVL staging: " + std::to_string(kMaxInFlight) + " transfers already in flight");
  wait(*transfer);
}

}  // namespace reccl
