// What NVL needs from CUDA: devices, memory, streams, events and copies. Two
// implementations: the CUDA driver with reccl's own contexts (cuda_driver.h)
// and an in-process emulation for tests without GPUs (testing/cuda_emulation.h, in
// the test module torch_reccl._testing only). Every
// call throws Error on failure, naming the call.
#pragma once

#include <cstddef>
#include <string>

namespace reccl {

// A stream and the device it belongs to (calls on it make that device current).
struct CudaStream {
  int device = -1;
  void* handle = nullptr;  // CUstream
};

// An event on a device, for ordering copies across streams.
struct CudaEvent {
  int device = -1;
  void* handle = nullptr;  // CUevent
};

class CudaApi {
 public:
  virtual ~CudaApi() = default;

  virtual int deviceCount() = 0;
  // The CUDA device that owns `pointer`, or -1 for memory CUDA does not know
  // as device memory (host, pageable or pinned).
  virtual int deviceOf(const void* pointer) = 0;
  // True for memory from CUDA's virtual memory API (cuMemCreate + cuMemMap, as
  // NCCL allocates its buffers by default). No context owns such memory, so
  // copies from reccl's own context never wait for the application's context;
  // cudaMalloc memory belongs to the context that allocated it, and a copy of
  // it waits behind that context's lock (held, for one, by every pageable
  // host-to-device copy the application makes while it waits on our copy).
  virtual bool isVirtualMemory(const void* pointer) = 0;
  virtual std::string pciBusId(int device) = 0;  // "0000:3B:00.0"
  virtual bool canAccessPeer(int device, int peer) = 0;
  // Whether every device can export its memory as a dma-buf
  // (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: driver 470+, kernel 5.12+); if
  // not, why not. A NIC reaches GPU memory by dma-buf only where this holds.
  virtual bool supportsDmaBuf(std::string* why) = 0;
  // Lets `device` read and write `peer`'s memory; idempotent.
  virtual void enablePeerAccess(int device, int peer) = 0;

  // The device of the calling thread's current CUDA context (NCCL sets it on
  // its threads), or -1 where none is current.
  virtual int currentDevice() = 0;
  virtual void* deviceAlloc(int device, size_t bytes) = 0;
  virtual void deviceFree(int device, void* pointer) = 0;
  // Page-locked host memory usable from every context, allocated through
  // `device` (the GPU that copies to and from it).
  virtual void* pinnedAlloc(int device, size_t bytes) = 0;
  virtual void pinnedFree(int device, void* pointer) = 0;
  // A non-blocking stream on `device`: our copies never wait on NCCL's streams.
  virtual CudaStream createStream(int device) = 0;
  virtual void destroyStream(const CudaStream& stream) = 0;
  virtual CudaEvent createEvent(int device) = 0;
  virtual void destroyEvent(const CudaEvent& event) = 0;
  // `event` completes when everything queued on `stream` so far has.
  virtual void recordEvent(const CudaEvent& event, const CudaStream& stream) = 0;
  // Work queued on `stream` after this waits for `event`'s last record.
  virtual void streamWaitEvent(const CudaStream& stream, const CudaEvent& event) = 0;
  // Whether the work before `event`'s last record has finished; never waits.
  virtual bool eventDone(const CudaEvent& event) = 0;

  // Copies queued on `stream`: device<->host and device->device (any devices).
  virtual void copyToHostAsync(void* host, const void* device, size_t bytes,
                               const CudaStream& stream) = 0;
  virtual void copyToDeviceAsync(void* device, const void* host, size_t bytes,
                                 const CudaStream& stream) = 0;
  virtual void copyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t bytes,
                             const CudaStream& stream) = 0;
  // Waits for everything queued on `stream`, at most `timeoutMs`; throws Error
  // on a CUDA error or when the copies are not done by then.
  virtual void waitStream(const CudaStream& stream, int timeoutMs) = 0;
};

}  // namespace reccl
