#include "core/recv_connection.h"

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"

namespace reccl {

RecvConnection::RecvConnection(ConnectionEnv env, uint64_t id,
                               std::vector<PathCandidate> candidates, uint64_t chunkBytes)
    : Connection(std::move(env), id, std::move(candidates)),
      chunkBytes_(chunkBytes),
      pieces_(chunkBytes),
      // A failback's old path, or a spreading sender's other lanes, are healthy
      // and finish the chunk they are in: within 50 ms plus a chunk's time at
      // 10 MB/s (a socket's share of a 1 Gbit NIC several paths load at once).
      fenceGrace_(Millis(50) + Millis(chunkBytes / 10000)) {}

RecvConnection::~RecvConnection() {
  destroyAllPaths();
  // Every path is joined: no copy runs any more.
  for (auto& [seq, ending] : ending_) ending.end();
}

std::shared_ptr<Request> RecvConnection::irecv(uint8_t* data, uint64_t capacity,
                                               const MemoryRegistration* registration) {
  std::shared_ptr<Path> path;
  std::shared_ptr<Request> request;
  std::vector<uint8_t> place;
  uint64_t seq = 0;
  if (registration != nullptr) {
    registration->requireUsable(env_.registrar, data, capacity, "receive buffer");
  }
  {
    Lock lock(mutex_);
    admitLocked("receive", recvs_.size(), "receives posted");
    seq = nextSeq_++;
    request = std::make_shared<Request>(seq, data, capacity);
    PostedRecv& recv = recvs_[seq];
    recv.request = request;
    if (registration != nullptr && capacity > 0) {
      Placement placement = registration->placementFor(reinterpret_cast<uint64_t>(data), capacity);
      recv.place = encodePlace(seq, placement.hostAccessible, placement.bytes);
      recv.hostAccessible = placement.hostAccessible;
    }
    place = recv.place;
    path = activePathLocked();
  }
  // Without an active path the CTS (and PLACE) travel with the next RESYNC.
  // PLACE first, on the same path: the sender knows it before it may send.
  if (path && !place.empty()) path->sendControl(place);
  if (path) path->sendControl(encodeCts(seq, capacity));
  return request;
}

bool RecvConnection::attachPath(int index, PathCandidate nics, std::shared_ptr<Path> path) {
  Lock lock(mutex_);
  if (closed_ || !error_.empty() || index < 0 || index >= static_cast<int>(slots_.size())) {
    return false;
  }
  uint64_t pathId = installPathLocked(index, path, nics);
  // A new dial of this slot means the sender has left the path it replaces: a
  // notice of that path's loss, still queued, would fail the new one instead
  // (the sender reads a notice by slot).
  notifyQueue_.erase(std::remove_if(notifyQueue_.begin(), notifyQueue_.end(),
                                    [index](const auto& notice) { return notice.first == index; }),
                     notifyQueue_.end());
  try {
    path->start(this, pathId);
  } catch (const Error& e) {
    failPathLocked(index, Reason::kError, e.what());
  }
  return true;
}

uint64_t RecvConnection::resumeOffsetLocked(const PostedRecv& recv) const {
  size_t prefix = 0;
  while (prefix < recv.landed.size() &&
         recv.landed[prefix] == pieces_.fullMask(prefix * chunkBytes_, recv.messageBytes)) {
    ++prefix;
  }
  uint64_t offset = prefix * chunkBytes_;
  if (recv.messageBytes >= 0) offset = std::min<uint64_t>(offset, recv.messageBytes);
  return offset;
}

void RecvConnection::ResyncAnswer::send() const {
  if (!path) return;
  for (const auto& frame : frames) path->sendControl(frame);
}

void RecvConnection::activateLocked(int index, const ActivateBody& body) {
  epoch_ = body.epoch;
  const int previous = active_;
  active_ = index;
  dataSlots_ = 0;
  // A failover means the sender has already dropped the old path: stop it now,
  // so a copy stuck on its dead socket ends at once instead of at the fence's
  // deadline (50 ms per failover, measured). A failback leaves it healthy.
  if (previous >= 0 && previous != index && static_cast<Reason>(body.reason) != Reason::kHealed) {
    failPathLocked(previous, Reason::kPeer, "the sender failed over away from it");
  }
  // A newer ACTIVATE replaces one still waiting: the sender ignores answers to
  // older epochs, and this fence covers their copies too.
  const Clock::time_point now = Clock::now();
  PendingResync pending;
  pending.index = index;
  pending.body = body;
  pending.previous = previous;
  pending.cutAt = now + fenceGrace_;
  pending.giveUpAt = pending.cutAt + Millis(env_.config.heartbeatMs);
  pendingResync_ = pending;
}

bool RecvConnection::olderEpochCopyingLocked() const {
  // Ordered by epoch: the first entry is the oldest copy in progress.
  return !copying_.empty() && copying_.begin()->first.first < epoch_;
}

RecvConnection::ResyncAnswer RecvConnection::answerIfFencedLocked() {
  if (!pendingResync_) return {};
  if (closed_ || !error_.empty()) {
    pendingResync_.reset();
    return {};
  }
  if (olderEpochCopyingLocked()) {
    const Clock::time_point now = Clock::now();
    if (!pendingResync_->cut && now >= pendingResync_->cutAt) {
      pendingResync_->cut = true;
      // A copy that does not end (stuck on a dead socket, or a healthy path
      // that stopped sending mid-chunk) is cut short by stopping its path.
      std::vector<int> straggling;
      for (const auto& [key, copies] : copying_) {
        int slot = slotOf(key.second);
        if (key.first < epoch_ && slot >= 0) straggling.push_back(slot);
      }
      // May be the activating path itself (its copies of an older epoch):
      // losing it drops the pending answer, and the sender activates anew.
      for (int slot : straggling) failPathLocked(slot, Reason::kError, "fenced during resync");
      if (!pendingResync_) return {};
    }
    if (now < pendingResync_->giveUpAt) {
      env_.supervisor->wakeBy(pendingResync_->cut ? pendingResync_->giveUpAt
                                                  : pendingResync_->cutAt);
      return {};
    }
    RECCL_LOG(kWarn, "resync fence: copies of the old epoch still running; answering anyway");
  }
  // Writes a stopped path accepted just before it stopped may still be on
  // their way to memory (Path::quietAfter): report what arrived only after.
  if (Clock::now() < quietAfter_) {
    env_.supervisor->wakeBy(quietAfter_);
    return {};
  }
  const PendingResync pending = *pendingResync_;
  pendingResync_.reset();
  const int index = pending.index;
  ResyncAnswer answer;
  answer.path = slots_.at(index).path;
  std::vector<ResyncEntry> entries;
  for (const auto& [seq, recv] : recvs_) {
    entries.push_back({seq, recv.request->capacity(), resumeOffsetLocked(recv)});
    // Re-sent before the RESYNC that posts them: the first may have died with a path.
    if (!recv.place.empty()) answer.frames.push_back(recv.place);
  }
  answer.frames.push_back(encodeResync(pending.body.epoch, nextSeq_, entries));
  // Name the root cause (a link event, a drill, silence) whichever side saw it:
  // a socket error or a peer notice is only its echo on the other side.
  auto rootCause = [](Reason r) {
    return r == Reason::kLinkDown || r == Reason::kInjected || r == Reason::kTimeout;
  };
  const Reason carried = static_cast<Reason>(pending.body.reason);
  const bool lostFirst = lostActiveFrom_ >= 0 && carried != Reason::kHealed;
  Reason reason = carried;
  if (lostFirst && (rootCause(lostActiveReason_) || !rootCause(carried)))
    reason = lostActiveReason_;
  const int previous = pending.previous;
  const bool isSwitch = previous != index && (previous >= 0 || lostActiveFrom_ >= 0);
  const int from = previous >= 0 ? previous : lostActiveFrom_;
  const int64_t duration = lostActiveNs_ > 0 ? nowNs() - lostActiveNs_ : -1;
  lostActiveFrom_ = -1;
  lostActiveNs_ = 0;
  if (isSwitch) {
    emitSwitchEvent(reason == Reason::kHealed ? EventKind::kFailback : EventKind::kFailover, from,
                    index, reason, duration, -1,
                    "receiver: " + slotName(from) + " => " + slotName(index));
  }
  return answer;
}

void RecvConnection::onRoleControlLocked(uint64_t pathId, const ControlFrame& frame, Lock& lock) {
  int index = slotOf(pathId);
  switch (frame.type) {
    case FrameType::kActivate: {
      if (index < 0 || frame.activate.epoch <= epoch_) return;
      activateLocked(index, frame.activate);
      // Usually no copy of the old epoch is in progress and this answers at once.
      ResyncAnswer answer = answerIfFencedLocked();
      if (!answer.path) return;
      lock.unlock();
      answer.send();
      lock.lock();
      return;
    }
    case FrameType::kCancel: {
      auto it = recvs_.find(frame.cancel.seq);
      if (it == recvs_.end()) return;
      const uint64_t capacity = it->second.request->capacity();
      failRecvLocked(
          it,
          "the sender's message of " + std::to_string(frame.cancel.bytes) + " bytes " +
              (frame.cancel.bytes > capacity
                   ? "is larger than this posted receive of " + std::to_string(capacity) + " bytes"
                   : std::string("cannot be carried: device memory (dma-buf) at one end travels "
                                 "only by direct placement, which needs both buffers registered")));
      return;
    }
    default:
      throw ProtocolError(std::string("unexpected ") + frameTypeName(frame.type) +
                          " frame at the receiving end");
  }
}

uint8_t* RecvConnection::beginData(uint64_t pathId, const DataHeader& header, bool placed) {
  Lock lock(mutex_);
  // Any path of the connection may carry the epoch's chunks (a spreading
  // sender uses several); chunks of an older epoch are stale.
  int index = slotOf(pathId);
  if (index < 0 || active_ < 0 || header.epoch != epoch_) return nullptr;
  if (header.seq >= nextSeq_) {
    throw ProtocolError("DATA for message " + std::to_string(header.seq) +
                        ", for which no receive was posted");
  }
  auto it = recvs_.find(header.seq);
  if (it == recvs_.end()) return nullptr;  // already complete
  PostedRecv& recv = it->second;
  const uint64_t capacity = recv.request->capacity();
  if (header.messageBytes > capacity) {
    failRecvLocked(it, "message of " + std::to_string(header.messageBytes) +
                           " bytes is larger than the posted receive of " +
                           std::to_string(capacity) + " bytes");
    return nullptr;
  }
  if (recv.messageBytes >= 0 && static_cast<uint64_t>(recv.messageBytes) != header.messageBytes) {
    throw ProtocolError("DATA for message " + std::to_string(header.seq) + " says " +
                        std::to_string(header.messageBytes) + " bytes; earlier chunks said " +
                        std::to_string(recv.messageBytes));
  }
  if (!pieces_.valid(header.offset, header.bytes, header.messageBytes)) {
    throw ProtocolError("DATA chunk [" + std::to_string(header.offset) + ", +" +
                        std::to_string(header.bytes) + ") is not a chunk of a " +
                        std::to_string(header.messageBytes) + "-byte message in " +
                        std::to_string(chunkBytes_) + "-byte chunks, nor a piece of one in " +
                        std::to_string(pieces_.unit()) + "-byte units");
  }
  if (recv.messageBytes < 0) {
    recv.messageBytes = static_cast<int64_t>(header.messageBytes);
    size_t chunks =
        header.messageBytes == 0 ? 1 : (header.messageBytes + chunkBytes_ - 1) / chunkBytes_;
    recv.landed.assign(chunks, 0);
  }
  if (placed && recv.place.empty()) {
    throw ProtocolError("a directly placed chunk of message " + std::to_string(header.seq) +
                        ", whose receive was not registered");
  }
  if (!placed && !recv.hostAccessible) {
    throw ProtocolError("a staged chunk of message " + std::to_string(header.seq) +
                        ", whose receive buffer is device memory (direct placement only)");
  }
  const uint64_t piece = pieces_.maskOf(header.offset, header.bytes);
  if ((recv.landed[header.offset / chunkBytes_] & piece) == piece) return nullptr;  // a duplicate
  ++copying_[{header.epoch, pathId}];
  ++recv.copies;
  if (index < 64) dataSlots_ |= uint64_t{1} << index;
  if (placed) placedNics_ |= uint64_t{1} << slots_.at(index).nics.localNic;
  return recv.request->data() + header.offset;
}

uint64_t RecvConnection::takePlacedNics() {
  Lock lock(mutex_);
  return std::exchange(placedNics_, 0);
}

void RecvConnection::endData(uint64_t pathId, const DataHeader& header, bool landed) {
  std::shared_ptr<Path> ackPath;
  uint64_t ackBytes = 0;
  ResyncAnswer answer;
  {
    Lock lock(mutex_);
    auto copies = copying_.find({header.epoch, pathId});
    if (copies != copying_.end() && --copies->second == 0) copying_.erase(copies);
    if (auto recv = recvs_.find(header.seq); recv != recvs_.end() && recv->second.copies > 0) {
      --recv->second.copies;
    } else if (auto ending = ending_.find(header.seq); ending != ending_.end()) {
      if (--ending->second.copies == 0) {
        ending->second.end();
        ending_.erase(ending);
      }
    }
    if (landed) ackPath = landLocked(pathId, header, &ackBytes);
    // The last copy of an older epoch releases a pending RESYNC, built after
    // this chunk was counted, so it reports the chunk as landed.
    answer = answerIfFencedLocked();
  }
  if (ackPath) ackPath->sendControl(encodeAck(header.seq, ackBytes));
  answer.send();
}

std::shared_ptr<Path> RecvConnection::landLocked(uint64_t pathId, const DataHeader& header,
                                                 uint64_t* ackBytes) {
  auto it = recvs_.find(header.seq);
  if (it == recvs_.end()) return nullptr;
  PostedRecv& recv = it->second;
  size_t chunk = header.offset / chunkBytes_;
  if (chunk >= recv.landed.size()) return nullptr;
  const uint64_t full = pieces_.fullMask(header.offset, header.messageBytes);
  uint64_t& landed = recv.landed[chunk];
  const uint64_t piece = pieces_.maskOf(header.offset, header.bytes);
  if ((landed & piece) == piece) return nullptr;
  // A piece resent with other boundaries (a new epoch, other lanes) may overlap
  // units that landed: the same bytes, written again.
  landed |= piece;
  if (landed == full) ++recv.landedCount;
  int index = slotOf(pathId);  // -1 if the path was retired meanwhile
  if (index >= 0) {
    NicHealth::instance()
        .counters(env_.localHealthIds.at(slots_[index].nics.localNic))
        .bytesReceived.fetch_add(header.bytes);
  }
  if (recv.landedCount < recv.landed.size()) return nullptr;
  *ackBytes = static_cast<uint64_t>(recv.messageBytes);
  if (recv.copies == 0) {
    recv.request->complete(*ackBytes);
  } else {
    ending_[it->first] = EndingRecv{recv.request, recv.copies, "", *ackBytes};
  }
  recvs_.erase(it);
  return activePathLocked();
}

void RecvConnection::onActiveLostLocked(int index, Reason reason) {
  // The path an ACTIVATE came on is gone before its answer: nobody to answer
  // (the sender activates another path, with a newer epoch).
  pendingResync_.reset();
  lostActiveNs_ = nowNs();
  lostActiveFrom_ = index;
  lostActiveReason_ = reason;
  notifyQueue_.push_back({index, reason});
}

void RecvConnection::onOtherLostLocked(int index, Reason reason) {
  // A lane of a spreading sender: it replays the lane's chunks on the others
  // once it knows, and may not see the loss itself for a heartbeat.
  if (index < 64 && (dataSlots_ >> index & 1) != 0) notifyQueue_.push_back({index, reason});
}

std::map<uint64_t, RecvConnection::PostedRecv>::iterator RecvConnection::failRecvLocked(
    std::map<uint64_t, PostedRecv>::iterator it, const std::string& why) {
  if (it->second.copies == 0) {
    it->second.request->fail(why);
  } else {
    ending_[it->first] = EndingRecv{it->second.request, it->second.copies, why, 0};
  }
  return recvs_.erase(it);
}

void RecvConnection::failPendingLocked(const std::string& why) {
  for (auto it = recvs_.begin(); it != recvs_.end();) it = failRecvLocked(it, why);
  pendingResync_.reset();
}

void RecvConnection::service() {
  std::vector<std::pair<std::shared_ptr<Path>, std::vector<uint8_t>>> notices;
  ResyncAnswer answer;
  {
    Lock lock(mutex_);
    reapLocked();
    if (closed_ || !error_.empty()) {
      lock.unlock();
      destroyRetired();
      return;
    }
    // The fence's deadlines: the supervisor comes back when one is due.
    answer = answerIfFencedLocked();
    // Tell the sender about a lost active path over any path still up, so it
    // fails over now rather than at its own timeout.
    if (!notifyQueue_.empty()) {
      for (const auto& slot : slots_) {
        if (slot.state != SlotState::kUp) continue;
        for (const auto& [index, reason] : notifyQueue_) {
          notices.push_back(
              {slot.path, encodeNotify(static_cast<uint8_t>(index), static_cast<uint8_t>(reason))});
        }
        break;
      }
      notifyQueue_.clear();
    }
    checkActiveSlotLocked();
    if (peerClosed_ && active_ < 0) failPendingLocked("the sender closed the connection");
    checkStalledLocked(active_ < 0 && !peerClosed_, "no usable path");
  }
  answer.send();
  answer = {};
  for (auto& [path, frame] : notices) path->sendControl(frame);
  notices.clear();
  destroyRetired();
}

}  // namespace reccl
