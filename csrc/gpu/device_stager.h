// Moves one message between a CUDA buffer and pinned host memory for the NCCL
// plugin: directly over the buffer GPU's own PCIe link, or by NVL through a
// transit buffer on another GPU (the one next to the NIC carrying the data):
// an NVLink copy, then that GPU's short hop to the host. Copies run on
// dedicated non-blocking streams, never NCCL's. Everything is allocated by
// prepare(), when NCCL registers a buffer: the copy calls allocate nothing, so
// they never wait behind NCCL's running kernels. Calls come from one thread at
// a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "gpu/cuda_api.h"

namespace reccl {

class DeviceStager {
 public:
  // `maxTransitBytes` caps the transit buffer on each transit GPU (larger
  // messages go in pieces); `timeoutMs` bounds every wait for the copies.
  DeviceStager(std::shared_ptr<CudaApi> cuda, int64_t maxTransitBytes, int timeoutMs);

  // Streams for `bufferGpu` and, per GPU in `transitGpus`, peer access, streams,
  // events and a transit buffer of min(`messageBytes`, cap). Once per stager.
  void prepare(int bufferGpu, size_t messageBytes, const std::vector<int>& transitGpus);
  ~DeviceStager();  // frees transit buffers, events and streams
  DeviceStager(const DeviceStager&) = delete;
  DeviceStager& operator=(const DeviceStager&) = delete;

  // GPU -> host: `bytes` of `src` (on `srcGpu`) into `host`; through
  // `transitGpu` unless it is -1 or was not prepared. Returns when the bytes
  // are in `host`.
  void toHost(uint8_t* host, const uint8_t* src, int srcGpu, size_t bytes, int transitGpu);
  // host -> GPU: `bytes` of `host` into `dst` (on `dstGpu`), through
  // `transitGpu` unless it is -1. Returns when the bytes are in `dst`.
  void toDevice(uint8_t* dst, int dstGpu, const uint8_t* host, size_t bytes, int transitGpu);

  // Transit GPU memory this stager holds now, in bytes.
  int64_t transitBytes() const { return transitBytes_; }

 private:
  // One of two lanes of a route: the NVLink leg runs on the buffer GPU's stream
  // (that GPU can always reach its own memory, however NCCL allocated it; the
  // transit buffer is plain cudaMalloc memory with peer access enabled), the
  // PCIe leg on the transit GPU's stream; events order the two.
  struct Lane {
    CudaStream bufferStream, transitStream;
    CudaEvent bufferDone, transitDone;
    bool used = false;  // events recorded at least once
  };
  struct Route {
    void* buffer = nullptr;  // on the transit GPU
    size_t bytes = 0;
    Lane lanes[2];
  };
  const CudaStream& directStream(int gpu);
  // The prepared route from `bufferGpu` through `transitGpu`, or nullptr.
  Route* routeFor(int bufferGpu, int transitGpu);
  // Runs copy(stream) on `gpu`'s own stream and waits for it: no transit.
  template <typename Copy>
  void copyDirect(int gpu, Copy&& copy);
  // Splits a message into pieces the size of the transit buffer (or of half of
  // it, alternating lanes, when it does not fit) and hands each to `copyPiece`.
  template <typename CopyPiece>
  void inPieces(Route& route, size_t bytes, CopyPiece&& copyPiece);

  std::shared_ptr<CudaApi> cuda_;
  const size_t maxTransitBytes_;
  const int timeoutMs_;
  bool prepared_ = false;
  std::map<int, CudaStream> direct_;              // by buffer GPU
  std::map<std::pair<int, int>, Route> routes_;   // by (buffer GPU, transit GPU)
  int64_t transitBytes_ = 0;
};

}  // namespace reccl
