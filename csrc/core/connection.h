// What the two ends of a connection share: a fixed list of candidate paths
// (primary, backup, then last-resort rails), their states, the fence that keeps
// a failed path's threads from outliving it, and the wait for a path when none
// is left: its bounds (an outage, a peer process gone) and its `stalled` reports.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/config.h"
#include "core/events.h"
#include "core/path.h"
#include "core/request.h"
#include "core/supervisor.h"
#include "core/topology.h"

namespace reccl {

// What a connection needs from the transport that made it.
struct ConnectionEnv {
  Config config;
  Supervisor* supervisor = nullptr;
  std::vector<std::string> localNicNames;  // by local NIC index
  std::vector<int> localHealthIds;         // NicHealth id by local NIC index
  std::string peerName;                    // for events and errors
  std::vector<std::string> remoteNicAddresses;  // by remote NIC index, where known
  const void* registrar = nullptr;  // the transport whose registrations isend/irecv take
  // PCI distance cost between local NICs [a][b] (topology.h); -1 where unknown.
  std::vector<std::vector<int>> nicDistances;
};

// The environment of a connection of a transport with these NICs.
ConnectionEnv makeConnectionEnv(const Config& config, Supervisor* supervisor,
                                const std::vector<NicInfo>& nics, const std::vector<int>& healthIds,
                                const std::string& peer, const void* registrar);

// A connection stalled now (reported by a `stalled` event), for stats().
struct StallInfo {
  uint64_t connection = 0;
  std::string peer;
  int64_t sinceWallNs = 0;  // when traffic stopped (system clock)
  std::string paths;        // every path with its state and last failure
};
// The connections of this process stalled now, and the stalls reported since it started.
std::vector<StallInfo> stalledConnections();
uint64_t stallsReported();

struct PathCandidate {
  int localNic = 0;
  int remoteNic = 0;
  bool upFront = false;  // dialed at connect time (primary, backup); else a last resort
};

class Connection : public PathOwner, public Serviced {
 public:
  Connection(ConnectionEnv env, uint64_t id, std::vector<PathCandidate> candidates);
  ~Connection() override;

  uint64_t id() const { return id_; }
  // Keeps `owner` alive as long as this connection: e.g. the listener that routes
  // re-dialed paths here after the application closed it (NCCL closes its listen
  // comm right after accept).
  void keepAlive(std::shared_ptr<void> owner) { keepAlive_ = std::move(owner); }
  // A NIC changed health; paths on a dead local NIC fail at once.
  void onNicHealth(int healthId, bool up, Reason reason);
  void onPathFailed(uint64_t pathId, Reason reason, const PathFailure& failure) override;
  bool expectsTraffic(uint64_t pathId) final;
  // CLOSE and NOTIFY mean the same at both ends; the rest goes to onRoleControlLocked.
  void onControl(uint64_t pathId, const ControlFrame& frame) final;
  // Orderly close: tells the peer, stops every path, fails what is pending.
  void close();
  // Empty while healthy; the reason the connection failed otherwise.
  std::string error() const;
  // The connection failed on the verdict that the peer process is gone
  // (peerGoneLocked() held for RECCL_PEER_GONE_TIMEOUT_MS), not on a timeout.
  bool peerGone() const;
  // Per path: "primary eth0->198.18.0.2 up" etc.
  std::vector<std::string> describePaths() const;
  int activePath() const;
  // Every up-front path up and active, nothing to reap, resend or time out.
  bool quiet() final;
  // The local NIC the active path leaves from; -1 while no path is active.
  int activeLocalNic() const;

 protected:
  enum class SlotState { kIdle, kDialing, kUp, kFailed };
  struct Slot {
    PathCandidate nics;
    std::string remoteAddress;  // of the path last installed
    SlotState state = SlotState::kIdle;
    std::shared_ptr<Path> path;
    uint64_t pathId = 0;
    Reason lastFailure = Reason::kNone;
    std::string lastDetail;
    Clock::time_point lastFailureAt{};
    bool peerAnswered = false;  // the last failure came from the peer's host (PathFailure)
    bool refused = false;       // ... and was a dial refused at connect (nothing listens)
    Clock::time_point nextDial{};
    int backoffMs = 0;
    bool everUp = false;
    // The NIC pair of the path last installed: kept after the path is gone, so
    // the peer-gone verdict can ask whether the peer's transport is heard.
    std::shared_ptr<PairHeard> heard;
  };
  using Lock = std::unique_lock<std::mutex>;

  int slotOf(uint64_t pathId) const;  // -1 for a path no longer in a slot
  // Stops and joins every path. Derived destructors call it first: path threads
  // call the derived overrides, which must not run on a half-destroyed object.
  void destroyAllPaths();
  // Marks the slot failed and stops its I/O; the supervisor reaps it. A bare
  // `detail` is a failure of this side's making (the peer's host said nothing).
  void failPathLocked(int index, Reason reason, const PathFailure& failure);
  void failPathLocked(int index, Reason reason, const std::string& detail) {
    failPathLocked(index, reason, PathFailure{detail});
  }
  // Installs a freshly connected path in `index`, retiring any path there.
  uint64_t installPathLocked(int index, std::shared_ptr<Path> path);
  uint64_t installPathLocked(int index, std::shared_ptr<Path> path, PathCandidate nics);
  // Moves failed paths out of their slots (to be destroyed unlocked).
  void reapLocked();
  // Stops `path` and notes when its late writes have landed (quietAfter_).
  void shutdownPathLocked(Path& path);
  // Destroys retired paths whose last user has let go; call unlocked.
  void destroyRetired();
  // Fails the connection and everything pending on it.
  void failConnectionLocked(const std::string& why);
  // Stops and retires every path and fails what is pending with `why`.
  void retireAllPathsLocked(const std::string& why);
  // Safety net against a hang: an active index whose slot is not up (should not
  // happen) is dropped with a warning, so failover or the no-path bound applies.
  void checkActiveSlotLocked();
  // Records a failure of slot `index` (a path's or a dial's).
  void noteFailureLocked(int index, Reason reason, const PathFailure& failure);
  // While `stalled` (no path carries traffic) holds: reports it (`stalled`
  // events, at 1, 2, 4, ... 30 s) and enforces RECCL_NO_PATH_TIMEOUT_MS, or
  // RECCL_PEER_GONE_TIMEOUT_MS while peerGoneLocked(). Once it ends after a
  // report: `recovered`.
  void checkStalledLocked(bool stalled, const char* what);
  // Every failure since traffic last moved, on a local NIC that is up, came
  // from the peer's host (PathFailure::peerHostAnswered), and a dial refused at
  // connect (PathFailure::nothingListens) is among them or was seen since on one
  // of the slots' NIC pairs by any connection: a live peer ends paths it gives
  // up on (a NIC it finds slow or down), but its listener never refuses a connect.
  bool peerGoneLocked() const;
  // Something arrived from the peer's transport, on any NIC pair of this
  // connection's paths (by any connection), at or after `sinceNs`.
  bool peerHeardSinceLocked(int64_t sinceNs) const;
  // Ends a reported stall: `recovered` when traffic moves again, else (the
  // connection failed or closed) only the bookkeeping.
  void endStallLocked(bool recovered);
  void emitStallEvent(EventKind kind, Reason reason, int64_t durationNs, const std::string& detail);
  std::string slotSummaryLocked() const;
  std::string slotName(int index) const;
  void emitPathEvent(EventKind kind, int index, Reason reason, const std::string& detail);
  void emitSwitchEvent(EventKind kind, int from, int to, Reason reason, int64_t durationNs,
                       int64_t bytesReplayed, const std::string& detail);
  std::shared_ptr<Path> activePathLocked() const;
  // Throws unless a new `op` ("send", "receive") may start: the connection has
  // neither failed nor closed, and fewer than kMaxOutstanding are `pending`
  // (named `many` in the error: "sends in flight"); mutex_ held.
  void admitLocked(const char* op, size_t pending, const char* many) const;
  // A CLOSE frame arrived: the EOFs that follow are not faults. Answers with a
  // CLOSE of our own (unlocking to send) unless we are closing too.
  void onPeerCloseLocked(uint64_t pathId, Lock& lock);
  // Fails every request still pending (connection failed or closed).
  virtual void failPendingLocked(const std::string& why) = 0;
  // Role-specific reaction to losing the active path.
  virtual void onActiveLostLocked(int index, Reason reason) = 0;
  // Role-specific reaction to losing a path that was up but not active.
  virtual void onOtherLostLocked(int index, Reason reason) {}
  // Role-specific work the supervisor still has to do (quiet() otherwise holds).
  virtual bool roleQuietLocked() const { return true; }
  // Requests of this end not yet complete (expectsTraffic).
  virtual bool requestsPendingLocked() const = 0;
  // A control frame only this end understands; throws ProtocolError for others.
  virtual void onRoleControlLocked(uint64_t pathId, const ControlFrame& frame, Lock& lock) = 0;

  const ConnectionEnv env_;
  const uint64_t id_;
  mutable std::mutex mutex_;
  std::vector<Slot> slots_;
  std::vector<std::shared_ptr<Path>> retired_;
  // When the late writes of every path stopped so far have landed
  // (Path::quietAfter): a receiver reports what arrived only after it.
  Clock::time_point quietAfter_{};
  uint64_t nextPathId_ = 1;
  int active_ = -1;
  uint64_t epoch_ = 0;
  bool closed_ = false;
  bool peerClosed_ = false;
  std::condition_variable peerClosedCv_;
  std::string error_;
  bool peerGone_ = false;  // error_ is the peer-gone verdict
  std::shared_ptr<void> keepAlive_;
  Clock::time_point stalledSince_{};
  int64_t stalledSinceWallNs_ = 0;
  bool stalled_ = false;
  Clock::time_point movedAt_{};      // traffic last moved (a round found no stall)
  bool everMoved_ = false;            // a stall before any traffic is a slow start: not reported
  Clock::time_point goneSince_{};     // peerGoneLocked() has held since; {} while it does not
  Clock::time_point nextStallReport_{};
  Millis stallReportEvery_{0};
  bool stallReported_ = false;
};

// Registers a NicHealth listener that passes every change of one of `healthIds`
// to each connection `supervisor` serves (Connection::onNicHealth). Returns
// the listener token for NicHealth::removeListener.
uint64_t forwardNicHealth(Supervisor* supervisor, std::vector<int> healthIds);

}  // namespace reccl
