// The CUDA driver (libcuda), loaded with dlopen at run time: reccl links no CUDA
// library, so it loads and runs on machines without one (CPU jobs, CI).
//
// Every call runs in reccl's own CUDA context on the device it names, never in
// the application's (primary) context. NVL's copies run on NCCL's proxy thread
// while NCCL's kernel waits for them; a CUDA call in the primary context then
// waits for that context's lock, which the application holds whenever one of
// its threads sits in a call that waits for the GPU (a pageable host-to-device
// copy behind the collective does, and torch's `tensor.cuda()` is one): the
// kernel waits for the copy, the copy for the lock, the lock for the kernel.
// Measured on H200 (CUDA 13): a copy issued in the primary context waited the
// whole 2.5 s such a copy held the lock, the same copy from an own context
// 0.8 ms, provided the memory it touches is no context's (see
// CudaApi::isVirtualMemory). The thread's current context is restored after
// each call, since NCCL's threads rely on theirs.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gpu/cuda_api.h"

namespace reccl {

class CudaDriver : public CudaApi {
 public:
  // libcuda (the copy the process already loaded, else the first that loads),
  // initialised; nullptr with the reason in `error` when it is missing or sees
  // no GPU.
  static std::unique_ptr<CudaDriver> load(std::string* error);
  ~CudaDriver() override;  // destroys reccl's contexts (everything in them is freed by then)
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  // CudaApi (cuda_api.h says what each call does)
  int deviceCount() override { return static_cast<int>(contexts_.size()); }
  int deviceOf(const void* pointer) override;
  bool isVirtualMemory(const void* pointer) override;
  std::string pciBusId(int device) override;
  bool canAccessPeer(int device, int peer) override;
  bool supportsDmaBuf(std::string* why) override;
  void enablePeerAccess(int device, int peer) override;

  int currentDevice() override;
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
  bool eventDone(const CudaEvent& event) override;

  void copyToHostAsync(void* host, const void* device, size_t bytes,
                       const CudaStream& stream) override;
  void copyToDeviceAsync(void* device, const void* host, size_t bytes,
                         const CudaStream& stream) override;
  void copyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t bytes,
                     const CudaStream& stream) override;
  void waitStream(const CudaStream& stream, int timeoutMs) override;

  struct Symbols;  // the loaded entry points (cuda_driver.cc)

 private:
  class InContext;  // makes reccl's context on a device current for one call
  CudaDriver(void* library, std::unique_ptr<Symbols> symbols, int devices);
  void check(int status, const char* call) const;
  // reccl's context on `device`, created on first use (a context holds GPU
  // memory of its own, so only devices NVL uses get one).
  void* contextFor(int device);

  void* library_;
  std::unique_ptr<Symbols> symbols_;
  std::mutex mutex_;
  std::vector<void*> contexts_;  // CUcontext per device ordinal, null until used
};

}  // namespace reccl
