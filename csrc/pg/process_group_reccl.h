// The c10d backend "reccl" for CPU tensors: maps torch tensors and options to
// the collective engine (csrc/engine), runs collectives in issue order on one
// worker thread, and hands out c10d::Work objects with Futures. Every engine
// wait is bounded by the op's timeout (the process group timeout unless the
// op's options set one); a timeout or a lost connection fails the op and aborts
// the group (later ops fail at once with the first error), a mismatch between
// ranks fails the op on every rank with a message naming both sides.
//
// Non-contiguous tensors are handled: inputs are made contiguous, outputs are
// produced in a contiguous buffer and copied back before the work completes.
//
// Host faults: when a member's process dies, every op of the group fails with
// an error naming it (engine/communicator.h, PeerGoneError), and the others
// can go on in a group without it (torch.distributed.shrink_group: shrink()).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "engine/communicator.h"
#include "pg/fault_board.h"
#include "pg/op_queue.h"
#include "pg/reccl_work.h"

namespace reccl {

class ProcessGroupReccl : public c10d::Backend {
 public:
  struct Options {
    std::chrono::milliseconds timeout{30 * 60 * 1000};
    std::string group = "";     // c10d group name, for errors and store keys
    // Unset (-1 / 0) values come from RECCL_CHANNELS, RECCL_CHUNK_BYTES, RECCL_WINDOW.
    int channels = -1;          // 0: one per NIC
    size_t chunkBytes = 0;
    int window = 0;
    std::vector<int> globalRanks;  // the group's ranks in the job (empty: the job itself)
  };

  // Costs nothing until the first CPU operation, which builds the engine
  // (rendezvous through `store`, bounded by the store's timeout).
  ProcessGroupReccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                    Options options);
  ~ProcessGroupReccl() override;

  const std::string getBackendName() const override { return "reccl"; }
  const Options& options() const { return options_; }
  // Engine facts for tests and tools.
  int channels() const {
    auto comm = communicatorForTools();
    return comm ? comm->channels() : 0;
  }
  uint64_t opsDone() const {
    auto comm = communicatorForTools();
    return comm ? comm->opsDone() : 0;
  }
  // nullptr until the first CPU operation.
  std::shared_ptr<Communicator> communicatorForTools() const {
    std::lock_guard<std::mutex> lock(releaseMutex_);
    return comm_;
  }
  // How many collectives the group's GPU backend has issued (for the fault picture).
  void setDeviceOpsCounter(std::function<uint64_t()> counter);
  // The group's members whose processes have a NIC down now, by group rank, as
  // the job-wide fault board has them (store reads; for groups without CPU ops).
  std::vector<BoardRecord> degradedMembers();

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // Gloo's monitored barrier (pg/monitored_barrier.h), on the caller's thread.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }
  void setTimeout(std::chrono::milliseconds timeout) override { options_.timeout = timeout; }

  bool supportsSplitting() const override { return true; }
  // torch.distributed.shrink_group's flags (SHRINK_DEFAULT, SHRINK_ABORT).
  static constexpr int kShrinkDefault = 0x00;  // the parent's pending ops finish or fail
  static constexpr int kShrinkAbort = 0x01;    // the parent is aborted first (abort())
  bool supportsShrinking() const override { return true; }
  // A new backend over the members not in `ranksToExclude` (group ranks), in
  // their order (ranks renumbered from 0), with this group's options (the
  // timeout and name of `optsOverride` where set). Its keys live under
  // "reccl/shrink/<excluded ranks, comma-separated>/" of this group's store, apart from the
  // parent's; like any new group it costs nothing until its first CPU op,
  // whose rendezvous is the ordinary one. Every member not excluded calls it.
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranksToExclude, int shrinkFlags = kShrinkDefault,
      const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride = nullptr) override;
  // torch names a group after making it (ProcessGroup::setGroupName): errors use the name.
  void setGroupUid(const std::string& pgUid) override;
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
      const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;

  // Lets queued and running ops finish (bounded), then releases every thread,
  // connection and buffer. Idempotent.
  void shutdown() override;
  // Fails the running and queued ops at once and releases everything; bounded
  // (connections close in parallel, each within its close handshake's bound,
  // and a running op is waited for at most OpQueue's stop bound). New groups
  // can be formed afterwards.
  void abort() override;

 private:
  using Body = std::function<void(Communicator&, std::chrono::milliseconds timeout)>;
  // Queues `body` on the worker; the returned work completes when it ran.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title,
                                         std::vector<at::Tensor> outputs,
                                         std::chrono::milliseconds timeout, Body body);
  // A collective whose arguments on this rank are invalid in a way the other
  // ranks cannot see (engine/descriptor.h, Rejection): this rank joins the op
  // anyway with `desc.rejection` set, so every rank's work fails at once with
  // the same message (a MismatchError: the group stays usable). `requested`:
  // the op's own timeout (0: the group's).
  c10::intrusive_ptr<c10d::Work> reject(c10d::OpType type, const char* title, OpDescriptor desc,
                                        std::chrono::milliseconds requested);
  std::chrono::milliseconds timeoutOf(std::chrono::milliseconds requested) const;
  // all_reduce of a sparse COO tensor (SUM), exactly as Gloo computes it.
  c10::intrusive_ptr<c10d::Work> sparseAllreduce(const at::Tensor& tensor,
                                                 const c10d::AllreduceOptions& opts);
  // The engine; built on first use. Throws once released.
  std::shared_ptr<Communicator> communicator(const char* op);
  void startEngine();  // with releaseMutex_ held
  c10::intrusive_ptr<c10d::Work> p2pWork(c10d::OpType type, std::shared_ptr<P2pOp> op,
                                         std::vector<at::Tensor> keepAlive,
                                         std::function<void()> onSuccess);
  void release(bool orderly);

  Options options_;
  const c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<FaultBoard> board_;
  std::function<uint64_t()> deviceOps_;
  uint64_t boardToken_ = 0;  // deviceOps_ on the board
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<OpQueue> queue_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> monitoredBarriers_{0};
  mutable std::mutex releaseMutex_;  // guards comm_, queue_, deviceOps_, released_
  bool released_ = false;
};

// The ProcessGroup of a reccl group: torch's own, except that it names itself
// "reccl" (torch's names a registered backend "custom"; DDP logs this name).
class RecclProcessGroup : public c10d::ProcessGroup {
 public:
  using c10d::ProcessGroup::ProcessGroup;
  const std::string getBackendName() const override { return "reccl"; }
};

// A new reccl backend; what the Python creator function calls.
c10::intrusive_ptr<c10d::Backend> createRecclBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, int size,
                                                     ProcessGroupReccl::Options options);

}  // namespace reccl
