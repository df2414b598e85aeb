// A group of ranks on CPU memory and the lifecycle of the operations over it:
// the per-op agreement, running an op with its error policy, DCR's plan state
// and the point-to-point plumbing (p2p()). Blocking calls; one collective at a
// time (the process-group layer runs them in order). The collectives
// themselves are free functions over a Communicator, one file each
// (all_reduce.h, broadcast.h, ..., barrier.h, as in Gloo), each choosing its
// algorithm (collective.h) and running it through run() and forChannels().
//
// Every collective runs in two phases:
//  0. At the group's first collective, its layout (layout.h): the ranks
//     gather every rank's host identity by recursive doubling, so every rank
//     knows which ranks share a host, the ring order, and whether the
//     agreement runs in two levels (host, then network).
//  1. Agreement (agreement.h) by recursive doubling (recursive_doubling.h):
//     log2 N exchanges per rank carry every rank's op descriptor and fault
//     state, so a mismatch fails on every rank, with the same message, before
//     any data moves, and DCR's plan switches at the same op everywhere. A
//     small op's data rides in the same messages (the collective's payload)
//     and this phase *is* its algorithm (latency O(log N)).
//  2. Data phase (the collective's body) for larger messages: the data is
//     divided over the channels by the channel plan and each channel runs a
//     ring, chain or direct transfers (ring.h, direct.h) on its own thread.
//
// Any failure other than a mismatch (timeout, a connection with no path left,
// abort) leaves the streams out of step: the communicator closes every
// connection and fails every later op with the first error. When a member's
// process is gone (a connection's peer-gone verdict), that error names it
// (PeerGoneError) on every rank: the ranks that found it record it in the
// rendezvous before their abort closes their connections, and a rank whose op
// failed otherwise reads it there. Both happen on the failure path only.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/config.h"
#include "engine/agreement.h"
#include "engine/channel_job.h"
#include "engine/channel_plan.h"
#include "engine/data_type.h"
#include "engine/descriptor.h"
#include "engine/layout.h"
#include "engine/links.h"
#include "engine/p2p.h"
#include "engine/rebalance.h"
#include "engine/recursive_doubling.h"
#include "engine/rendezvous.h"
#include "engine/shares.h"
#include "engine/worker_pool.h"

namespace reccl {

struct CommOptions {
  // The RECCL_* settings of `config`; a process group's options then override
  // channels, chunkBytes and window.
  explicit CommOptions(const Config& config);
  int channels;                      // 0: one per NIC
  size_t chunkBytes;                 // pipelining unit of the rings
  int window;                        // chunks received ahead per channel
  std::string group = "";            // process group name, for errors
  Millis rendezvousTimeout{300000};  // bound on reading peers' handles
  size_t smallBytes;                 // recursive doubling up to this largest message
  Algo algo;  // RECCL_ALGO: large all_reduce, reduce_scatter, all_gather (collective.h)
  size_t halvingBytesPerRank;  // auto: halving up to this x ranks (collective.h)
  bool rebalance;  // DCR
  bool shares;  // RECCL_SHARES=proportional with RECCL_SPREAD=on (shares.h)
  uint64_t dcrOffset;  // ops between the agreement and a new plan
  std::string host = "";  // host identity (core/topology.h): equal = same host
  std::vector<int> globalRanks;  // the members' ranks in the job, for errors (empty: the same)
};

// What the last agreement said of the group's faults.
struct FaultPicture {
  int64_t agreedAtOp = -1;  // op sequence number of that agreement (-1: none yet)
  PlanProposal plan;  // the newest plan: pending if one is, else in force
  uint64_t maxOpsDone = 0;  // of the most advanced rank
  uint32_t degradedRanks = 0;  // ranks on backups or with NICs down
  std::vector<DegradedRank> listed;  // the lowest of them (at most kListedDegradedRanks)
};

class Communicator {
 public:
  // Publishes this rank's listener handles under `prefix` (one key); peers'
  // handles are read and connections made on first use.
  Communicator(std::shared_ptr<Transport> transport, std::shared_ptr<Rendezvous> rendezvous,
               const std::string& prefix, int rank, int size, CommOptions options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int channels() const;
  // The plan in force (id 0: every channel); changes only between collectives.
  PlanProposal currentPlan() const;
  // The group's fault picture as of the last collective.
  FaultPicture faultPicture() const;
  // This rank's fault state now (what it brings to the next agreement).
  RankFaults localFaults() const { return sampleFaults(); }
  // Where this rank reads how many collectives the group's GPU backend
  // (torch's ProcessGroupNCCL) has issued, for the fault picture.
  void setDeviceOpsCounter(std::function<uint64_t()> counter);
  // Connections made so far (both directions).
  size_t connections() const { return links_->connections(); }
  std::vector<int> sendPeers(int channel) const { return links_->sendPeers(channel); }
  // Deletes this rank's rendezvous key once every other rank has connected
  // (Links::releaseSpentKey): call between operations, never throws.
  void releaseSpentKey() { links_->releaseSpentKey(); }
  uint64_t opsDone() const { return opsDone_.load(); }
  const CommOptions& options() const { return options_; }

  // For the collectives (engine/<collective>.cc). A collective runs phase 1
  // with `payload` riding along (empty for the channels) and then
  // `dataPhase`, under the error policy above. `countsDigest`: all_to_all's.
  // A descriptor with a Rejection fails with MismatchError after phase 1.
  using DataPhase = std::function<void(const OpContext&)>;
  void run(OpDescriptor desc, Millis timeout, const RdPayload& payload, const DataPhase& dataPhase,
           uint64_t countsDigest = 0);
  // The group's layout. The first call (the group's first collective, of
  // kind `kind`, on every rank) learns it: an exchange with every rank,
  // bounded by `timeout`, under run()'s error policy.
  const Layout& layout(OpKind kind, Millis timeout);
  // The layout if learned already (for tools; nullptr before).
  std::shared_ptr<const Layout> knownLayout() const;
  // The ranks the agreement exchanges with (empty before the layout is known).
  std::vector<int> agreementPartners() const;
  // Within a data phase: the plan that divides this op's data over the
  // channels (the op thread is the only writer, between ops).
  const ChannelPlan& channelPlan() const { return plan_; }
  // Within a data phase: each rank's share weight of a large all_reduce
  // (shares.h); empty for equal shares, always while nothing is degraded.
  const std::vector<uint64_t>& shareWeights() const { return shareWeights_; }
  // The share weights in force, from any thread (for tools).
  std::vector<uint64_t> currentShares() const;
  // Within a data phase: runs fn(job, sends) for every channel with data in
  // parallel (chunks of `unit` elements), then waits for each channel's sends.
  void forChannels(const OpContext& ctx, DataType dtype, size_t unit,
                   const std::function<void(ChannelJob&, SendList&)>& fn);
  // A work buffer of at least `bytes` for the op in progress (grow-only, kept
  // between ops: a fresh allocation this large is mmapped by malloc and
  // page-faulted in again by every op, a 5x cliff from 32 MiB up).
  uint8_t* opScratch(size_t bytes);

  P2p& p2p() { return *p2p_; }

  // Waits (up to `timeout`) until every message this rank sent has reached its
  // peer: ops complete without waiting for the acknowledgement of their last
  // agreement messages, so an orderly shutdown flushes them before closing.
  void flush(Millis timeout);
  // Fails the op in progress and every later one with `why`; closes every
  // connection (`orderly`: and deletes this rank's rendezvous key). Safe from
  // any thread; idempotent.
  void abort(const std::string& why, bool orderly = false);
  // Empty while usable; otherwise why not.
  std::string error() const;

 private:
  // all_to_all whose count digest did not add up: finds the first pair that
  // disagrees (every rank the same) and throws MismatchError.
  [[noreturn]] void diagnoseAlltoall(const OpContext& ctx, const OpDescriptor& desc);
  std::string label(const OpDescriptor& desc) const;
  // Runs `body` under the error policy of an op (see the top of this file).
  void guarded(const OpContext& ctx, const std::function<void()>& body);
  void checkUsable() const;
  // On a failure from inside the op: the members found gone (here, then
  // recorded for the others, or by another rank), with `why` rewritten to name
  // them first; empty (and `why` untouched) when none is known.
  std::vector<int> findGone(const OpContext& ctx, std::string* why);
  // "rank 3 (global rank 7)".
  std::string memberName(int rank) const;
  // layout() with opMutex_ held.
  const Layout& layoutLocked(OpKind kind, Millis timeout);
  RankFaults sampleFaults() const;
  // Records the agreement of op `seq` and switches plans where DCR and the
  // share rule (shares.h) say so; releases the direct form's connections
  // when it ends.
  void adoptAgreement(const Agreement& agreement, uint64_t seq);
  // Whether a large all_reduce runs by direct transfers (all_reduce.cc):
  // shares unequal or a DCR plan in force. planMutex_ held.
  bool directFormLocked() const;
  // Whether shares may be unequal in this group: RECCL_SHARES, more than two
  // ranks, one rank per host (direct transfers between the ranks of a
  // two-level layout would cross each host's NICs once per rank), and the ring
  // not ruled out (with RECCL_ALGO=halving no all_reduce would use them).
  bool sharesApply() const;
  // Emits the rebalance event and log line of a plan or share switch.
  void announce(uint64_t seq, uint64_t plan, const std::string& detail) const;

  const int rank_;
  const int size_;
  const CommOptions options_;
  std::shared_ptr<Links> links_;
  // Rank order, every rank its own unit: the host exchange, and the
  // agreement while the layout is not two-level.
  std::unique_ptr<RecursiveDoubling> flat_;
  std::unique_ptr<RecursiveDoubling> twoLevel_;  // host units in ring order
  RecursiveDoubling* agreement_ = nullptr;  // the one in use; set with layout_
  std::shared_ptr<const Layout> layout_;  // written once under planMutex_
  ChannelPlan plan_;
  PlanState plans_;  // op thread only
  ShareState shares_;  // op thread only
  std::vector<uint64_t> shareWeights_;  // written by the op thread under planMutex_
  // Guards writes of plan_ (only the op thread writes it, and reads it freely)
  // and every access to picture_ and deviceOps_ from other threads.
  mutable std::mutex planMutex_;
  PlanProposal current_;
  FaultPicture picture_;
  std::function<uint64_t()> deviceOps_;
  std::shared_ptr<P2p> p2p_;
  std::unique_ptr<WorkerPool> pool_;
  std::vector<std::vector<uint8_t>> scratch_;  // per channel
  std::vector<uint8_t> opScratch_;  // see opScratch()
  std::mutex opMutex_;
  uint64_t seq_ = 0;
  std::atomic<uint64_t> opsDone_{0};
  std::atomic<bool> aborted_{false};
  mutable std::mutex errorMutex_;
  std::string error_;
};

}  // namespace reccl
