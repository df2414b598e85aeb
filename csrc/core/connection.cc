#include "core/connection.h"

#include <algorithm>
#include <map>
#include <thread>

#include "core/error.h"
#include "core/frame.h"
#include "core/grey_detector.h"
#include "core/health.h"
#include "core/log.h"

namespace reccl {

namespace {

// The first `stalled` report comes after this long without a path (a failover
// onto a live path never gets there); the next ones at doubling intervals up to
// kStallReportMax, so a long outage costs a handful of events per connection.
constexpr Millis kStallReportFirst(1000);
constexpr Millis kStallReportMax(30000);

struct StallBoard {
  std::mutex mutex;
  std::map<uint64_t, StallInfo> stalled;
  uint64_t reported = 0;
};

StallBoard& stallBoard() {
  static StallBoard* board = new StallBoard();  // never destroyed: connections may outlive statics
  return *board;
}

}  // namespace

std::vector<StallInfo> stalledConnections() {
  StallBoard& board = stallBoard();
  std::lock_guard<std::mutex> lock(board.mutex);
  std::vector<StallInfo> out;
  for (const auto& [id, info] : board.stalled) out.push_back(info);
  return out;
}

uint64_t stallsReported() {
  StallBoard& board = stallBoard();
  std::lock_guard<std::mutex> lock(board.mutex);
  return board.reported;
}

Connection::Connection(ConnectionEnv env, uint64_t id, std::vector<PathCandidate> candidates)
    : env_(std::move(env)), id_(id) {
  for (const auto& candidate : candidates) {
    Slot slot;
    slot.nics = candidate;
    slots_.push_back(std::move(slot));
  }
}

Connection::~Connection() {
  destroyAllPaths();
  Lock lock(mutex_);
  endStallLocked(false);
}

void Connection::destroyAllPaths() {
  std::vector<std::shared_ptr<Path>> paths;
  {
    Lock lock(mutex_);
    // Path threads run until joined below and may still deliver frames (a NOTIFY
    // fails a path): nothing may look up, nor any state point at, a moved path.
    closed_ = true;
    for (auto& slot : slots_) {
      if (slot.path) {
        slot.path->shutdown();
        paths.push_back(std::move(slot.path));
      }
      slot.state = SlotState::kIdle;
    }
    active_ = -1;
    for (auto& path : retired_) paths.push_back(std::move(path));
    retired_.clear();
  }
  // Join before letting go: a path thread may still hold a path of its own
  // (activate() answering on it, endData() sending an ACK). Were ours not the
  // last reference, that thread would destroy the path, i.e. join itself
  // (std::terminate), after this connection, which it is still using, is gone.
  for (auto& path : paths) path->stopAndJoin();
  paths.clear();
}

std::string Connection::slotName(int index) const {
  static const char* const kRoles[] = {"primary", "backup"};
  const Slot& slot = slots_.at(index);
  std::string role = slot.nics.upFront && index < 2 ? kRoles[index] : "rail";
  std::string local = slot.nics.localNic < static_cast<int>(env_.localNicNames.size())
                          ? env_.localNicNames[slot.nics.localNic]
                          : "nic" + std::to_string(slot.nics.localNic);
  std::string remote = slot.remoteAddress;
  if (remote.empty()) {  // not connected yet: name the address it will dial
    const auto& known = env_.remoteNicAddresses;
    remote = slot.nics.remoteNic < static_cast<int>(known.size()) ? known[slot.nics.remoteNic]
                                                                  : env_.peerName;
  }
  return role + " " + local + "->" + remote + "/nic" + std::to_string(slot.nics.remoteNic);
}

int Connection::slotOf(uint64_t pathId) const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].path && slots_[i].pathId == pathId) return static_cast<int>(i);
  }
  return -1;
}

void Connection::emitPathEvent(EventKind kind, int index, Reason reason,
                               const std::string& detail) {
  Event event;
  event.kind = kind;
  event.reason = reason;
  event.connectionId = id_;
  event.fromPath = index;
  event.nic = env_.localNicNames.at(slots_.at(index).nics.localNic);
  event.peer = env_.peerName;
  event.detail = slotName(index) + (detail.empty() ? "" : ": " + detail);
  NicHealth::instance().emit(std::move(event));
}

void Connection::emitSwitchEvent(EventKind kind, int from, int to, Reason reason,
                                 int64_t durationNs, int64_t bytesReplayed,
                                 const std::string& detail) {
  Event event;
  event.kind = kind;
  event.reason = reason;
  event.connectionId = id_;
  event.fromPath = from;
  event.toPath = to;
  event.durationNs = durationNs;
  event.bytesReplayed = bytesReplayed;
  int nicIndex = from >= 0 ? from : to;
  event.nic = env_.localNicNames.at(slots_.at(nicIndex).nics.localNic);
  event.peer = env_.peerName;
  event.detail = detail;
  NicHealth::instance().emit(std::move(event));
}

void Connection::failPathLocked(int index, Reason reason, const PathFailure& failure) {
  Slot& slot = slots_.at(index);
  if (slot.state != SlotState::kUp) return;
  slot.state = SlotState::kFailed;
  noteFailureLocked(index, reason, failure);
  const std::string& detail = failure.what;
  shutdownPathLocked(*slot.path);
  if (!closed_ && !peerClosed_) {
    NicHealth& health = NicHealth::instance();
    health.counters(env_.localHealthIds.at(slot.nics.localNic)).pathsDown.fetch_add(1);
    emitPathEvent(EventKind::kPathDown, index, reason, detail);
    RECCL_LOG(kInfo, "path down: " + slotName(index) + " (" + reasonName(reason) + ") " + detail);
  }
  if (index == active_) {
    active_ = -1;
    onActiveLostLocked(index, reason);
  } else {
    onOtherLostLocked(index, reason);
  }
  env_.supervisor->poke();
}

uint64_t Connection::installPathLocked(int index, std::shared_ptr<Path> path, PathCandidate nics) {
  slots_.at(index).nics = nics;
  return installPathLocked(index, std::move(path));
}

uint64_t Connection::installPathLocked(int index, std::shared_ptr<Path> path) {
  Slot& slot = slots_.at(index);
  if (slot.path) {
    if (slot.state == SlotState::kUp)
      failPathLocked(index, Reason::kError, "replaced by a new dial");
    shutdownPathLocked(*slot.path);
    retired_.push_back(std::move(slot.path));
  }
  bool reestablished = slot.everUp;
  slot.remoteAddress = path->peer();
  slot.path = std::move(path);
  slot.pathId = nextPathId_++;
  slot.state = SlotState::kUp;
  slot.backoffMs = 0;
  slot.everUp = true;
  if (auto heard = slot.path->pairHeard()) slot.heard = std::move(heard);
  if (reestablished) emitPathEvent(EventKind::kPathUp, index, Reason::kHealed, "");
  env_.supervisor->poke();
  return slot.pathId;
}

void Connection::shutdownPathLocked(Path& path) {
  path.shutdown();
  quietAfter_ = std::max(quietAfter_, path.quietAfter());
}

void Connection::reapLocked() {
  for (auto& slot : slots_) {
    if (slot.state == SlotState::kFailed) {
      retired_.push_back(std::move(slot.path));
      slot.state = SlotState::kIdle;
      slot.backoffMs = slot.backoffMs == 0 ? 50 : std::min(slot.backoffMs * 2, 2000);
      slot.nextDial = Clock::now() + Millis(slot.backoffMs);
    }
  }
}

void Connection::destroyRetired() {
  std::vector<std::shared_ptr<Path>> ready;
  {
    Lock lock(mutex_);
    for (auto it = retired_.begin(); it != retired_.end();) {
      // use_count 1: no caller is mid-send on it, so joining cannot deadlock.
      if (it->use_count() == 1) {
        ready.push_back(std::move(*it));
        it = retired_.erase(it);
      } else {
        ++it;
      }
    }
  }
  ready.clear();  // joins the paths' threads, unlocked
}

std::shared_ptr<Path> Connection::activePathLocked() const {
  if (active_ < 0) return nullptr;
  return slots_.at(active_).path;
}

void Connection::admitLocked(const char* op, size_t pending, const char* many) const {
  if (!error_.empty()) throw Error(std::string(op) + " on a failed connection: " + error_);
  if (closed_) throw Error(std::string(op) + " on a closed connection");
  if (pending >= kMaxOutstanding) {
    throw Error(std::string("too many ") + many + " on one connection (" +
                std::to_string(kMaxOutstanding) + " at most); test() earlier ones first");
  }
}

std::string Connection::slotSummaryLocked() const {
  std::string out;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& slot = slots_[i];
    if (!slot.everUp && !slot.nics.upFront && slot.state == SlotState::kIdle) continue;
    if (!out.empty()) out += "; ";
    out += slotName(static_cast<int>(i));
    if (slot.state == SlotState::kUp) {
      out += " up";
      continue;
    }
    // A slot dialing again still names its last failure (a dial that keeps failing).
    out += slot.state == SlotState::kDialing ? " dialing" : " down";
    if (slot.lastFailure != Reason::kNone) {
      out += std::string(slot.state == SlotState::kDialing ? " (last failure: " : " (") +
             reasonName(slot.lastFailure) +
             (slot.lastDetail.empty() ? "" : ": " + slot.lastDetail) + ")";
    }
  }
  return out;
}

void Connection::noteFailureLocked(int index, Reason reason, const PathFailure& failure) {
  Slot& slot = slots_.at(index);
  slot.lastFailure = reason;
  slot.lastDetail = failure.what;
  slot.lastFailureAt = Clock::now();
  slot.peerAnswered = failure.peerHostAnswered;
  slot.refused = failure.nothingListens;
  if (slot.refused && slot.heard) slot.heard->refusedAt(nowNs());
}

void Connection::failConnectionLocked(const std::string& why) {
  if (!error_.empty()) return;
  error_ = why;
  endStallLocked(false);
  RECCL_LOG(kWarn,
            "connection " + std::to_string(id_) + " to " + env_.peerName + " failed: " + why);
  Event event;
  event.kind = EventKind::kConnectionFailed;
  event.reason = Reason::kTimeout;
  event.connectionId = id_;
  event.nic = env_.localNicNames.at(slots_.at(0).nics.localNic);
  event.peer = env_.peerName;
  event.detail = why;
  NicHealth::instance().emit(std::move(event));
  retireAllPathsLocked(why);
}

void Connection::retireAllPathsLocked(const std::string& why) {
  for (auto& slot : slots_) {
    if (slot.path) {
      shutdownPathLocked(*slot.path);
      retired_.push_back(std::move(slot.path));
    }
    slot.state = SlotState::kIdle;
  }
  active_ = -1;
  failPendingLocked(why);
}

bool Connection::quiet() {
  Lock lock(mutex_);
  if (!retired_.empty() || stalled_) return false;
  if (closed_ || peerClosed_ || !error_.empty()) return true;
  if (active_ < 0) return false;
  for (const auto& slot : slots_) {
    if (slot.state == SlotState::kDialing || slot.state == SlotState::kFailed) return false;
    if (slot.nics.upFront && slot.state != SlotState::kUp) return false;
  }
  return roleQuietLocked();
}

void Connection::checkActiveSlotLocked() {
  if (active_ < 0 || slots_.at(active_).state == SlotState::kUp) return;
  RECCL_LOG(kWarn, "connection " + std::to_string(id_) + ": active path " + slotName(active_) +
                       " is not up; treating it as lost (" + slotSummaryLocked() + ")");
  int lost = active_;
  active_ = -1;
  onActiveLostLocked(lost, slots_.at(lost).lastFailure);
}

void Connection::emitStallEvent(EventKind kind, Reason reason, int64_t durationNs,
                                const std::string& detail) {
  Event event;
  event.kind = kind;
  event.reason = reason;
  event.connectionId = id_;
  event.durationNs = durationNs;
  const int nic = active_ >= 0 ? slots_.at(active_).nics.localNic : slots_.at(0).nics.localNic;
  event.nic = env_.localNicNames.at(nic);
  event.peer = env_.peerName;
  event.detail = detail;
  NicHealth::instance().emit(std::move(event));
}

bool Connection::peerGoneLocked() const {
  bool refused = false;
  for (const Slot& slot : slots_) {
    if (slot.state == SlotState::kUp) return false;
    // Older failures are of paths traffic moved without; a down local NIC
    // tells nothing of the peer.
    if (slot.lastFailure == Reason::kNone || slot.lastFailureAt < movedAt_) continue;
    if (!NicHealth::instance().usable(env_.localHealthIds.at(slot.nics.localNic))) continue;
    if (!slot.peerAnswered) return false;
    refused = refused || slot.refused;
  }
  if (refused) return true;
  // Another connection to the peer (one that dials) may have been refused.
  for (const Slot& slot : slots_) {
    const int64_t refusedNs = slot.heard ? slot.heard->lastRefusedNs() : 0;
    if (refusedNs != 0 && atNs(refusedNs) >= movedAt_) return true;
  }
  return false;
}

bool Connection::peerHeardSinceLocked(int64_t sinceNs) const {
  for (const Slot& slot : slots_) {
    if (slot.heard && slot.heard->lastHeardNs() >= sinceNs) return true;
  }
  return false;
}

void Connection::endStallLocked(bool recovered) {
  if (!stallReported_) return;
  stallReported_ = false;
  {
    StallBoard& board = stallBoard();
    std::lock_guard<std::mutex> lock(board.mutex);
    board.stalled.erase(id_);
  }
  if (!recovered) return;
  const int64_t stalledNs =
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - stalledSince_).count();
  emitStallEvent(EventKind::kRecovered, Reason::kHealed, stalledNs,
                 "traffic moves again after " + std::to_string(stalledNs / 1000000) +
                     " ms without a usable path" +
                     (active_ >= 0 ? ", on " + slotName(active_) : std::string()));
  RECCL_LOG(kWarn, "connection " + std::to_string(id_) + " to " + env_.peerName +
                       " moves traffic again after " + std::to_string(stalledNs / 1000000) +
                       " ms without a usable path");
}

void Connection::checkStalledLocked(bool stalled, const char* what) {
  const Clock::time_point now = Clock::now();
  if (!stalled) {
    if (stalled_) endStallLocked(true);
    stalled_ = false;
    movedAt_ = now;
    everMoved_ = true;
    return;
  }
  if (!stalled_) {
    stalled_ = true;
    stalledSince_ = now;
    stalledSinceWallNs_ = wallNs();
    goneSince_ = {};
    stallReportEvery_ = kStallReportFirst;
    nextStallReport_ = now + kStallReportFirst;
  }
  // A NIC condemned as slow is better than none (grey_detector.h).
  if (now - stalledSince_ >= kStallReportFirst) GreyMonitor::instance().lastResort();
  const int noPathMs = env_.config.noPathTimeoutMs;
  const int goneMs = env_.config.peerGoneTimeoutMs;
  if (goneMs < noPathMs && peerGoneLocked()) {
    if (goneSince_ == Clock::time_point{}) goneSince_ = now;
    // Defence in depth: a live peer goes on beating on every NIC pair any
    // connection still holds; only a peer silent on all of them for the whole
    // bound is gone.
    const int64_t goneNs = static_cast<int64_t>(goneMs) * 1000000;
    if (now - goneSince_ > Millis(goneMs) && !peerHeardSinceLocked(nowNs() - goneNs)) {
      peerGone_ = error_.empty();
      failConnectionLocked(std::string(what) + " for " + std::to_string(goneMs) +
                           " ms while the peer's host answered for it with nothing there "
                           "(dials refused, paths ended by an end of stream or a reset) and "
                           "nothing came from it on any NIC pair: the peer process is gone "
                           "(RECCL_PEER_GONE_TIMEOUT_MS); paths: " +
                           slotSummaryLocked());
      return;
    }
  } else {
    goneSince_ = {};
  }
  if (now - stalledSince_ > Millis(noPathMs)) {
    failConnectionLocked(std::string(what) + " for " + std::to_string(noPathMs) +
                         " ms (RECCL_NO_PATH_TIMEOUT_MS); paths: " + slotSummaryLocked());
    return;
  }
  if (!everMoved_ || now < nextStallReport_) return;
  const int64_t stalledMs = std::chrono::duration_cast<Millis>(now - stalledSince_).count();
  const std::string paths = slotSummaryLocked();
  Reason latest = Reason::kNone;  // of the most recent failure
  Clock::time_point latestAt{};
  for (const Slot& slot : slots_) {
    if (slot.lastFailure != Reason::kNone && slot.lastFailureAt >= latestAt) {
      latest = slot.lastFailure;
      latestAt = slot.lastFailureAt;
    }
  }
  emitStallEvent(EventKind::kStalled, latest, stalledMs * 1000000,
                 std::string(what) + " for " + std::to_string(stalledMs) +
                     " ms; requests wait up to " + std::to_string(noPathMs) +
                     " ms (RECCL_NO_PATH_TIMEOUT_MS); paths: " + paths);
  if (!stallReported_) {
    RECCL_LOG(kWarn, "connection " + std::to_string(id_) + " to " + env_.peerName + ": " + what +
                         " for " + std::to_string(stalledMs) + " ms; waiting up to " +
                         std::to_string(noPathMs) +
                         " ms (RECCL_NO_PATH_TIMEOUT_MS); paths: " + paths);
  }
  {
    StallBoard& board = stallBoard();
    std::lock_guard<std::mutex> lock(board.mutex);
    if (!stallReported_) ++board.reported;
    board.stalled[id_] = StallInfo{id_, env_.peerName, stalledSinceWallNs_, paths};
  }
  stallReported_ = true;
  stallReportEvery_ = std::min(stallReportEvery_ * 2, kStallReportMax);
  nextStallReport_ = now + stallReportEvery_;
}

void Connection::onNicHealth(int healthId, bool up, Reason reason) {
  Lock lock(mutex_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    if (env_.localHealthIds.at(slot.nics.localNic) != healthId) continue;
    if (!up) {
      failPathLocked(static_cast<int>(i), reason, "local NIC down");
    } else if (slot.state == SlotState::kIdle) {
      slot.backoffMs = 0;  // the NIC is back: dial now, not after a backoff
      slot.nextDial = Clock::now();
    }
  }
  env_.supervisor->poke();
}

void Connection::onPathFailed(uint64_t pathId, Reason reason, const PathFailure& failure) {
  Lock lock(mutex_);
  int index = slotOf(pathId);
  if (index >= 0) failPathLocked(index, reason, failure);
  if (closed_) peerClosedCv_.notify_all();  // close() stops waiting on a path that is gone
}

void Connection::close() {
  std::shared_ptr<Path> active;
  {
    Lock lock(mutex_);
    if (closed_) return;
    closed_ = true;
    if (error_.empty()) active = activePathLocked();
  }
  if (active && active->sendControl(encodeClose())) {
    // Wait (bounded) for the peer's CLOSE, so it never mistakes our EOFs for a fault.
    // The peer's end going away ends the wait too: it closes right after its own
    // CLOSE, and the reset of its socket can overtake that frame.
    Lock lock(mutex_);
    peerClosedCv_.wait_for(lock, Millis(env_.config.heartbeatMs), [&] {
      if (peerClosed_) return true;
      for (const Slot& slot : slots_) {
        if (slot.path == active) return slot.state != SlotState::kUp;
      }
      return true;  // no longer in a slot
    });
  }
  {
    Lock lock(mutex_);
    endStallLocked(false);
    retireAllPathsLocked("connection closed");
  }
  active.reset();
  // Bounded: callers mid-send let go within one control-frame bound.
  Clock::time_point deadline = Clock::now() + Millis(env_.config.heartbeatMs * 2 + 1000);
  for (;;) {
    destroyRetired();
    {
      Lock lock(mutex_);
      if (retired_.empty() || Clock::now() > deadline) break;
    }
    std::this_thread::sleep_for(Millis(5));
  }
}

void Connection::onControl(uint64_t pathId, const ControlFrame& frame) {
  Lock lock(mutex_);
  // The peer's CLOSE matters most while we are closing: close() waits for it.
  if (frame.type == FrameType::kClose) {
    onPeerCloseLocked(pathId, lock);
    return;
  }
  if (!error_.empty() || closed_) return;
  if (frame.type == FrameType::kNotify) {
    if (frame.notify.pathIndex < slots_.size()) {
      if (static_cast<Reason>(frame.notify.reason) == Reason::kSlow) {
        // The peer condemned its end of this path: evidence on ours (grey_detector.h).
        GreyMonitor::instance().peerFoundSlow(
            env_.localHealthIds.at(slots_[frame.notify.pathIndex].nics.localNic));
      }
      failPathLocked(frame.notify.pathIndex, Reason::kPeer,
                     std::string("peer saw ") +
                         reasonName(static_cast<Reason>(frame.notify.reason)));
    }
    return;
  }
  onRoleControlLocked(pathId, frame, lock);
}

void Connection::onPeerCloseLocked(uint64_t pathId, Lock& lock) {
  if (peerClosed_) return;
  peerClosed_ = true;
  peerClosedCv_.notify_all();
  if (closed_) return;
  int index = slotOf(pathId);
  if (index < 0) return;
  std::shared_ptr<Path> path = slots_[index].path;
  lock.unlock();
  path->sendControl(encodeClose());
  lock.lock();
}

std::string Connection::error() const {
  Lock lock(mutex_);
  return error_;
}

bool Connection::peerGone() const {
  Lock lock(mutex_);
  return peerGone_;
}

std::vector<std::string> Connection::describePaths() const {
  Lock lock(mutex_);
  std::vector<std::string> out;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& slot = slots_[i];
    if (!slot.everUp && !slot.nics.upFront) continue;  // an unused last resort
    std::string state = slot.state == SlotState::kUp        ? "up"
                        : slot.state == SlotState::kDialing ? "dialing"
                                                            : "down";
    if (static_cast<int>(i) == active_) state += ",active";
    out.push_back(slotName(static_cast<int>(i)) + " " + state);
  }
  return out;
}

bool Connection::expectsTraffic(uint64_t pathId) {
  Lock lock(mutex_);
  return active_ >= 0 && slotOf(pathId) == active_ && requestsPendingLocked();
}

int Connection::activePath() const {
  Lock lock(mutex_);
  return active_;
}

int Connection::activeLocalNic() const {
  Lock lock(mutex_);
  return active_ < 0 ? -1 : slots_.at(active_).nics.localNic;
}

ConnectionEnv makeConnectionEnv(const Config& config, Supervisor* supervisor,
                                const std::vector<NicInfo>& nics, const std::vector<int>& healthIds,
                                const std::string& peer, const void* registrar) {
  ConnectionEnv env;
  env.registrar = registrar;
  env.config = config;
  env.supervisor = supervisor;
  for (const auto& nic : nics) env.localNicNames.push_back(nic.name);
  env.localHealthIds = healthIds;
  env.peerName = peer;
  for (const auto& a : nics) {
    std::vector<int> row;
    for (const auto& b : nics) row.push_back(&a == &b ? 0 : nicDistance(a, b));
    env.nicDistances.push_back(std::move(row));
  }
  return env;
}

uint64_t forwardNicHealth(Supervisor* supervisor, std::vector<int> healthIds) {
  return NicHealth::instance().addListener(
      [ids = std::move(healthIds), supervisor](const std::string& name, bool up, Reason reason) {
        int id = NicHealth::instance().idOf(name);
        bool ours = false;
        for (int mine : ids) ours = ours || mine == id;
        if (!ours) return;
        supervisor->forEach([&](Serviced& item) {
          if (auto* connection = dynamic_cast<Connection*>(&item)) {
            connection->onNicHealth(id, up, reason);
          }
        });
      });
}

}  // namespace reccl
