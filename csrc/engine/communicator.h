// A group of ranks and the collectives over it, on CPU memory. Blocking calls;
// one collective at a time (the process-group layer runs them in order on its
// worker thread). Point-to-point traffic goes through p2p().
//
// Every collective runs in two phases:
//  1. Descriptor exchange: each rank sends every peer (over channel 0) a 96-byte
//     descriptor of the op it is running (and the newest channel plan it has
//     heard of from the control plane: DCR switches plans in-band, rebalance.h), plus, when the per-peer payload is at
//     most kInlineBytes, the payload itself. Every rank then checks all
//     descriptors (MismatchError on any difference, on every rank, before any
//     data moves). For small messages this single round *is* the algorithm
//     (latency-optimal: one message from each rank to each peer).
//  2. Data phase for larger messages: the data is divided over the channels by
//     the channel plan and each channel runs a chunked, pipelined ring
//     (allreduce, allgather, reduce-scatter, reduce), a chain (broadcast) or
//     direct transfers (gather, scatter, all-to-all) on its own thread.
//
// Any failure other than a mismatch (timeout, a connection with no path left,
// abort) leaves the streams out of step: the communicator closes every
// connection and fails every later op with the first error.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/channel_job.h"
#include "engine/channel_plan.h"
#include "engine/control_plane.h"
#include "engine/data_type.h"
#include "engine/descriptor.h"
#include "engine/links.h"
#include "engine/p2p.h"
#include "engine/reduce_op.h"
#include "engine/rendezvous.h"
#include "engine/worker_pool.h"

namespace reccl {

constexpr size_t kInlineBytes = 16384;  // per-peer payload carried with the descriptor

struct CommOptions {
  int channels = 0;                  // 0: one per NIC
  size_t chunkBytes = 1 << 20;       // pipelining unit of the rings
  int window = 4;                    // chunks received ahead per channel
  std::string group = "";            // process group name, for errors
  Millis rendezvousTimeout{300000};  // bound on reading peers' handles
  ControlSettings control;           // the control plane and DCR
};

class Communicator {
 public:
  // Publishes this rank's listener handles under `prefix` and reads every
  // peer's; connections are made on first use.
  Communicator(std::shared_ptr<Transport> transport, Rendezvous& rendezvous,
               const std::string& prefix, int rank, int size, CommOptions options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int channels() const;
  // The plan in force (id 0: every channel); changes only between collectives.
  PlanProposal currentPlan() const;
  // The job-wide fault picture as of the last control-plane period.
  GroupView groupView() const;
  // Where the control plane reads how many collectives the group's GPU backend
  // (torch's ProcessGroupNCCL) has issued; called from its thread.
  void setDeviceOpsCounter(std::function<uint64_t()> counter);
  uint64_t opsDone() const { return opsDone_.load(); }
  const CommOptions& options() const { return options_; }

  // `in` and `out` may be the same buffer where both are given.
  void allreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                 Millis timeout);
  void broadcast(void* buffer, size_t count, DataType dtype, int root, Millis timeout);
  // `out` (count elements) is written on the root only.
  void reduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op, int root,
              Millis timeout);
  // `out` holds size*count elements, rank r's at r*count.
  void allgather(const void* in, void* out, size_t count, DataType dtype, Millis timeout);
  // `in` holds size*count elements; rank r gets the reduction of block r.
  void reduceScatter(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                     Millis timeout);
  // `out` (size*count elements) on the root only.
  void gather(const void* in, void* out, size_t count, DataType dtype, int root, Millis timeout);
  // `in` (size*count elements) on the root only.
  void scatter(const void* in, void* out, size_t count, DataType dtype, int root, Millis timeout);
  // Counts and offsets in elements, one per rank.
  void alltoall(const void* in, const std::vector<uint64_t>& sendCounts,
                const std::vector<uint64_t>& sendOffsets, void* out,
                const std::vector<uint64_t>& recvCounts, const std::vector<uint64_t>& recvOffsets,
                DataType dtype, Millis timeout);
  void barrier(Millis timeout);

  P2p& p2p() { return *p2p_; }

  // Waits (up to `timeout`) until every message this rank sent has reached its
  // peer: ops complete without waiting for the acknowledgement of their last
  // descriptors, so an orderly shutdown flushes them before closing.
  void flush(Millis timeout);
  // Fails the op in progress and every later one with `why`; closes every
  // connection. Safe from any thread; idempotent.
  void abort(const std::string& why);
  // Empty while usable; otherwise why not.
  std::string error() const;

 private:
  struct Inline {
    const uint8_t* data = nullptr;
    size_t bytes = 0;
  };
  using Body = std::function<void(const OpContext&, const std::vector<Inline>&)>;
  // Small messages: reduces every rank's payload (this rank's at `mine`, the
  // peers' inline) into `out`.
  static void reduceInline(const char* what, const std::vector<Inline>& from, int rank,
                           const void* mine, void* out, size_t count, DataType dtype, ReduceOp op);
  // Small messages: copies every peer's inline payload into its block of `out`.
  static void gatherInline(const char* what, const std::vector<Inline>& from, int rank, void* out,
                           size_t bytes);

  // Phase 1 then `body` (the data phase), with the error policy above.
  void run(OpDescriptor desc, Millis timeout, const std::function<Inline(int peer)>& payloadTo,
           const Body& body);
  void exchange(const OpContext& ctx, const OpDescriptor& mine,
                const std::function<Inline(int peer)>& payloadTo,
                std::vector<OpDescriptor>* all, std::vector<Inline>* inlineFrom);
  // Runs fn(job, sends) for every channel in parallel (chunks of `unit`
  // elements), then waits for each channel's sends.
  void forChannels(const OpContext& ctx, DataType dtype, size_t unit,
                   const std::function<void(ChannelJob&, SendList&)>& fn);
  size_t chunkElems(DataType dtype, size_t largestSegment, int segmentsPerConnection) const;
  std::string label(const OpDescriptor& desc) const;
  RankState sampleState() const;
  // A work buffer of at least `bytes` for the op in progress (grow-only).
  uint8_t* opScratch(size_t bytes);
  // Switches to the plan every rank's descriptor of op `seq` agrees on (if any).
  void adoptPlan(const std::vector<OpDescriptor>& all, uint64_t seq);

  const int rank_;
  const int size_;
  const CommOptions options_;
  std::shared_ptr<Links> links_;
  std::unique_ptr<ControlPlane> control_;  // stopped before links_ go
  ChannelPlan plan_;
  // Guards writes of plan_ (only the op thread writes it, and reads it freely)
  // and every access to current_ and deviceOps_ from other threads.
  mutable std::mutex planMutex_;
  PlanProposal current_;
  std::function<uint64_t()> deviceOps_;
  std::shared_ptr<P2p> p2p_;
  std::unique_ptr<WorkerPool> pool_;
  std::vector<std::vector<uint8_t>> scratch_;  // per channel
  std::vector<uint8_t> opScratch_;              // reduce, reduce_scatter
  std::vector<std::vector<uint8_t>> txBuffers_, rxBuffers_;  // per peer, phase 1
  std::vector<std::shared_ptr<Request>> txPending_;           // per peer: the last descriptor sent
  std::mutex opMutex_;
  uint64_t seq_ = 0;
  std::atomic<uint64_t> opsDone_{0};
  std::atomic<bool> aborted_{false};
  mutable std::mutex errorMutex_;
  std::string error_;
};

}  // namespace reccl
