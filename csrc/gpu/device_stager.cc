#include "gpu/device_stager.h"

#include <algorithm>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"

namespace reccl {

DeviceStager::DeviceStager(std::shared_ptr<CudaApi> cuda, int64_t maxTransitBytes, int timeoutMs)
    : cuda_(std::move(cuda)), maxTransitBytes_(static_cast<size_t>(maxTransitBytes)), timeoutMs_(timeoutMs) {}

DeviceStager::~DeviceStager() {
  // Every call waits for its copies before returning, so nothing is in flight.
  try {
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

void DeviceStager::prepare(int bufferGpu, size_t messageBytes, const std::vector<int>& transitGpus) {
  if (prepared_) throw Error("DeviceStager::prepare called twice");
  prepared_ = true;
  directStream(bufferGpu);
  const size_t size = std::max<size_t>(1, std::min(messageBytes, maxTransitBytes_));
  for (int transitGpu : transitGpus) {
    if (transitGpu < 0 || transitGpu == bufferGpu || routes_.count({bufferGpu, transitGpu})) continue;
    cuda_->enablePeerAccess(bufferGpu, transitGpu);
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

template <typename Copy>
void DeviceStager::copyDirect(int gpu, Copy&& copy) {
  const CudaStream& stream = directStream(gpu);
  copy(stream);
  cuda_->waitStream(stream, timeoutMs_);
}

template <typename CopyPiece>
void DeviceStager::inPieces(Route& route, size_t bytes, CopyPiece&& copyPiece) {
  const bool fits = bytes <= route.bytes;
  const size_t slotBytes = fits ? route.bytes : route.bytes / 2;
  size_t index = 0;
  for (size_t offset = 0; offset < bytes; offset += slotBytes, ++index) {
    const int lane = fits ? 0 : static_cast<int>(index % 2);
    uint8_t* slot = static_cast<uint8_t*>(route.buffer) + lane * slotBytes;
    copyPiece(route.lanes[lane], offset, std::min(slotBytes, bytes - offset), slot);
  }
  for (const Lane& lane : route.lanes) {
    if (!lane.used) continue;
    cuda_->waitStream(lane.bufferStream, timeoutMs_);
    cuda_->waitStream(lane.transitStream, timeoutMs_);
  }
}

void DeviceStager::toHost(uint8_t* host, const uint8_t* src, int srcGpu, size_t bytes, int transitGpu) {
  if (bytes == 0) return;
  Route* route = transitGpu < 0 ? nullptr : routeFor(srcGpu, transitGpu);
  if (route == nullptr) {
    copyDirect(srcGpu, [&](const CudaStream& stream) { cuda_->copyToHostAsync(host, src, bytes, stream); });
    return;
  }
  inPieces(*route, bytes, [&](Lane& lane, size_t offset, size_t piece, uint8_t* slot) {
    // The slot is free once this lane's previous host copy is done.
    if (lane.used) cuda_->streamWaitEvent(lane.bufferStream, lane.transitDone);
    cuda_->copyPeerAsync(slot, transitGpu, src + offset, srcGpu, piece, lane.bufferStream);
    cuda_->recordEvent(lane.bufferDone, lane.bufferStream);
    cuda_->streamWaitEvent(lane.transitStream, lane.bufferDone);
    cuda_->copyToHostAsync(host + offset, slot, piece, lane.transitStream);
    cuda_->recordEvent(lane.transitDone, lane.transitStream);
    lane.used = true;
  });
}

void DeviceStager::toDevice(uint8_t* dst, int dstGpu, const uint8_t* host, size_t bytes, int transitGpu) {
  if (bytes == 0) return;
  Route* route = transitGpu < 0 ? nullptr : routeFor(dstGpu, transitGpu);
  if (route == nullptr) {
    copyDirect(dstGpu, [&](const CudaStream& stream) { cuda_->copyToDeviceAsync(dst, host, bytes, stream); });
    return;
  }
  inPieces(*route, bytes, [&](Lane& lane, size_t offset, size_t piece, uint8_t* slot) {
    // The slot is free once this lane's previous NVLink copy out of it is done.
    if (lane.used) cuda_->streamWaitEvent(lane.transitStream, lane.bufferDone);
    cuda_->copyToDeviceAsync(slot, host + offset, piece, lane.transitStream);
    cuda_->recordEvent(lane.transitDone, lane.transitStream);
    cuda_->streamWaitEvent(lane.bufferStream, lane.transitDone);
    cuda_->copyPeerAsync(dst + offset, dstGpu, slot, transitGpu, piece, lane.bufferStream);
    cuda_->recordEvent(lane.bufferDone, lane.bufferStream);
    lane.used = true;
  });
}

}  // namespace reccl
