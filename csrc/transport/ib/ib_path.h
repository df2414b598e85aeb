// A path over one RC queue pair. Control frames (CTS, ACK, ACTIVATE, RESYNC,
// NOTIFY, heartbeats) travel as SENDs into receive buffers kept posted at the
// peer. Data is receiver-driven: the receiver grants a staging slot by an RDMA
// WRITE of a FIFO entry into the sender's CTS FIFO, followed by an empty SEND
// (the grant's notice: a completion at the sender, which has no thread
// polling the FIFO; RC order puts the entry in place first); the sender stages the
// chunk (frame header, DataHeader, payload) and RDMA-WRITEs it into that slot
// WITH IMMEDIATE = slot, which raises a completion at the receiver; the
// receiver checks it, copies the payload where the connection says
// (PathOwner::beginData) and grants the slot again.
//
// Direct placement (zero copy): a chunk whose receive buffer the receiver
// registered (its placement: address, capacity, one rkey per receiver NIC)
// and whose send buffer the sender registered is RDMA-WRITten from the send
// buffer (the lkey of this path's NIC) to the receive buffer (the rkey of the
// NIC this path reaches), followed on the same QP by a SEND of the frame
// header + DataHeader into a control receive buffer. RC executes them in
// order, so when the notice arrives the payload is in place; the receiver
// only records it (beginData(placed)). No grant, no copy at either end.
//
// The path has no thread of its own. Both CQs sit on one completion channel,
// whose fd is registered with one of the process's event loops
// (transport/event_loop.h), as TCP paths' sockets are: an event (a completion
// on an armed CQ) wakes the loop, which takes it and polls the CQs empty.
// While work is outstanding (data posted and not completed, data waiting for
// a grant or a credit, the connection's requests on its active path) and for
// RECCL_IB_BUSY_POLL_US past it, the loop keeps polling them at every turn
// with the CQs unarmed, as long as something completed within that window:
// completions under load cost no event each. Before the path sleeps it arms
// both CQs and polls once more, so no completion goes unannounced. Queued data and
// control frames no send buffer was free for are moved on the loop too, and
// the heartbeat and the peer's silence are deadlines in the loop's timer
// wheel: an idle path costs no wake-up but its heartbeats.
// A CQE error (retry exceeded, flush, access) or heartbeat silence fails the
// path; shutdown() moves the QP to ERR first, so once it returns no write of
// this path can land anywhere.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/path.h"
#include "transport/event_loop.h"
#include "transport/ib/ib_endpoint.h"
#include "transport/nic_pair_liveness.h"

namespace reccl {

class IbPath : public Path {
 public:
  // `endpoint` is connected (RTS) to the peer that sent `peer`.
  // `pair`: the liveness this path shares with every IB path between the same
  // two NICs of the same two transports (nic_pair_liveness.h).
  IbPath(std::unique_ptr<IbEndpoint> endpoint, const QpExchange& peer, int localNic, int remoteNic,
         int healthId, std::string peerName, std::shared_ptr<NicPairLiveness> pair,
         const Config& config);
  ~IbPath() override;

  void start(PathOwner* owner, uint64_t pathId) override;
  bool sendControl(const std::vector<uint8_t>& frame) override;
  void sendData(const DataChunk& chunk) override;
  void dropQueuedData() override;
  bool drainDirectWrites(Millis timeout) override;
  void shutdown() override;
  // The moment the QP went to ERR plus RECCL_IB_FENCE_DELAY_MS.
  Clock::time_point quietAfter() const override;
  void stopAndJoin() override;
  int localNic() const override { return localNic_; }
  int remoteNic() const override { return remoteNic_; }
  std::string peer() const override { return peerName_; }
  std::shared_ptr<PairHeard> pairHeard() const override { return pair_; }

 private:
  class ChannelIo;
  // On the loop's thread. onIo: the channel has events; onDeadline: a timer
  // (heartbeat, silence, a stuck control frame, the blackhole recheck) or work
  // handed over by serviceSoon().
  void onIo();
  void onDeadline();
  // Takes the channel's events (when `events`), polls the CQs and moves queued
  // data until nothing moves, within a bound per turn; then either polls again
  // at the loop's next turn (busy polling) or arms the CQs to sleep.
  void service(bool events);
  // One round of polling and pumping: true if anything moved.
  bool serviceRound();
  // Whether data work of this path waits for a completion or for the peer:
  // a staged or placed chunk in flight, a queued chunk, a backlog, a pending
  // grant, or requests of the connection that this (active) path carries.
  bool workOutstanding();
  // Any thread: service() on the loop at its next turn.
  void serviceSoon();
  // While the NIC is blackholed (the drill) the channel is not polled and a
  // deadline rechecks every kBlackholeRecheck.
  bool pauseIfBlackholed();
  void resume();
  // Each returns true if it did something.
  bool pollReceives();
  bool pollSends();
  bool pumpData();
  void handleControl(const uint8_t* bytes, uint32_t length);
  void handleData(uint32_t immediate, uint32_t length);
  void handlePlaced(const DataHeader& header);
  // Takes the queue's head if it is a placed chunk and posts it; false if
  // there is none or it must wait (buffers, in-flight bound).
  bool pumpPlaced(bool* failed);
  // Whether both NICs of this path hold a key for `chunk`'s buffers (each
  // device of either end may have refused the registration).
  bool placeableHere(const DataChunk& chunk) const;
  // Receiver: grants `slot` now, or once a credit allows (pendingGrants_).
  void grant(uint32_t slot);
  // Under sendMutex_: posts the grants waiting for credits; true if it posted any.
  bool flushGrantsLocked();
  // Under sendMutex_: takes one credit (a receive the peer has posted and no
  // request of ours consumes yet) for a receive-consuming request; false, and
  // the loop re-checks in kCreditRecheck, when there is none.
  bool takeCreditLocked();
  // Under sendMutex_: writes the count of receives we reposted into the
  // peer's credit word, unless a write of it is in flight (its completion
  // writes what came since).
  void writeCreditsLocked();
  // Under sendMutex_: drains the send CQ, freeing buffers; the first error is
  // kept in sendFailure_ for the caller to report unlocked.
  int drainSendsLocked();
  bool postLocked(const SendRequest& request);
  // Under sendMutex_: posts one control frame into a free send buffer.
  bool postControlLocked(const uint8_t* bytes, size_t length);
  // Under sendMutex_: posts what the backlog holds while buffers are free;
  // true if it posted any.
  bool flushBacklogLocked();
  void reportSendFailure();
  void fail(Reason reason, const std::string& detail);
  std::string describeCompletionError(const WorkCompletion& wc) const;
  // Posts the frame now when a send buffer is free and no frame waits before
  // it; otherwise, if `queue`, it joins the backlog, which the loop posts as
  // send completions free buffers. Never waits: callers may hold their
  // connection's lock, and the loop serves other paths. False when the path
  // is failing, or (without `queue`) when the frame could not go now.
  bool sendControlFrom(const uint8_t* bytes, size_t length, bool queue);

  std::unique_ptr<IbEndpoint> endpoint_;
  const bool sender_;
  const uint64_t peerRegion_;
  const uint32_t peerRkey_;
  const uint32_t peerSlotCount_;
  const uint32_t peerSlotBytes_;
  const int localNic_;
  const int remoteNic_;
  const int healthId_;
  const std::string peerName_;
  const std::shared_ptr<NicPairLiveness> pair_;
  const Millis heartbeat_;
  const Millis beatInterval_;
  const int ioThreadsPerNic_;
  const int ibTimeout_;
  const Millis fenceDelay_;             // RECCL_IB_FENCE_DELAY_MS
  const int64_t busyPollNs_;            // RECCL_IB_BUSY_POLL_US, in ns; 0 = off
  std::atomic<int64_t> stoppedAtNs_{0};  // when shutdown() moved the QP to ERR
  const int ibRetryCount_;
  PathOwner* owner_ = nullptr;
  uint64_t pathId_ = 0;

  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};

  EventLoop* loop_ = nullptr;  // set by start(), with the channel's registration
  uint64_t loopId_ = 0;
  std::atomic<bool> serviceDue_{false};  // serviceSoon() set a deadline not yet run
  // The loop's thread only.
  bool paused_ = false;
  bool granted_ = false;  // receiver: every slot granted once
  // Whether both CQs are armed: an event disarms its CQ, and a busy-polling
  // path leaves them unarmed until it goes to sleep.
  bool armed_ = false;
  int64_t lastProgressNs_ = 0;  // when a turn last polled or moved something
  int64_t lastWorkNs_ = 0;      // when a turn last found work outstanding
  Clock::time_point nextBeat_;

  std::mutex sendMutex_;  // the QP's send queue and the buffers it uses
  std::condition_variable sendSlotFreed_;
  std::vector<uint32_t> freeControl_;
  std::vector<uint32_t> freeStaging_;
  std::string sendFailure_;
  Reason sendFailureReason_ = Reason::kNone;
  // Control frames waiting for a send buffer, in order; data waits behind them.
  std::deque<std::vector<uint8_t>> backlog_;
  int64_t backlogProgressNs_ = 0;  // when the backlog last moved (or began)
  uint64_t grantsIssued_ = 0;  // receiver: FIFO entries written so far
  std::deque<uint32_t> pendingGrants_;  // receiver: slots to grant once credits allow
  // Credits: receive-consuming requests we posted (or reserved), against the
  // peer's kControlRecvs + what its credit word says it reposted.
  uint64_t consumingSent_ = 0;
  std::atomic<uint64_t> reposted_{0};  // receives we reposted (the loop's thread adds)
  uint64_t repostedWritten_ = 0;       // the count our last credit write carried
  bool creditWriteInFlight_ = false;

  std::mutex queueMutex_;
  std::deque<DataChunk> queue_;
  uint64_t grantsUsed_ = 0;  // sender: FIFO entries consumed so far (the loop's thread only)
  // Placed chunks taken off the queue whose notice has not completed yet: a
  // write of this path may still land in the peer's buffer while it is > 0.
  std::atomic<int> placedInFlight_{0};

  std::mutex joinMutex_;  // concurrent stopAndJoin calls: one unregisters, the other waits
  bool joined_ = false;
};

}  // namespace reccl
