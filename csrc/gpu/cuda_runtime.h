// The CUDA runtime, loaded with dlopen at run time: reccl links no CUDA library,
// so it loads and runs on machines without one (CPU jobs, CI). Only the calls NVL
// staging needs, each checked: a failing call throws Error naming the call and
// CUDA's own message.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace reccl {

// A stream and the device it belongs to (calls on it make that device current).
struct CudaStream {
  int device = -1;
  void* handle = nullptr;  // cudaStream_t
};

// An event on a device, for ordering copies across streams.
struct CudaEvent {
  int device = -1;
  void* handle = nullptr;  // cudaEvent_t
};

class CudaRuntime {
 public:
  // The process's libcudart (the one torch or NCCL already loaded, else the first
  // that loads), or nullptr with the reason in `error`.
  static std::unique_ptr<CudaRuntime> load(std::string* error);
  ~CudaRuntime();
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  int deviceCount();
  // The CUDA device that owns `pointer`, or -1 for memory the runtime does not
  // know as device memory (host, pageable or pinned).
  int deviceOf(const void* pointer);
  std::string pciBusId(int device);  // "0000:3B:00.0"
  bool canAccessPeer(int device, int peer);
  // Lets `device` read and write `peer`'s memory; idempotent.
  void enablePeerAccess(int device, int peer);

  void setDevice(int device);
  int currentDevice();
  void* deviceAlloc(int device, size_t bytes);
  void deviceFree(int device, void* pointer);
  void* pinnedAlloc(size_t bytes);
  void pinnedFree(void* pointer);
  // A non-blocking stream on `device`: our copies never wait on NCCL's streams.
  CudaStream createStream(int device);
  void destroyStream(const CudaStream& stream);
  CudaEvent createEvent(int device);
  void destroyEvent(const CudaEvent& event);
  // `event` completes when everything queued on `stream` so far has.
  void recordEvent(const CudaEvent& event, const CudaStream& stream);
  // Work queued on `stream` after this waits for `event`'s last record.
  void streamWaitEvent(const CudaStream& stream, const CudaEvent& event);

  // Copies queued on `stream`: device<->host and device->device (any devices).
  void copyToHostAsync(void* host, const void* device, size_t bytes, const CudaStream& stream);
  void copyToDeviceAsync(void* device, const void* host, size_t bytes, const CudaStream& stream);
  void copyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t bytes,
                     const CudaStream& stream);
  // Waits for everything queued on `stream`, at most `timeoutMs`; throws Error
  // on a CUDA error or when the copies are not done by then.
  void waitStream(const CudaStream& stream, int timeoutMs);

  struct Symbols;  // the loaded entry points (cuda_runtime.cc)

  // Restores the calling thread's current device on scope exit: the plugin runs
  // on NCCL's proxy thread, whose device NCCL set and relies on.
  class DeviceScope {
   public:
    explicit DeviceScope(CudaRuntime& cuda) : cuda_(cuda), saved_(cuda.currentDevice()) {}
    ~DeviceScope() {
      try {
        if (saved_ >= 0) cuda_.setDevice(saved_);
      } catch (const std::exception&) {
        // a failing runtime already failed the call in this scope
      }
    }
    DeviceScope(const DeviceScope&) = delete;
    DeviceScope& operator=(const DeviceScope&) = delete;

   private:
    CudaRuntime& cuda_;
    int saved_;
  };

 private:
  CudaRuntime(void* library, std::unique_ptr<Symbols> symbols);
  void check(int status, const char* call) const;

  void* library_;
  std::unique_ptr<Symbols> symbols_;
};

}  // namespace reccl
