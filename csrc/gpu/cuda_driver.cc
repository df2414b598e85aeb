#include "gpu/cuda_driver.h"

#include <dlfcn.h>

#include <chrono>
#include <thread>

#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"

namespace reccl {

namespace {

// The few driver ABI facts used here (stable since CUDA 11): no CUDA headers
// are needed to build.
constexpr int kSuccess = 0;
constexpr int kErrorNotReady = 600;
constexpr int kErrorPeerAccessAlreadyEnabled = 704;
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kEventDisableTiming = 2;
constexpr unsigned kHostAllocPortable = 1;
constexpr int kPointerAttributeMemoryType = 2;
constexpr int kPointerAttributeDeviceOrdinal = 9;
constexpr unsigned kMemoryTypeDevice = 2;
constexpr int kDeviceAttributeDmaBufSupported = 124;  // CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED

using Context = void*;
using DevicePointer = unsigned long long;  // CUdeviceptr

DevicePointer devicePointer(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer); }

}  // namespace

struct CudaDriver::Symbols {
  int (*init)(unsigned);
  int (*deviceGetCount)(int*);
  int (*deviceGet)(int*, int);
  int (*deviceGetPciBusId)(char*, int, int);
  int (*deviceCanAccessPeer)(int*, int, int);
  int (*deviceGetAttribute)(int*, int, int);
  int (*ctxCreate)(Context*, unsigned, int);
  int (*ctxDestroy)(Context);
  int (*ctxPopCurrent)(Context*);
  int (*ctxGetCurrent)(Context*);
  int (*ctxSetCurrent)(Context);
  int (*ctxGetDevice)(int*);
  int (*ctxEnablePeerAccess)(Context, unsigned);
  int (*pointerGetAttribute)(void*, int, DevicePointer);
  int (*memRetainAllocationHandle)(unsigned long long*, void*);
  int (*memRelease)(unsigned long long);
  int (*memAlloc)(DevicePointer*, size_t);
  int (*memFree)(DevicePointer);
  int (*memHostAlloc)(void**, size_t, unsigned);
  int (*memFreeHost)(void*);
  int (*streamCreate)(void**, unsigned);
  int (*streamDestroy)(void*);
  int (*streamQuery)(void*);
  int (*eventCreate)(void**, unsigned);
  int (*eventDestroy)(void*);
  int (*eventRecord)(void*, void*);
  int (*streamWaitEvent)(void*, void*, unsigned);
  int (*eventQuery)(void*);
  int (*memcpyDtoHAsync)(void*, DevicePointer, size_t, void*);
  int (*memcpyHtoDAsync)(DevicePointer, const void*, size_t, void*);
  int (*memcpyAsync)(DevicePointer, DevicePointer, size_t, void*);
  int (*getErrorString)(int, const char**);
};

// Makes reccl's context on `device` current on this thread for one call and
// puts the thread's own context back afterwards.
class CudaDriver::InContext {
 public:
  InContext(CudaDriver& driver, int device) : driver_(driver) {
    Context ours = driver.contextFor(device);
    driver.check(driver.symbols_->ctxGetCurrent(&saved_), "cuCtxGetCurrent");
    if (saved_ != ours) driver.check(driver.symbols_->ctxSetCurrent(ours), "cuCtxSetCurrent");
    switched_ = saved_ != ours;
  }
  ~InContext() {
    if (switched_) driver_.symbols_->ctxSetCurrent(saved_);
  }
  InContext(const InContext&) = delete;
  InContext& operator=(const InContext&) = delete;

 private:
  CudaDriver& driver_;
  Context saved_ = nullptr;
  bool switched_ = false;
};

std::unique_ptr<CudaDriver> CudaDriver::load(std::string* error) {
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    *error = "the CUDA driver (libcuda.so.1) is not loadable";
    return nullptr;
  }
  auto symbols = std::make_unique<Symbols>();
  std::string missing;
  auto bind = [&](auto& slot, const char* name) {
    void* symbol = dlsym(library, name);
    if (symbol == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(symbol);
  };
  bind(symbols->init, "cuInit");
  bind(symbols->deviceGetCount, "cuDeviceGetCount");
  bind(symbols->deviceGet, "cuDeviceGet");
  bind(symbols->deviceGetPciBusId, "cuDeviceGetPCIBusId");
  bind(symbols->deviceCanAccessPeer, "cuDeviceCanAccessPeer");
  bind(symbols->deviceGetAttribute, "cuDeviceGetAttribute");
  bind(symbols->ctxCreate, "cuCtxCreate_v2");
  bind(symbols->ctxDestroy, "cuCtxDestroy_v2");
  bind(symbols->ctxPopCurrent, "cuCtxPopCurrent_v2");
  bind(symbols->ctxGetCurrent, "cuCtxGetCurrent");
  bind(symbols->ctxSetCurrent, "cuCtxSetCurrent");
  bind(symbols->ctxGetDevice, "cuCtxGetDevice");
  bind(symbols->ctxEnablePeerAccess, "cuCtxEnablePeerAccess");
  bind(symbols->pointerGetAttribute, "cuPointerGetAttribute");
  bind(symbols->memRetainAllocationHandle, "cuMemRetainAllocationHandle");
  bind(symbols->memRelease, "cuMemRelease");
  bind(symbols->memAlloc, "cuMemAlloc_v2");
  bind(symbols->memFree, "cuMemFree_v2");
  bind(symbols->memHostAlloc, "cuMemHostAlloc");
  bind(symbols->memFreeHost, "cuMemFreeHost");
  bind(symbols->streamCreate, "cuStreamCreate");
  bind(symbols->streamDestroy, "cuStreamDestroy_v2");
  bind(symbols->streamQuery, "cuStreamQuery");
  bind(symbols->eventCreate, "cuEventCreate");
  bind(symbols->eventDestroy, "cuEventDestroy_v2");
  bind(symbols->eventRecord, "cuEventRecord");
  bind(symbols->streamWaitEvent, "cuStreamWaitEvent");
  bind(symbols->eventQuery, "cuEventQuery");
  bind(symbols->memcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  bind(symbols->memcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  bind(symbols->memcpyAsync, "cuMemcpyAsync");
  bind(symbols->getErrorString, "cuGetErrorString");
  if (!missing.empty()) {
    *error = "the CUDA driver lacks " + missing;
    return nullptr;
  }
  int devices = 0;
  if (symbols->init(0) != kSuccess || symbols->deviceGetCount(&devices) != kSuccess ||
      devices == 0) {
    *error = "the CUDA driver sees no GPU";
    return nullptr;
  }
  return std::unique_ptr<CudaDriver>(new CudaDriver(library, std::move(symbols), devices));
}

CudaDriver::CudaDriver(void* library, std::unique_ptr<Symbols> symbols, int devices)
    : library_(library),
      symbols_(std::move(symbols)),
      contexts_(static_cast<size_t>(devices), nullptr) {}

CudaDriver::~CudaDriver() {
  // At process exit the driver may be shut down already; nothing to report then.
  for (Context context : contexts_) {
    if (context != nullptr) symbols_->ctxDestroy(context);
  }
  dlclose(library_);
}

void CudaDriver::check(int status, const char* call) const {
  if (status == kSuccess) return;
  const char* text = nullptr;
  if (symbols_->getErrorString(status, &text) != kSuccess || text == nullptr)
    text = "unknown error";
  throw Error(std::string(call) + " failed: " + text + " (CUDA error " + std::to_string(status) +
              ")");
}

void* CudaDriver::contextFor(int device) {
  if (device < 0 || device >= deviceCount()) {
    throw Error("CUDA device " + std::to_string(device) + " does not exist (valid: 0.." +
                std::to_string(deviceCount() - 1) + ")");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Context& context = contexts_[static_cast<size_t>(device)];
  if (context != nullptr) return context;
  int handle = 0;
  check(symbols_->deviceGet(&handle, device), "cuDeviceGet");
  check(symbols_->ctxCreate(&context, 0, handle), "cuCtxCreate");
  Context pushed = nullptr;  // cuCtxCreate made it current; give the thread its own back
  check(symbols_->ctxPopCurrent(&pushed), "cuCtxPopCurrent");
  RECCL_LOG(kInfo, "NVL: own CUDA context on device " + std::to_string(device));
  return context;
}

int CudaDriver::deviceOf(const void* pointer) {
  unsigned type = 0;
  int ordinal = -1;
  if (symbols_->pointerGetAttribute(&type, kPointerAttributeMemoryType, devicePointer(pointer)) !=
          kSuccess ||
      type != kMemoryTypeDevice ||
      symbols_->pointerGetAttribute(&ordinal, kPointerAttributeDeviceOrdinal,
                                    devicePointer(pointer)) != kSuccess) {
    return -1;
  }
  return ordinal;
}

bool CudaDriver::isVirtualMemory(const void* pointer) {
  unsigned long long allocation = 0;
  if (symbols_->memRetainAllocationHandle(&allocation, const_cast<void*>(pointer)) != kSuccess)
    return false;
  symbols_->memRelease(allocation);
  return true;
}

std::string CudaDriver::pciBusId(int device) {
  char id[64] = {};
  int handle = 0;
  check(symbols_->deviceGet(&handle, device), "cuDeviceGet");
  check(symbols_->deviceGetPciBusId(id, sizeof(id), handle), "cuDeviceGetPCIBusId");
  return id;
}

bool CudaDriver::canAccessPeer(int device, int peer) {
  int can = 0, a = 0, b = 0;
  check(symbols_->deviceGet(&a, device), "cuDeviceGet");
  check(symbols_->deviceGet(&b, peer), "cuDeviceGet");
  check(symbols_->deviceCanAccessPeer(&can, a, b), "cuDeviceCanAccessPeer");
  return can != 0;
}

bool CudaDriver::supportsDmaBuf(std::string* why) {
  for (int device = 0; device < deviceCount(); ++device) {
    int handle = 0, supported = 0;
    check(symbols_->deviceGet(&handle, device), "cuDeviceGet");
    if (symbols_->deviceGetAttribute(&supported, kDeviceAttributeDmaBufSupported, handle) !=
            kSuccess ||
        supported == 0) {
      *why =
          "CUDA device " + std::to_string(device) +
          " cannot export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: needs driver 470+ and "
          "Linux 5.12+)";
      return false;
    }
  }
  return true;
}

void CudaDriver::enablePeerAccess(int device, int peer) {
  Context peerContext = contextFor(peer);
  InContext in(*this, device);
  int status = symbols_->ctxEnablePeerAccess(peerContext, 0);
  if (status != kErrorPeerAccessAlreadyEnabled) check(status, "cuCtxEnablePeerAccess");
}

int CudaDriver::currentDevice() {
  Context context = nullptr;
  int device = -1;
  if (symbols_->ctxGetCurrent(&context) != kSuccess || context == nullptr ||
      symbols_->ctxGetDevice(&device) != kSuccess) {
    return -1;
  }
  return device;
}

void* CudaDriver::deviceAlloc(int device, size_t bytes) {
  InContext in(*this, device);
  DevicePointer pointer = 0;
  check(symbols_->memAlloc(&pointer, bytes), "cuMemAlloc");
  return reinterpret_cast<void*>(static_cast<uintptr_t>(pointer));
}

void CudaDriver::deviceFree(int device, void* pointer) {
  InContext in(*this, device);
  check(symbols_->memFree(devicePointer(pointer)), "cuMemFree");
}

void* CudaDriver::pinnedAlloc(int device, size_t bytes) {
  InContext in(*this, device);
  void* pointer = nullptr;
  check(symbols_->memHostAlloc(&pointer, bytes, kHostAllocPortable), "cuMemHostAlloc");
  return pointer;
}

void CudaDriver::pinnedFree(int device, void* pointer) {
  InContext in(*this, device);
  check(symbols_->memFreeHost(pointer), "cuMemFreeHost");
}

CudaStream CudaDriver::createStream(int device) {
  InContext in(*this, device);
  CudaStream stream;
  stream.device = device;
  check(symbols_->streamCreate(&stream.handle, kStreamNonBlocking), "cuStreamCreate");
  return stream;
}

void CudaDriver::destroyStream(const CudaStream& stream) {
  InContext in(*this, stream.device);
  check(symbols_->streamDestroy(stream.handle), "cuStreamDestroy");
}

CudaEvent CudaDriver::createEvent(int device) {
  InContext in(*this, device);
  CudaEvent event;
  event.device = device;
  check(symbols_->eventCreate(&event.handle, kEventDisableTiming), "cuEventCreate");
  return event;
}

void CudaDriver::destroyEvent(const CudaEvent& event) {
  InContext in(*this, event.device);
  check(symbols_->eventDestroy(event.handle), "cuEventDestroy");
}

void CudaDriver::recordEvent(const CudaEvent& event, const CudaStream& stream) {
  InContext in(*this, stream.device);
  check(symbols_->eventRecord(event.handle, stream.handle), "cuEventRecord");
}

void CudaDriver::streamWaitEvent(const CudaStream& stream, const CudaEvent& event) {
  InContext in(*this, stream.device);
  check(symbols_->streamWaitEvent(stream.handle, event.handle, 0), "cuStreamWaitEvent");
}

bool CudaDriver::eventDone(const CudaEvent& event) {
  InContext in(*this, event.device);
  int status = symbols_->eventQuery(event.handle);
  if (status == kErrorNotReady) return false;
  check(status, "cuEventQuery");
  return true;
}

void CudaDriver::copyToHostAsync(void* host, const void* device, size_t bytes,
                                 const CudaStream& stream) {
  InContext in(*this, stream.device);
  check(symbols_->memcpyDtoHAsync(host, devicePointer(device), bytes, stream.handle),
        "cuMemcpyDtoHAsync");
}

void CudaDriver::copyToDeviceAsync(void* device, const void* host, size_t bytes,
                                   const CudaStream& stream) {
  InContext in(*this, stream.device);
  check(symbols_->memcpyHtoDAsync(devicePointer(device), host, bytes, stream.handle),
        "cuMemcpyHtoDAsync");
}

void CudaDriver::copyPeerAsync(void* dst, int, const void* src, int, size_t bytes,
                               const CudaStream& stream) {
  // Unified addressing names both ends; the stream's context has peer access.
  InContext in(*this, stream.device);
  check(symbols_->memcpyAsync(devicePointer(dst), devicePointer(src), bytes, stream.handle),
        "cuMemcpyAsync");
}

void CudaDriver::waitStream(const CudaStream& stream, int timeoutMs) {
  // Polled, not cuStreamSynchronize: a wedged copy must not hang NCCL's proxy
  // thread. The first microseconds spin: most staged copies are that short.
  InContext in(*this, stream.device);
  const auto deadline = Clock::now() + Millis(timeoutMs);
  for (int polls = 0;; ++polls) {
    int status = symbols_->streamQuery(stream.handle);
    if (status == kSuccess) return;
    if (status != kErrorNotReady) check(status, "cuStreamQuery");
    if (Clock::now() > deadline) {
      throw Error("GPU copies on device " + std::to_string(stream.device) + " not done after " +
                  std::to_string(timeoutMs) + " ms");
    }
    if (polls > 200) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace reccl
