// Moves one message between a CUDA buffer and pinned host memory for the NCCL
// plugin: directly over the buffer GPU's own PCIe link, or by NVL through a
// transit buffer on another GPU (the one next to the NIC carrying the data):
// an NVLink copy, then that GPU's short hop to the host. Copies run on
// dedicated non-blocking streams, never NCCL's. Everything is allocated by
// prepare(), when NCCL registers a buffer: the copy calls allocate nothing, so
// they never wait behind NCCL's running kernels. Copies are queued and polled
// (start*/done), so the caller (NCCL's proxy thread) goes on with other
// connections while they run. Calls come from one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "core/clock.h"

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

  // The copies of one message, queued; done() says when they finished.
  struct Transfer {
    int device = -1;  // where the completion event lives; -1: nothing queued
    int slot = -1;
    Clock::time_point deadline{};
  };
  // How many transfers may be in flight at once; a start* beyond that returns
  // nothing (the caller retries later, as NCCL does with a NULL request).
  static constexpr int kMaxInFlight = 16;

  // GPU -> host: queues `bytes` of `src` (on `srcGpu`) into `host`; through
  // `transitGpu` unless it is -1 or was not prepared.
  std::optional<Transfer> startToHost(uint8_t* host, const uint8_t* src, int srcGpu, size_t bytes,
                                      int transitGpu);
  // host -> GPU: queues `bytes` of `host` into `dst` (on `dstGpu`), through
  // `transitGpu` unless it is -1.
  std::optional<Transfer> startToDevice(uint8_t* dst, int dstGpu, const uint8_t* host, size_t bytes,
                                        int transitGpu);
  // True once the transfer's bytes are in place (then it is finished for
  // good); throws Error on a CUDA error or when they are not by the deadline
  // (`timeoutMs` after the start).
  bool done(Transfer& transfer);
  // start* and wait: for tools and benches.
  void toHost(uint8_t* host, const uint8_t* src, int srcGpu, size_t bytes, int transitGpu);
  void toDevice(uint8_t* dst, int dstGpu, const uint8_t* host, size_t bytes, int transitGpu);

  // Transit GPU memory this stager holds now, in bytes.
  int64_t transitBytes() const { return transitBytes_; }

 private:
  // One of two lanes of a route: the NVLink leg runs on the buffer GPU's stream
  // (that GPU reaches its own memory, and the transit buffer, allocated on the
  // transit GPU, by peer access), the PCIe leg on the transit GPU's stream;
  // events order the two.
  struct Lane {
    CudaStream bufferStream, transitStream;
    CudaEvent bufferDone, transitDone;
    bool used = false;  // events recorded at least once
  };
  // One transfer's completion event per slot, on each device a transfer can
  // end on; `busy` while its transfer is in flight.
  struct Completion {
    CudaEvent event;
    bool busy = false;
  };
  enum class Direction { kNone, kToHost, kToDevice };
  struct Route {
    void* buffer = nullptr;  // on the transit GPU
    size_t bytes = 0;
    Lane lanes[2];
  };
  const CudaStream& directStream(int gpu);
  // The prepared route from `bufferGpu` through `transitGpu`, or nullptr.
  Route* routeFor(int bufferGpu, int transitGpu);
  // A free completion slot on `device`, or -1 when kMaxInFlight are busy.
  int freeSlot(int device);
  // Marks `slot` busy after recording its event at the end of `stream`.
  Transfer finish(int device, int slot, const CudaStream& stream);
  // Whether a transfer in `direction` may start: the lanes' slot-reuse events
  // order one direction's copies only, so directions never mix in flight.
  void checkDirection(Direction direction);
  // Splits a message into pieces the size of the transit buffer (or of half of
  // it, alternating lanes, when it does not fit) and hands each to
  // `copyPiece`; returns the lanes used.
  template <typename CopyPiece>
  int inPieces(Route& route, size_t bytes, CopyPiece&& copyPiece);
  void wait(Transfer transfer);

  std::shared_ptr<CudaApi> cuda_;
  const size_t maxTransitBytes_;
  const int timeoutMs_;
  bool prepared_ = false;
  std::map<int, CudaStream> direct_;              // by buffer GPU
  std::map<std::pair<int, int>, Route> routes_;   // by (buffer GPU, transit GPU)
  std::map<int, std::vector<Completion>> completions_;  // by device
  Direction direction_ = Direction::kNone;
  int inFlight_ = 0;
  int64_t transitBytes_ = 0;
};

}  // namespace reccl
