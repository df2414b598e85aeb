#include "gpu/cuda_runtime.h"

#include <dlfcn.h>

#include <chrono>
#include <thread>

#include "core/clock.h"
#include "core/error.h"

namespace reccl {

namespace {

// The few runtime ABI facts used here (stable since CUDA 11): no CUDA headers
// are needed to build.
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorNotReady = 600;
constexpr int kCudaErrorPeerAccessAlreadyEnabled = 704;
constexpr int kMemcpyHostToDevice = 1;
constexpr int kMemcpyDeviceToHost = 2;
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kHostAllocPortable = 1;
constexpr unsigned kEventDisableTiming = 2;
constexpr int kMemoryTypeDevice = 2;

struct PointerAttributes {  // cudaPointerAttributes
  int type;
  int device;
  void* devicePointer;
  void* hostPointer;
  // CUDA 13 appended `long reserved[8]`; room for more, since the runtime
  // writes the whole struct of its own version.
  long reserved[32];
};

// torch and NCCL load the runtime first in a GPU job: reuse that copy.
constexpr const char* kLibraryNames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};

}  // namespace

struct CudaRuntime::Symbols {
  int (*getDeviceCount)(int*);
  int (*setDevice)(int);
  int (*getDevice)(int*);
  int (*pointerGetAttributes)(PointerAttributes*, const void*);
  int (*deviceGetPCIBusId)(char*, int, int);
  int (*deviceCanAccessPeer)(int*, int, int);
  int (*deviceEnablePeerAccess)(int, unsigned);
  int (*malloc)(void**, size_t);
  int (*free)(void*);
  int (*hostAlloc)(void**, size_t, unsigned);
  int (*freeHost)(void*);
  int (*streamCreateWithFlags)(void**, unsigned);
  int (*streamDestroy)(void*);
  int (*streamQuery)(void*);
  int (*eventCreateWithFlags)(void**, unsigned);
  int (*eventDestroy)(void*);
  int (*eventRecord)(void*, void*);
  int (*streamWaitEvent)(void*, void*, unsigned);
  int (*memcpyAsync)(void*, const void*, size_t, int, void*);
  int (*memcpyPeerAsync)(void*, int, const void*, int, size_t, void*);
  int (*getLastError)();
  const char* (*getErrorString)(int);
};

std::unique_ptr<CudaRuntime> CudaRuntime::load(std::string* error) {
  void* library = nullptr;
  for (const char* name : kLibraryNames) {
    library = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
    if (library != nullptr) break;
  }
  for (const char* name : kLibraryNames) {
    if (library != nullptr) break;
    library = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  }
  if (library == nullptr) {
    *error = "the CUDA runtime (libcudart.so.13/.12) is not loadable";
    return nullptr;
  }
  auto symbols = std::make_unique<Symbols>();
  std::string missing;
  auto bind = [&](auto& slot, const char* name) {
    void* symbol = dlsym(library, name);
    if (symbol == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(symbol);
  };
  bind(symbols->getDeviceCount, "cudaGetDeviceCount");
  bind(symbols->setDevice, "cudaSetDevice");
  bind(symbols->getDevice, "cudaGetDevice");
  bind(symbols->pointerGetAttributes, "cudaPointerGetAttributes");
  bind(symbols->deviceGetPCIBusId, "cudaDeviceGetPCIBusId");
  bind(symbols->deviceCanAccessPeer, "cudaDeviceCanAccessPeer");
  bind(symbols->deviceEnablePeerAccess, "cudaDeviceEnablePeerAccess");
  bind(symbols->malloc, "cudaMalloc");
  bind(symbols->free, "cudaFree");
  bind(symbols->hostAlloc, "cudaHostAlloc");
  bind(symbols->freeHost, "cudaFreeHost");
  bind(symbols->streamCreateWithFlags, "cudaStreamCreateWithFlags");
  bind(symbols->streamDestroy, "cudaStreamDestroy");
  bind(symbols->streamQuery, "cudaStreamQuery");
  bind(symbols->eventCreateWithFlags, "cudaEventCreateWithFlags");
  bind(symbols->eventDestroy, "cudaEventDestroy");
  bind(symbols->eventRecord, "cudaEventRecord");
  bind(symbols->streamWaitEvent, "cudaStreamWaitEvent");
  bind(symbols->memcpyAsync, "cudaMemcpyAsync");
  bind(symbols->memcpyPeerAsync, "cudaMemcpyPeerAsync");
  bind(symbols->getLastError, "cudaGetLastError");
  bind(symbols->getErrorString, "cudaGetErrorString");
  if (!missing.empty()) {
    dlclose(library);
    *error = "the CUDA runtime lacks " + missing;
    return nullptr;
  }
  return std::unique_ptr<CudaRuntime>(new CudaRuntime(library, std::move(symbols)));
}

std::unique_ptr<CudaRuntime> CudaRuntime::loadWithGpus(std::string* error) {
  std::unique_ptr<CudaRuntime> cuda = load(error);
  if (cuda && cuda->deviceCount() == 0) {
    *error = "the CUDA runtime sees no GPU";
    return nullptr;
  }
  return cuda;
}

CudaRuntime::CudaRuntime(void* library, std::unique_ptr<Symbols> symbols)
    : library_(library), symbols_(std::move(symbols)) {}

CudaRuntime::~CudaRuntime() { dlclose(library_); }

void CudaRuntime::check(int status, const char* call) const {
  if (status == kCudaSuccess) return;
  symbols_->getLastError();  // clears a non-sticky error so later calls start clean
  throw Error(std::string(call) + " failed: " + symbols_->getErrorString(status) + " (CUDA error " +
              std::to_string(status) + ")");
}

int CudaRuntime::deviceCount() {
  int count = 0;
  int status = symbols_->getDeviceCount(&count);
  if (status != kCudaSuccess) {
    symbols_->getLastError();
    return 0;  // no driver or no GPU: nothing to stage through
  }
  return count;
}

int CudaRuntime::deviceOf(const void* pointer) {
  PointerAttributes attributes{};
  int status = symbols_->pointerGetAttributes(&attributes, pointer);
  if (status != kCudaSuccess) {
    symbols_->getLastError();
    return -1;
  }
  return attributes.type == kMemoryTypeDevice ? attributes.device : -1;
}

std::string CudaRuntime::pciBusId(int device) {
  char id[64] = {};
  check(symbols_->deviceGetPCIBusId(id, sizeof(id), device), "cudaDeviceGetPCIBusId");
  return id;
}

bool CudaRuntime::canAccessPeer(int device, int peer) {
  int can = 0;
  check(symbols_->deviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
  return can != 0;
}

void CudaRuntime::enablePeerAccess(int device, int peer) {
  setDevice(device);
  int status = symbols_->deviceEnablePeerAccess(peer, 0);
  if (status == kCudaErrorPeerAccessAlreadyEnabled) {
    symbols_->getLastError();
    return;
  }
  check(status, "cudaDeviceEnablePeerAccess");
}

void CudaRuntime::setDevice(int device) { check(symbols_->setDevice(device), "cudaSetDevice"); }

int CudaRuntime::currentDevice() {
  int device = -1;
  if (symbols_->getDevice(&device) != kCudaSuccess) {
    symbols_->getLastError();
    return -1;
  }
  return device;
}

void* CudaRuntime::deviceAlloc(int device, size_t bytes) {
  setDevice(device);
  void* pointer = nullptr;
  check(symbols_->malloc(&pointer, bytes), "cudaMalloc");
  return pointer;
}

void CudaRuntime::deviceFree(int device, void* pointer) {
  setDevice(device);
  check(symbols_->free(pointer), "cudaFree");
}

void* CudaRuntime::pinnedAlloc(size_t bytes) {
  void* pointer = nullptr;
  check(symbols_->hostAlloc(&pointer, bytes, kHostAllocPortable), "cudaHostAlloc");
  return pointer;
}

void CudaRuntime::pinnedFree(void* pointer) { check(symbols_->freeHost(pointer), "cudaFreeHost"); }

CudaStream CudaRuntime::createStream(int device) {
  setDevice(device);
  CudaStream stream;
  stream.device = device;
  check(symbols_->streamCreateWithFlags(&stream.handle, kStreamNonBlocking), "cudaStreamCreateWithFlags");
  return stream;
}

void CudaRuntime::destroyStream(const CudaStream& stream) {
  setDevice(stream.device);
  check(symbols_->streamDestroy(stream.handle), "cudaStreamDestroy");
}

CudaEvent CudaRuntime::createEvent(int device) {
  setDevice(device);
  CudaEvent event;
  event.device = device;
  check(symbols_->eventCreateWithFlags(&event.handle, kEventDisableTiming), "cudaEventCreateWithFlags");
  return event;
}

void CudaRuntime::destroyEvent(const CudaEvent& event) {
  setDevice(event.device);
  check(symbols_->eventDestroy(event.handle), "cudaEventDestroy");
}

void CudaRuntime::recordEvent(const CudaEvent& event, const CudaStream& stream) {
  setDevice(stream.device);
  check(symbols_->eventRecord(event.handle, stream.handle), "cudaEventRecord");
}

void CudaRuntime::streamWaitEvent(const CudaStream& stream, const CudaEvent& event) {
  setDevice(stream.device);
  check(symbols_->streamWaitEvent(stream.handle, event.handle, 0), "cudaStreamWaitEvent");
}

void CudaRuntime::copyToHostAsync(void* host, const void* device, size_t bytes,
                                  const CudaStream& stream) {
  setDevice(stream.device);
  check(symbols_->memcpyAsync(host, device, bytes, kMemcpyDeviceToHost, stream.handle),
        "cudaMemcpyAsync (device to host)");
}

void CudaRuntime::copyToDeviceAsync(void* device, const void* host, size_t bytes,
                                    const CudaStream& stream) {
  setDevice(stream.device);
  check(symbols_->memcpyAsync(device, host, bytes, kMemcpyHostToDevice, stream.handle),
        "cudaMemcpyAsync (host to device)");
}

void CudaRuntime::copyPeerAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                size_t bytes, const CudaStream& stream) {
  setDevice(stream.device);
  check(symbols_->memcpyPeerAsync(dst, dstDevice, src, srcDevice, bytes, stream.handle),
        "cudaMemcpyPeerAsync");
}

void CudaRuntime::waitStream(const CudaStream& stream, int timeoutMs) {
  // Polled, not cudaStreamSynchronize: a wedged copy must not hang NCCL's proxy
  // thread. The first microseconds spin: most staged copies are that short.
  const auto deadline = Clock::now() + Millis(timeoutMs);
  for (int polls = 0;; ++polls) {
    int status = symbols_->streamQuery(stream.handle);
    if (status == kCudaSuccess) return;
    if (status != kCudaErrorNotReady) check(status, "cudaStreamQuery");
    if (Clock::now() > deadline) {
      throw Error("GPU copies on device " + std::to_string(stream.device) + " not done after " +
                  std::to_string(timeoutMs) + " ms");
    }
    if (polls > 200) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace reccl
