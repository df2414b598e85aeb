#include "core/send_connection.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"

namespace reccl {

namespace {
const char* const kReceiverClosed = "the receiver closed the connection";
}  // namespace

SendConnection::SendConnection(ConnectionEnv env, uint64_t id,
                               std::vector<PathCandidate> candidates,
                               std::unique_ptr<Dialer> dialer, uint64_t chunkBytes)
    : Connection(std::move(env), id, std::move(candidates)),
      dialer_(std::move(dialer)),
      chunkBytes_(chunkBytes),
      pieces_(chunkBytes) {}

SendConnection::~SendConnection() {
  destroyAllPaths();
  SpreadTable::instance().set(id_, env_.peerName, {});
}

std::shared_ptr<Request> SendConnection::isend(const uint8_t* data, uint64_t bytes,
                                               const MemoryRegistration* registration) {
  if (registration != nullptr)
    registration->requireUsable(env_.registrar, data, bytes, "send buffer");
  Lock lock(mutex_);
  admitLocked("send", sends_.size(), "sends in flight");
  uint64_t seq = nextSeq_++;
  auto request = std::make_shared<Request>(seq, const_cast<uint8_t*>(data), bytes);
  if (peerClosed_) {
    // The receiver sent its CLOSE after it stopped taking receives: no receive
    // can match this send any more. It fails at once, as a request, like a send
    // pending at the CLOSE does once the paths are gone.
    request->fail(kReceiverClosed);
    return request;
  }
  PendingSend& send = sends_[seq];
  send.request = request;
  send.registration = registration;
  auto placed = earlyPlacements_.find(seq);
  if (placed != earlyPlacements_.end()) {
    send.placement = std::move(placed->second);
    earlyPlacements_.erase(placed);
  }
  auto early = earlyCts_.find(seq);
  if (early != earlyCts_.end()) {
    send.capacity = early->second;
    send.capacityKnown = true;
    earlyCts_.erase(early);
    if (active_ >= 0 && !awaitingResync_ && !postLocked(seq, send)) sends_.erase(seq);
  }
  return request;
}

bool SendConnection::ready() const {
  Lock lock(mutex_);
  return everActive_ && error_.empty();
}

void SendConnection::dialNow() {
  Lock lock(mutex_);
  if (closed_ || !error_.empty()) return;
  dialLocked();
}

bool SendConnection::checkCarriableLocked(uint64_t seq, PendingSend& send) {
  const bool sourceOnDevice = send.registration != nullptr && !send.registration->hostAccessible();
  const bool targetOnDevice = send.placement != nullptr && !send.placement->hostAccessible;
  const bool direct = send.registration != nullptr && send.placement != nullptr;
  if (direct || (!sourceOnDevice && !targetOnDevice)) return true;
  if (send.request->capacity() == 0) return true;  // no byte to carry: no copy either
  send.request->fail(std::string("message ") + std::to_string(seq) + " cannot be carried: the " +
                     (sourceOnDevice ? "send" : "receive") +
                     " buffer is device memory (dma-buf), which travels only by direct placement, "
                     "and the " +
                     (sourceOnDevice ? "receiver" : "sender") + " did not register its buffer");
  cancels_.push_back({seq, send.request->capacity()});  // so the receive fails too, not hangs
  env_.supervisor->poke();
  return false;
}

bool SendConnection::postLocked(uint64_t seq, PendingSend& send) {
  const uint64_t bytes = send.request->capacity();
  if (!checkCarriableLocked(seq, send)) return false;
  if (bytes > send.capacity) {
    send.request->fail("send of " + std::to_string(bytes) +
                       " bytes is larger than the posted receive of " +
                       std::to_string(send.capacity) + " bytes");
    cancels_.push_back({seq, bytes});  // so the receive fails too, not hangs
    env_.supervisor->poke();
    return false;
  }
  uint64_t offset = send.resumeOffset - send.resumeOffset % chunkBytes_;
  const Clock::time_point postedAt = Clock::now();
  send.carried.clear();
  // Spreading: a piece per lane and chunk, so the lanes' shares come out even
  // (core/spread.h, "Pieces").
  const size_t lanes = lanes_.slots().size();
  do {
    DataChunk chunk{};
    chunk.header.seq = seq;
    chunk.header.epoch = epoch_;
    chunk.header.messageBytes = bytes;
    chunk.header.offset = offset;
    chunk.header.bytes = static_cast<uint32_t>(pieces_.pieceLength(offset, bytes, lanes));
    chunk.payload = send.request->data() + offset;
    if (send.registration != nullptr && send.placement != nullptr) {
      chunk.placement = send.placement;
      chunk.source = send.registration;
    }
    const int lane = lanes_.pick(chunk.header.bytes, postedAt);
    slots_.at(lane).path->sendData(chunk);
    auto carried = std::find_if(send.carried.begin(), send.carried.end(),
                                [&](const auto& entry) { return entry.first == lane; });
    if (carried == send.carried.end()) {
      send.carried.push_back({lane, chunk.header.bytes});
    } else {
      carried->second += chunk.header.bytes;
    }
    offset += chunk.header.bytes;
  } while (offset < bytes);
  send.busy.clear();  // an earlier posting's busy time ends uncredited
  if (env_.config.grey) {  // the detector's only input: no bookkeeping without it
    for (const auto& entry : send.carried) {
      send.busy.emplace_back(env_.localHealthIds.at(slots_.at(entry.first).nics.localNic));
    }
  }
  send.posted = true;
  return true;
}

void SendConnection::postAllLocked() {
  for (auto it = sends_.begin(); it != sends_.end();) {
    PendingSend& send = it->second;
    if (send.capacityKnown && !send.posted && !postLocked(it->first, send)) {
      it = sends_.erase(it);
    } else {
      ++it;
    }
  }
}

void SendConnection::onRoleControlLocked(uint64_t pathId, const ControlFrame& frame, Lock&) {
  switch (frame.type) {
    case FrameType::kCts: {
      // Receives are truthful whichever path told us; duplicates are harmless.
      auto it = sends_.find(frame.cts.seq);
      if (it == sends_.end()) {
        requireAnnounceableLocked(frame.cts.seq, "CTS");
        if (frame.cts.seq >= nextSeq_) earlyCts_[frame.cts.seq] = frame.cts.bytes;
        return;
      }
      PendingSend& send = it->second;
      if (send.capacityKnown) return;
      send.capacity = frame.cts.bytes;
      send.capacityKnown = true;
      if (active_ >= 0 && !awaitingResync_ && !postLocked(it->first, send)) sends_.erase(it);
      return;
    }
    case FrameType::kPlace: {
      // Sent before the CTS or RESYNC that posts the receive, on the same
      // path, so it is known before the first chunk is queued.
      auto placement = std::make_shared<Placement>();
      placement->bytes.assign(frame.place.placement, frame.place.placement + frame.place.length);
      placement->hostAccessible = frame.place.hostAccessible != 0;
      auto it = sends_.find(frame.place.seq);
      if (it != sends_.end()) {
        it->second.placement = std::move(placement);
      } else {
        requireAnnounceableLocked(frame.place.seq, "PLACE");
        if (frame.place.seq >= nextSeq_) earlyPlacements_[frame.place.seq] = std::move(placement);
      }
      return;
    }
    case FrameType::kAck: {
      auto it = sends_.find(frame.ack.seq);
      if (it == sends_.end()) return;
      // Each NIC is credited with the bytes its lane carried in the last
      // posting; bytes that landed in an earlier epoch go to the active one.
      NicHealth& health = NicHealth::instance();
      const Clock::time_point now = Clock::now();
      uint64_t credited = 0;
      for (const auto& [lane, bytes] : it->second.carried) {
        lanes_.acked(lane, bytes, now);
        health.counters(env_.localHealthIds.at(slots_.at(lane).nics.localNic))
            .bytesSent.fetch_add(bytes);
        credited += bytes;
      }
      if (frame.ack.bytes > credited) {
        health.counters(env_.localHealthIds.at(slots_.at(std::max(active_, 0)).nics.localNic))
            .bytesSent.fetch_add(frame.ack.bytes - credited);
      }
      // The ACK may overtake a writer still returning from the message's last write.
      const Millis writeBound(std::max(1, env_.config.heartbeatMs / 2));
      for (const auto& [lane, bytes] : it->second.carried) {
        if (const std::shared_ptr<Path>& path = slots_.at(lane).path) {
          path->awaitWritten(frame.ack.seq, writeBound);
        }
      }
      it->second.completeBusy();
      it->second.request->complete(frame.ack.bytes);
      sends_.erase(it);
      return;
    }
    case FrameType::kResync:
      if (frame.resync.epoch == epoch_ && awaitingResync_ && slotOf(pathId) == active_) {
        applyResyncLocked(frame);
      }
      return;
    default:
      throw ProtocolError(std::string("unexpected ") + frameTypeName(frame.type) +
                          " frame at the sending end");
  }
}

void SendConnection::requireAnnounceableLocked(uint64_t seq, const char* what) const {
  // The receiver posts at most kMaxOutstanding receives, and each one it
  // finished (or cancelled) took one of our sends: a receive it announces lies
  // below nextSeq_ + kMaxOutstanding. One beyond that breaks the protocol and
  // must not grow the tables of receives posted ahead of their sends.
  if (seq >= nextSeq_ + kMaxOutstanding) {
    throw ProtocolError(std::string(what) + " for message " + std::to_string(seq) + ", but only " +
                        std::to_string(nextSeq_) + " were sent and a receiver posts at most " +
                        std::to_string(kMaxOutstanding) + " ahead");
  }
}

void SendConnection::applyResyncLocked(const ControlFrame& frame) {
  // Checked before anything changes: a bad RESYNC fails the path, not the state.
  for (const auto& entry : frame.entries) requireAnnounceableLocked(entry.seq, "RESYNC entry");
  std::map<uint64_t, const ResyncEntry*> outstanding;
  for (const auto& entry : frame.entries) outstanding[entry.seq] = &entry;
  int64_t replayed = 0;
  for (auto it = sends_.begin(); it != sends_.end();) {
    auto found = outstanding.find(it->first);
    if (it->first < frame.resync.nextSeq && found == outstanding.end()) {
      // The receiver completed it; only the ACK was lost with the path.
      it->second.completeBusy();
      it->second.request->complete(it->second.request->capacity());
      it = sends_.erase(it);
      continue;
    }
    PendingSend& send = it->second;
    if (found != outstanding.end()) {
      send.capacity = found->second->capacity;
      send.capacityKnown = true;
      send.resumeOffset = std::min(found->second->resumeOffset, send.request->capacity());
      if (switchPending_) {
        replayed += static_cast<int64_t>(send.request->capacity() - send.resumeOffset);
      }
    }
    send.posted = false;
    ++it;
  }
  for (const auto& [seq, entry] : outstanding) {
    if (seq >= nextSeq_) earlyCts_[seq] = entry->capacity;
  }
  awaitingResync_ = false;
  everActive_ = true;
  postAllLocked();
  if (switchPending_) {
    switchPending_ = false;
    NicHealth& health = NicHealth::instance();
    if (switchIsFailback_) {
      health.counters(env_.localHealthIds.at(slots_.at(active_).nics.localNic))
          .failbacks.fetch_add(1);
    } else if (switchFrom_ >= 0) {
      health.counters(env_.localHealthIds.at(slots_.at(switchFrom_).nics.localNic))
          .failovers.fetch_add(1);
    }
    emitSwitchEvent(switchIsFailback_ ? EventKind::kFailback : EventKind::kFailover, switchFrom_,
                    active_, switchReason_, nowNs() - switchStartNs_, replayed,
                    "sender: " + (switchFrom_ >= 0 ? slotName(switchFrom_) : std::string("?")) +
                        " => " + slotName(active_));
  }
}

uint8_t* SendConnection::beginData(uint64_t, const DataHeader&, bool) {
  throw ProtocolError("DATA frame arrived at the sending end");
}

void SendConnection::endData(uint64_t, const DataHeader&, bool) {}

void SendConnection::onActiveLostLocked(int index, Reason reason) {
  awaitingResync_ = false;
  for (auto& [seq, send] : sends_) send.posted = false;
  // A failback whose target dies before its RESYNC is abandoned: what follows is
  // a failover away from that path.
  if (everActive_ && (!switchPending_ || switchIsFailback_)) {
    switchPending_ = true;
    switchIsFailback_ = false;
    switchFrom_ = index;
    switchReason_ = reason;
    switchStartNs_ = nowNs();
  }
}

void SendConnection::onOtherLostLocked(int index, Reason reason) {
  if (!lanes_.has(index)) return;
  // A lane's unacknowledged chunks are replayed on the others exactly as a
  // failover replays the active path's: a new epoch, whose RESYNC says where
  // each message resumes. The receiver hears first that the lane is gone, so
  // its fence does not wait for that lane's stalled copies.
  lostLanes_.push_back({index, reason});
  active_ = -1;
  onActiveLostLocked(index, reason);
}

void SendConnection::failPendingLocked(const std::string& why) {
  for (auto& [seq, send] : sends_) send.request->fail(why);
  sends_.clear();
  lanes_.reset({}, {});
  lanesChangedLocked();
}

void SendConnection::onDialed(int index, std::shared_ptr<Path> path, const PathFailure& failure) {
  std::shared_ptr<Path> discard;
  std::shared_ptr<Path> activateOn;
  std::vector<std::vector<uint8_t>> activateFrames;
  {
    Lock lock(mutex_);
    Slot& slot = slots_.at(index);
    bool usable = NicHealth::instance().usable(env_.localHealthIds.at(slot.nics.localNic));
    if (closed_ || !error_.empty() || !path || !usable) {
      slot.state = SlotState::kIdle;
      noteFailureLocked(index, Reason::kError,
                        path ? PathFailure{usable ? "connection closed" : "local NIC down"}
                             : failure);
      slot.backoffMs = slot.backoffMs == 0 ? 50 : std::min(slot.backoffMs * 2, 2000);
      slot.nextDial = Clock::now() + Millis(slot.backoffMs);
      discard = std::move(path);
      if (discard) discard->shutdown();
    } else {
      uint64_t pathId = installPathLocked(index, path);
      lanes_.forget(index);  // a new path: its speed is not known yet
      try {
        path->start(this, pathId);
      } catch (const Error& e) {
        failPathLocked(index, Reason::kError, e.what());
      }
      // The first activation goes out from here, not at the supervisor's next
      // round: a first use waits for it. Before any epoch there is nothing to
      // drain (no lanes yet), so this is service()'s activation without its drain.
      if (epoch_ == 0) {
        std::vector<std::shared_ptr<Path>> drainFirst;
        activateOn = maybeActivateLocked(&activateFrames, &drainFirst);
      }
    }
  }
  discard.reset();
  if (activateOn) {
    bool sent = true;
    for (const auto& frame : activateFrames) sent = sent && activateOn->sendControl(frame);
    if (!sent) RECCL_LOG(kInfo, "ACTIVATE could not be sent; the path is failing");
  }
  env_.supervisor->poke();
}

void SendConnection::dialLocked() {
  // Last-resort rails are dialed only when every up-front path is down.
  bool noneUp = true;
  for (const auto& slot : slots_) {
    if (slot.state == SlotState::kUp || slot.state == SlotState::kDialing) noneUp = false;
  }
  Clock::time_point now = Clock::now();
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    if (slot.state != SlotState::kIdle || now < slot.nextDial) continue;
    // Spreading needs the rails as soon as the primary is down.
    const bool railsWanted = noneUp || spreadWantedLocked();
    if (!slot.nics.upFront && !(railsWanted && env_.config.backup)) continue;
    const int healthId = env_.localHealthIds.at(slot.nics.localNic);
    // A blackholed NIC would complete no handshake for real; dialing it would
    // only fail back onto a dead path.
    if (!NicHealth::instance().usable(healthId) || NicHealth::instance().blackholed(healthId))
      continue;
    slot.state = SlotState::kDialing;
    std::weak_ptr<SendConnection> weak = shared_from_this();
    int index = static_cast<int>(i);
    dialer_->dial(index, slot.nics,
                  [weak, index](std::shared_ptr<Path> path, const PathFailure& failure) {
                    if (auto self = weak.lock()) {
                      self->onDialed(index, std::move(path), failure);
                    } else if (path) {
                      path->shutdown();
                    }
                  });
  }
}

bool SendConnection::roleQuietLocked() const {
  if (awaitingResync_ || switchPending_ || !cancels_.empty()) return false;
  // A better path up than the active one: a failback is due.
  for (int i = 0; i < active_; ++i) {
    if (slots_[i].state == SlotState::kUp) return !env_.config.failback;
  }
  return true;
}

bool SendConnection::spreadWantedLocked() const {
  const SlotState primary = slots_.at(0).state;
  return env_.config.spread && primary != SlotState::kUp && primary != SlotState::kDialing;
}

double SendConnection::laneFactorLocked(int slot) const {
  const int nic = slots_.at(slot).nics.localNic;
  const int home = slots_.at(0).nics.localNic;
  double factor = NicHealth::instance().weight(env_.localHealthIds.at(nic));
  if (home < static_cast<int>(env_.nicDistances.size()) &&
      nic < static_cast<int>(env_.nicDistances[home].size())) {
    factor *= spreadDistanceFactor(env_.nicDistances[home][nic]);
  }
  return factor;
}

std::vector<int> SendConnection::chooseLanesLocked(int active) const {
  std::vector<int> lanes{active};
  if (!spreadWantedLocked()) return lanes;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& slot = slots_[i];
    if (slot.state != SlotState::kUp) continue;
    if (NicHealth::instance().blackholed(env_.localHealthIds.at(slot.nics.localNic))) continue;
    bool distinct = true;  // one lane per NIC at either end
    for (int lane : lanes) {
      distinct = distinct && slots_[lane].nics.localNic != slot.nics.localNic &&
                 slots_[lane].nics.remoteNic != slot.nics.remoteNic;
    }
    if (distinct) lanes.push_back(static_cast<int>(i));
  }
  return lanes;
}

void SendConnection::startLanesLocked(const std::vector<int>& lanes) {
  std::vector<double> factors;
  for (int lane : lanes) factors.push_back(laneFactorLocked(lane));
  lanes_.reset(lanes, factors);
  lanesChangedLocked();
}

void SendConnection::growLanesLocked() {
  if (active_ < 0 || awaitingResync_) return;
  bool grown = false;
  for (int lane : chooseLanesLocked(active_)) {
    bool clash = false;  // a NIC an existing lane already uses
    for (int existing : lanes_.slots()) {
      clash = clash || existing == lane ||
              slots_[existing].nics.localNic == slots_[lane].nics.localNic ||
              slots_[existing].nics.remoteNic == slots_[lane].nics.remoteNic;
    }
    if (clash) continue;
    // Safe within the epoch: every chunk is still posted once per epoch, and
    // the receiver takes the epoch's chunks from any of its paths.
    lanes_.add(lane, laneFactorLocked(lane));
    grown = true;
  }
  if (grown) lanesChangedLocked();
}

void SendConnection::lanesChangedLocked() {
  const bool spreading = lanes_.slots().size() > 1;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const bool lane = lanes_.has(static_cast<int>(i));
    if (slots_[i].path) slots_[i].path->limitDataStreams(spreading && lane ? 1 : 0);
  }
  std::vector<std::string> nics;
  if (lanes_.slots().size() > 1) {
    for (int lane : lanes_.slots())
      nics.push_back(env_.localNicNames.at(slots_[lane].nics.localNic));
  }
  SpreadTable::instance().set(id_, env_.peerName, std::move(nics));
}

std::shared_ptr<Path> SendConnection::maybeActivateLocked(
    std::vector<std::vector<uint8_t>>* frames, std::vector<std::shared_ptr<Path>>* drainFirst) {
  int best = -1;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state == SlotState::kUp) {
      best = static_cast<int>(i);
      break;
    }
  }
  if (best < 0) return nullptr;
  if (!everActive_ && active_ < 0) {
    // First activation: give a primary still dialing its chance, so a healthy
    // connection starts on it rather than failing back to it moments later.
    for (int i = 0; i < best; ++i) {
      if (slots_[i].state == SlotState::kDialing) return nullptr;
    }
  }
  bool failback = false;
  if (active_ >= 0) {
    // Return to a better path only between resyncs and when allowed.
    if (awaitingResync_ || !env_.config.failback || best >= active_) return nullptr;
    failback = true;
    switchPending_ = true;
    switchIsFailback_ = true;
    switchFrom_ = active_;
    switchReason_ = Reason::kHealed;
    switchStartNs_ = nowNs();
  }
  if (!failback && switchPending_) switchIsFailback_ = false;
  // The old epoch's paths that stay up (a failback's old path, the lanes a
  // spreading connection keeps): a write one placed directly could still
  // land after the receive completed over another, so service() drains them
  // before the ACTIVATE; what they still queue is stale either way.
  for (int lane : lanes_.slots()) {
    if (slots_.at(lane).state != SlotState::kUp) continue;
    slots_[lane].path->dropQueuedData();
    drainFirst->push_back(slots_[lane].path);
  }
  ++epoch_;
  active_ = best;
  awaitingResync_ = true;
  resyncDeadline_ = Clock::now() + Millis(env_.config.heartbeatMs);
  for (auto& [seq, send] : sends_) send.posted = false;
  startLanesLocked(chooseLanesLocked(best));
  frames->clear();
  for (const auto& [lane, reason] : lostLanes_) {
    frames->push_back(encodeNotify(static_cast<uint8_t>(lane), static_cast<uint8_t>(reason)));
  }
  lostLanes_.clear();
  frames->push_back(
      encodeActivate(epoch_, static_cast<uint8_t>(best),
                     static_cast<uint8_t>(switchPending_ ? switchReason_ : Reason::kNone)));
  return slots_.at(best).path;
}

void SendConnection::service() {
  std::shared_ptr<Path> activateOn;
  std::vector<std::shared_ptr<Path>> drainFirst;
  std::vector<std::vector<uint8_t>> activateFrames;
  std::shared_ptr<Path> cancelOn;
  std::vector<std::pair<uint64_t, uint64_t>> cancels;
  {
    Lock lock(mutex_);
    reapLocked();
    if (closed_ || !error_.empty()) {
      lock.unlock();
      destroyRetired();
      return;
    }
    if (peerClosed_) {
      // After the receiver's CLOSE nothing is re-dialed (its listener is gone)
      // and nothing activated. A send still pending can only get an ACK that
      // was already in flight: once the paths are gone it fails, and if a
      // path lingers, after RECCL_NO_PATH_TIMEOUT_MS at the latest.
      checkActiveSlotLocked();
      if (active_ < 0) failPendingLocked(kReceiverClosed);
      checkStalledLocked(active_ >= 0 && !sends_.empty(),
                         "the receiver closed the connection but its paths stayed up");
      lock.unlock();
      destroyRetired();
      return;
    }
    if (awaitingResync_ && Clock::now() > resyncDeadline_) {
      failPathLocked(active_, Reason::kTimeout, "no RESYNC answer to ACTIVATE");
      reapLocked();
    }
    checkActiveSlotLocked();
    dialLocked();
    activateOn = maybeActivateLocked(&activateFrames, &drainFirst);
    growLanesLocked();
    if (!cancels_.empty() && active_ >= 0 && !awaitingResync_) {
      cancelOn = slots_.at(active_).path;
      cancels.swap(cancels_);
    }
    checkStalledLocked(active_ < 0 || awaitingResync_,
                       everActive_ ? "no usable path" : "could not connect");
  }
  if (!drainFirst.empty()) {
    // Bounded: a path whose writes do not complete in half a heartbeat is
    // failed (its QP to ERR here) and the ACTIVATE no longer says "healed",
    // so the receiver fences it too before it reports what it has. The paths
    // drain one after another, each bounded: they were all told to stop at once.
    std::vector<std::shared_ptr<Path>> stuck;
    for (const auto& path : drainFirst) {
      if (!path->drainDirectWrites(Millis(std::max(1, env_.config.heartbeatMs / 2)))) {
        stuck.push_back(path);
      }
    }
    Lock lock(mutex_);
    if (!stuck.empty()) {
      for (size_t i = 0; i < slots_.size(); ++i) {
        if (std::find(stuck.begin(), stuck.end(), slots_[i].path) != stuck.end()) {
          failPathLocked(static_cast<int>(i), Reason::kTimeout,
                         "direct writes did not complete before the switch");
        }
      }
      std::vector<uint8_t>& activate = activateFrames.back();
      ActivateBody body{};
      std::memcpy(&body, activate.data() + sizeof(FrameHeader), sizeof(body));
      activate = encodeActivate(body.epoch, body.pathIndex, static_cast<uint8_t>(Reason::kTimeout));
    }
    // The RESYNC is due a heartbeat after the ACTIVATE leaves, not after the drain began.
    if (awaitingResync_) resyncDeadline_ = Clock::now() + Millis(env_.config.heartbeatMs);
    lock.unlock();
    // A stuck path may still be reading a send's buffer (a TCP frame half
    // written); once the new path completes that send its caller owns the
    // buffer again, so the path's I/O ends before the ACTIVATE goes out.
    for (const auto& path : stuck) path->stopAndJoin();
    drainFirst.clear();
  }
  if (activateOn) {
    bool sent = true;
    for (const auto& frame : activateFrames) sent = sent && activateOn->sendControl(frame);
    if (!sent) RECCL_LOG(kInfo, "ACTIVATE could not be sent; the path is failing");
  }
  activateOn.reset();
  for (const auto& [seq, bytes] : cancels) cancelOn->sendControl(encodeCancel(seq, bytes));
  cancelOn.reset();
  destroyRetired();
}

}  // namespace reccl
