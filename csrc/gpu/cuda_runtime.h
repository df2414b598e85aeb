// The CUDA runtime, loaded with dlopen at run time: reccl links no CUDA library,
// so it loads and runs on machines without one (CPU jobs, CI). Only the calls NVL
// staging needs, each checked: a failing call throws Error naming the call and
// CUDA's own message.
#pragma once

#include <memory>
#include <string>

#include "gpu/cuda_api.h"

namespace reccl {

class CudaRuntime : public CudaApi {
 public:
  // The process's libcudart (the one torch or NCCL already loaded, else the first
  // that loads), or nullptr with the reason in `error`.
  static std::unique_ptr<CudaRuntime> load(std::string* error);
  // load(), and nullptr with "the CUDA runtime sees no GPU" where it sees none.
  static std::unique_ptr<CudaRuntime> loadWithGpus(std::string* error);
  ~CudaRuntime() override;
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  // CudaApi (cuda_api.h says what each call does)
  int deviceCount() override;
  int deviceOf(const void* pointer) override;
  std::string pciBusId(int device) override;
  bool canAccessPeer(int device, int peer) override;
  void enablePeerAccess(int device, int peer) override;

  void setDevice(int device) override;
  int currentDevice() override;
  void* deviceAlloc(int device, size_t bytes) override;
  void deviceFree(int device, void* pointer) override;
  void* pinnedAlloc(size_t bytes) override;
  void pinnedFree(void* pointer) override;
  CudaStream createStream(int device) override;
  void destroyStream(const CudaStream& stream) override;
  CudaEvent createEvent(int device) override;
  void destroyEvent(const CudaEvent& event) override;
  void recordEvent(const CudaEvent& event, const CudaStream& stream) override;
  void streamWaitEvent(const CudaStream& stream, const CudaEvent& event) override;

  void copyToHostAsync(void* host, const void* device, size_t bytes, const CudaStream& stream) override;
  void copyToDeviceAsync(void* device, const void* host, size_t bytes, const CudaStream& stream) override;
  void copyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t bytes,
                     const CudaStream& stream) override;
  void waitStream(const CudaStream& stream, int timeoutMs) override;

  struct Symbols;  // the loaded entry points (cuda_runtime.cc)

 private:
  CudaRuntime(void* library, std::unique_ptr<Symbols> symbols);
  void check(int status, const char* call) const;

  void* library_;
  std::unique_ptr<Symbols> symbols_;
};

}  // namespace reccl
