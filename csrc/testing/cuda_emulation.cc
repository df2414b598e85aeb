#include "testing/cuda_emulation.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace reccl {

CudaEmulation::CudaEmulation(int devices) : devices_(devices) {
  if (devices < 1 || devices > 64) {
    throw ConfigError("a CUDA emulation needs 1..64 devices; got " + std::to_string(devices));
  }
}

CudaEmulation::~CudaEmulation() {
  for (const auto& [address, allocation] : allocations_)
    std::free(reinterpret_cast<void*>(address));
}

void CudaEmulation::checkDevice(int device, const char* call) const {
  if (device < 0 || device >= devices_) {
    throw Error(std::string(call) + ": invalid device ordinal " + std::to_string(device));
  }
}

void CudaEmulation::checkStream(const CudaStream& stream, const char* call) const {
  checkDevice(stream.device, call);
  if (!streams_.count(reinterpret_cast<uintptr_t>(stream.handle))) {
    throw Error(std::string(call) + ": invalid resource handle (no such stream)");
  }
}

void CudaEmulation::checkMemory(const void* pointer, size_t bytes, int device,
                                const char* call) const {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  auto found = allocations_.upper_bound(address);
  if (found != allocations_.begin()) {
    --found;
    const Allocation& a = found->second;
    if (a.device == device && address + bytes <= found->first + a.bytes) return;
  }
  throw Error(std::string(call) + ": " + std::to_string(bytes) + " bytes at this address are not " +
              (device == kPinned ? std::string("pinned host memory")
                                 : "memory of device " + std::to_string(device)));
}

const CudaEmulation::Allocation* CudaEmulation::allocationAt(const void* pointer) const {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  auto found = allocations_.upper_bound(address);
  if (found == allocations_.begin()) return nullptr;
  --found;
  return address < found->first + found->second.bytes ? &found->second : nullptr;
}

int CudaEmulation::deviceOf(const void* pointer) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Allocation* allocation = allocationAt(pointer);
  return allocation ? allocation->device : -1;  // kPinned is -1 too
}

bool CudaEmulation::isVirtualMemory(const void* pointer) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Allocation* allocation = allocationAt(pointer);
  return allocation != nullptr && allocation->virtualMemory;
}

std::string CudaEmulation::pciBusId(int device) {
  checkDevice(device, "cudaDeviceGetPCIBusId");
  return "emulated:" + std::to_string(device);  // no sysfs entry: no PCI location
}

bool CudaEmulation::canAccessPeer(int device, int peer) {
  checkDevice(device, "cudaDeviceCanAccessPeer");
  checkDevice(peer, "cudaDeviceCanAccessPeer");
  return device != peer;
}

bool CudaEmulation::supportsDmaBuf(std::string* why) {
  if (dmaBuf_.load()) return true;
  *why = "the emulated CUDA devices cannot export dma-bufs (CudaEmulation.set_dmabuf)";
  return false;
}

void CudaEmulation::setDmaBuf(bool supported) { dmaBuf_.store(supported); }

void CudaEmulation::enablePeerAccess(int device, int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkDevice(device, "cudaDeviceEnablePeerAccess");
  checkDevice(peer, "cudaDeviceEnablePeerAccess");
  if (device == peer) throw Error("cudaDeviceEnablePeerAccess: a device is no peer of itself");
  if (peerAccess_.insert({device, peer}).second) ++counters_.peerLinks;
}

void* CudaEmulation::allocate(int device, size_t bytes, bool virtualMemory) {
  void* pointer = std::calloc(1, bytes == 0 ? 1 : bytes);
  if (pointer == nullptr) throw Error("cudaMalloc: out of memory");
  allocations_[reinterpret_cast<uintptr_t>(pointer)] = {device, bytes, virtualMemory};
  (device == kPinned ? counters_.pinnedBytesAllocated : counters_.deviceBytesAllocated) += bytes;
  return pointer;
}

void CudaEmulation::release(int device, void* pointer, const char* call) {
  auto found = allocations_.find(reinterpret_cast<uintptr_t>(pointer));
  if (found == allocations_.end() || found->second.device != device) {
    throw Error(std::string(call) + ": invalid argument (not an allocation of this kind)");
  }
  (device == kPinned ? counters_.pinnedBytesAllocated : counters_.deviceBytesAllocated) -=
      found->second.bytes;
  allocations_.erase(found);
  std::free(pointer);
}

void* CudaEmulation::deviceAlloc(int device, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkDevice(device, "cudaMalloc");
  return allocate(device, bytes);
}

void CudaEmulation::deviceFree(int device, void* pointer) {
  std::lock_guard<std::mutex> lock(mutex_);
  release(device, pointer, "cudaFree");
}

void* CudaEmulation::applicationAlloc(int device, size_t bytes, bool virtualMemory) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkDevice(device, "cuMemCreate");
  return allocate(device, bytes, virtualMemory);
}

void* CudaEmulation::pinnedAlloc(int device, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkDevice(device, "cudaHostAlloc");
  return allocate(kPinned, bytes);
}

void CudaEmulation::pinnedFree(int device, void* pointer) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkDevice(device, "cudaFreeHost");
  release(kPinned, pointer, "cudaFreeHost");
}

CudaStream CudaEmulation::createStream(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkDevice(device, "cudaStreamCreateWithFlags");
  CudaStream stream;
  stream.device = device;
  stream.handle = reinterpret_cast<void*>(nextHandle_++);
  streams_.insert(reinterpret_cast<uintptr_t>(stream.handle));
  ++counters_.streams;
  return stream;
}

void CudaEmulation::destroyStream(const CudaStream& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkStream(stream, "cudaStreamDestroy");
  streams_.erase(reinterpret_cast<uintptr_t>(stream.handle));
  --counters_.streams;
}

CudaEvent CudaEmulation::createEvent(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkDevice(device, "cudaEventCreateWithFlags");
  CudaEvent event;
  event.device = device;
  event.handle = reinterpret_cast<void*>(nextHandle_++);
  events_[reinterpret_cast<uintptr_t>(event.handle)] = 0;
  ++counters_.events;
  return event;
}

void CudaEmulation::destroyEvent(const CudaEvent& event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!events_.erase(reinterpret_cast<uintptr_t>(event.handle))) {
    throw Error("cudaEventDestroy: invalid resource handle (no such event)");
  }
  --counters_.events;
}

void CudaEmulation::recordEvent(const CudaEvent& event, const CudaStream& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkStream(stream, "cudaEventRecord");
  if (!events_.count(reinterpret_cast<uintptr_t>(event.handle))) {
    throw Error("cudaEventRecord: invalid resource handle (no such event)");
  }
  if (event.device != stream.device) {
    throw Error("cudaEventRecord: the event and the stream belong to different devices");
  }
  events_[reinterpret_cast<uintptr_t>(event.handle)] = queriesBeforeDone_;
}

bool CudaEmulation::eventDone(const CudaEvent& event) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = events_.find(reinterpret_cast<uintptr_t>(event.handle));
  if (found == events_.end())
    throw Error("cudaEventQuery: invalid resource handle (no such event)");
  if (found->second > 0) --found->second;
  return found->second == 0;
}

void CudaEmulation::setQueriesBeforeDone(int queries) {
  if (queries < 1) throw Error("queries before an event is done: at least 1");
  std::lock_guard<std::mutex> lock(mutex_);
  queriesBeforeDone_ = queries;
  for (auto& [handle, left] : events_) left = std::min(left, queries);
}

void CudaEmulation::streamWaitEvent(const CudaStream& stream, const CudaEvent& event) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkStream(stream, "cudaStreamWaitEvent");
  if (!events_.count(reinterpret_cast<uintptr_t>(event.handle))) {
    throw Error("cudaStreamWaitEvent: invalid resource handle (no such event)");
  }
}

void CudaEmulation::copyToHostAsync(void* host, const void* device, size_t bytes,
                                    const CudaStream& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkStream(stream, "cudaMemcpyAsync (device to host)");
  checkMemory(device, bytes, stream.device, "cudaMemcpyAsync (device to host)");
  checkMemory(host, bytes, kPinned, "cudaMemcpyAsync (device to host)");
  std::memcpy(host, device, bytes);
  counters_.toHostBytes += bytes;
}

void CudaEmulation::copyToDeviceAsync(void* device, const void* host, size_t bytes,
                                      const CudaStream& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkStream(stream, "cudaMemcpyAsync (host to device)");
  checkMemory(device, bytes, stream.device, "cudaMemcpyAsync (host to device)");
  checkMemory(host, bytes, kPinned, "cudaMemcpyAsync (host to device)");
  std::memcpy(device, host, bytes);
  counters_.toDeviceBytes += bytes;
}

void CudaEmulation::copyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                  size_t bytes, const CudaStream& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkStream(stream, "cudaMemcpyPeerAsync");
  checkMemory(dst, bytes, dstDevice, "cudaMemcpyPeerAsync");
  checkMemory(src, bytes, srcDevice, "cudaMemcpyPeerAsync");
  const int other = stream.device == srcDevice ? dstDevice : srcDevice;
  if (stream.device != srcDevice && stream.device != dstDevice) {
    throw Error("cudaMemcpyPeerAsync: the stream's device is neither end of the copy");
  }
  if (other != stream.device && !peerAccess_.count({stream.device, other})) {
    throw Error("cudaMemcpyPeerAsync: device " + std::to_string(stream.device) +
                " has no peer access to device " + std::to_string(other));
  }
  std::memmove(dst, src, bytes);
  counters_.peerBytes += bytes;
}

void CudaEmulation::waitStream(const CudaStream& stream, int) {
  std::lock_guard<std::mutex> lock(mutex_);
  checkStream(stream, "cudaStreamQuery");  // copies ran when issued
}

CudaEmulation::Counters CudaEmulation::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

}  // namespace reccl
