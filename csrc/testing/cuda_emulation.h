// An in-process CUDA for tests on machines without GPUs: `devices` devices whose
// memory is host memory tracked per allocation, so NVL's whole path in the
// plugin (GPU buffers registered with NCCL's regMr, staging through pinned
// mirrors, transit through another device) runs in CI. Copies execute when
// they are issued, so streams and events are always complete. Every pointer is
// checked against the allocations of the device or memory kind the call names,
// and a peer copy needs peer access from the stream's device: a call the real
// runtime would refuse (or run slowly through the host) throws Error here.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>

#include "gpu/cuda_api.h"

namespace reccl {

class CudaEmulation : public CudaApi {
 public:
  explicit CudaEmulation(int devices);
  ~CudaEmulation() override;  // frees what is still allocated

  // CudaApi (cuda_api.h says what each call does)
  int deviceCount() override { return devices_; }
  int deviceOf(const void* pointer) override;
  bool isVirtualMemory(const void* pointer) override;
  std::string pciBusId(int device) override;
  bool canAccessPeer(int device, int peer) override;
  bool supportsDmaBuf(std::string* why) override;
  // For tests: whether the emulated devices can export dma-bufs (default yes).
  void setDmaBuf(bool supported);
  void enablePeerAccess(int device, int peer) override;
  int currentDevice() override { return 0; }  // the emulated NCCL thread's device
  void* deviceAlloc(int device, size_t bytes) override;
  void deviceFree(int device, void* pointer) override;
  void* pinnedAlloc(int device, size_t bytes) override;
  void pinnedFree(int device, void* pointer) override;
  CudaStream createStream(int device) override;
  void destroyStream(const CudaStream& stream) override;
  CudaEvent createEvent(int device) override;
  void destroyEvent(const CudaEvent& event) override;
  void recordEvent(const CudaEvent& event, const CudaStream& stream) override;
  void streamWaitEvent(const CudaStream& stream, const CudaEvent& event) override;
  // Copies run when issued, but an event reports done only at the
  // `queriesBeforeDone`-th query after its record (default 1), so callers meet
  // copies still in flight; setting it also shortens the wait of events
  // recorded already.
  bool eventDone(const CudaEvent& event) override;
  void setQueriesBeforeDone(int queries);
  void copyToHostAsync(void* host, const void* device, size_t bytes,
                       const CudaStream& stream) override;
  void copyToDeviceAsync(void* device, const void* host, size_t bytes,
                         const CudaStream& stream) override;
  void copyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t bytes,
                     const CudaStream& stream) override;
  void waitStream(const CudaStream& stream, int timeoutMs) override;

  // For tests: device memory as the application (NCCL) allocates it, from the
  // virtual memory API or (false) from cudaMalloc.
  void* applicationAlloc(int device, size_t bytes, bool virtualMemory);

  // For tests: bytes copied by kind, live objects.
  struct Counters {
    uint64_t toHostBytes = 0, toDeviceBytes = 0, peerBytes = 0;
    uint64_t deviceBytesAllocated = 0, pinnedBytesAllocated = 0;
    int streams = 0, events = 0, peerLinks = 0;
  };
  Counters counters() const;

 private:
  static constexpr int kPinned = -1;  // the "device" of pinned host memory
  std::atomic<bool> dmaBuf_{true};
  struct Allocation {
    int device;
    size_t bytes;
    bool virtualMemory;
  };
  void* allocate(int device, size_t bytes, bool virtualMemory = false);
  // The allocation `pointer` lies in, or nullptr.
  const Allocation* allocationAt(const void* pointer) const;
  void release(int device, void* pointer, const char* call);
  // Throws unless [pointer, pointer + bytes) lies in one allocation of `device`.
  void checkMemory(const void* pointer, size_t bytes, int device, const char* call) const;
  void checkDevice(int device, const char* call) const;
  void checkStream(const CudaStream& stream, const char* call) const;

  const int devices_;
  mutable std::mutex mutex_;
  std::map<uintptr_t, Allocation> allocations_;  // by start address
  std::set<std::pair<int, int>> peerAccess_;     // (device, peer)
  std::set<uintptr_t> streams_;
  std::map<uintptr_t, int> events_;  // handle -> queries left before it reports done
  int queriesBeforeDone_ = 1;
  uintptr_t nextHandle_ = 1;
  Counters counters_;
};

}  // namespace reccl
