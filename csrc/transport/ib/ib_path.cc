#include "transport/ib/ib_path.h"

#include <sys/epoll.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"
#include "transport/ib/ib_registration.h"

namespace reccl {

namespace {

// A FIFO entry: the grant's sequence number + 1 (so a zeroed entry is never a
// grant) above the 16-bit slot index. One aligned 8-byte word, so the sender
// never sees half of an entry.
uint64_t fifoEntry(uint64_t grant, uint32_t slot) { return ((grant + 1) << 16) | slot; }

// Rounds of polling and pumping one path does per loop turn before it lets the
// loop's other registrations go first (a busy stream would otherwise keep the
// CQs non-empty forever); the rest follows at the next turn.
constexpr int kRoundsPerTurn = 8;

// A path waiting for the peer's credits polls its credit word this often
// (the peer's write raises no completion here) while the work waits.
constexpr Millis kCreditRecheck(1);

}  // namespace

// The loop holds this, not the path: the path unregisters (stopAndJoin)
// before it goes.
class IbPath::ChannelIo : public IoHandler {
 public:
  explicit ChannelIo(IbPath* path) : path_(path) {}
  void onIo(uint32_t) override { path_->onIo(); }
  void onDeadline() override { path_->onDeadline(); }

 private:
  IbPath* const path_;
};

IbPath::IbPath(std::unique_ptr<IbEndpoint> endpoint, const QpExchange& peer, int localNic,
               int remoteNic, int healthId, std::string peerName,
               std::shared_ptr<NicPairLiveness> pair, const Config& config)
    : endpoint_(std::move(endpoint)),
      sender_(endpoint_->role() == IbEndpoint::Role::kSender),
      peerRegion_(peer.regionAddress),
      peerRkey_(peer.rkey),
      peerSlotCount_(peer.slotCount),
      peerSlotBytes_(peer.slotBytes),
      localNic_(localNic),
      remoteNic_(remoteNic),
      healthId_(healthId),
      peerName_(std::move(peerName)),
      pair_(std::move(pair)),
      heartbeat_(config.heartbeatMs),
      beatInterval_(std::max<int64_t>(5, config.heartbeatMs / 4)),
      ioThreadsPerNic_(EventLoops::perNic(config.ioThreads)),
      ibTimeout_(config.ibTimeout),
      fenceDelay_(config.ibFenceDelayMs),
      busyPollNs_(static_cast<int64_t>(config.ibBusyPollUs) * 1000),
      ibRetryCount_(config.ibRetryCount) {
  for (uint32_t i = 0; i < IbEndpoint::kControlSends; ++i) freeControl_.push_back(i);
  if (sender_) {
    for (uint32_t i = 0; i < IbEndpoint::kDataSlots; ++i) freeStaging_.push_back(i);
  }
}

IbPath::~IbPath() { stopAndJoin(); }

void IbPath::stopAndJoin() {
  shutdown();
  std::lock_guard<std::mutex> lock(joinMutex_);
  if (joined_) return;
  // Waits for a callback running now: after this nothing of the loop touches
  // the QP, the CQs or the channel, which the endpoint destroys with the path.
  if (loop_ != nullptr) {
    loop_->remove(loopId_);
    EventLoops::instance().release(healthId_);
  }
  joined_ = true;
}

void IbPath::start(PathOwner* owner, uint64_t pathId) {
  owner_ = owner;
  pathId_ = pathId;
  pair_->heard(nowNs());
  nextBeat_ = Clock::now();  // the first turn beats at once, later ones on the beat grid
  try {
    // Armed before the loop polls them: a completion from now on raises an
    // event, and the first turn (below) polls whatever came before.
    endpoint_->sendCq().requestNotify();
    endpoint_->recvCq().requestNotify();
    armed_ = true;
    // Set at once, so stopAndJoin releases the pick even if add() throws;
    // registered unpolled: the callbacks use loopId_ too.
    loop_ = &EventLoops::instance().pick(healthId_, ioThreadsPerNic_);
    loop_->add(endpoint_->channel().fd(), 0, std::make_shared<ChannelIo>(this), loopId_);
  } catch (const Error& e) {
    shutdown();
    throw Error("could not start the path to " + peerName_ + ": " + e.what());
  }
  loop_->setEvents(loopId_, EPOLLIN);
  // The first turn: the receiver's grants, the first heartbeat, the timers.
  loop_->setDeadline(loopId_, Clock::now());
}

Clock::time_point IbPath::quietAfter() const {
  const int64_t stopped = stoppedAtNs_.load();
  return stopped == 0 ? Clock::time_point{} : atNs(stopped) + fenceDelay_;
}

void IbPath::shutdown() {
  if (stop_.exchange(true)) return;
  // The fence: from here on no request of this QP executes, so nothing of
  // this path lands after the connection has moved on; the rest is flushed.
  try {
    endpoint_->qp().toError();
  } catch (const Error& error) {
    RECCL_LOG(kWarn, std::string("moving a QP to the error state: ") + error.what());
  }
  stoppedAtNs_.store(nowNs());
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    queue_.clear();
  }
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    backlog_.clear();
  }
  sendSlotFreed_.notify_all();
}

void IbPath::fail(Reason reason, const std::string& detail) {
  // A path we stopped on purpose has not failed; report a real failure once.
  if (stop_.load() || owner_ == nullptr || failed_.exchange(true)) return;
  owner_->onPathFailed(pathId_, reason, PathFailure{detail});
}

std::string IbPath::describeCompletionError(const WorkCompletion& wc) const {
  std::string what = std::string(wcStatusName(wc.status)) + " on the QP to " + peerName_;
  if (wc.status == WcStatus::kRetryExceeded) {
    what += " (no answer within 4.096 us * 2^" + std::to_string(ibTimeout_) + " * " +
            std::to_string(ibRetryCount_ + 1) + " tries: RECCL_IB_TIMEOUT, RECCL_IB_RETRY_CNT)";
  }
  if (wc.vendorError != 0) what += ", vendor error " + std::to_string(wc.vendorError);
  return what;
}

bool IbPath::postLocked(const SendRequest& request) {
  std::string error;
  if (endpoint_->qp().postSend(request, &error)) return true;
  if (sendFailure_.empty()) {
    sendFailure_ = "ibv_post_send to " + peerName_ + ": " + error;
    sendFailureReason_ = Reason::kError;
  }
  return false;
}

int IbPath::drainSendsLocked() {
  WorkCompletion wcs[32];
  int total = 0;
  for (;;) {
    int got;
    try {
      got = endpoint_->sendCq().poll(wcs, 32);
    } catch (const Error& error) {
      // An unusable CQ fails the path like an error completion would.
      if (sendFailure_.empty()) {
        sendFailure_ = "send queue to " + peerName_ + ": " + error.what();
        sendFailureReason_ = Reason::kError;
      }
      break;
    }
    for (int i = 0; i < got; ++i) {
      const WorkCompletion& wc = wcs[i];
      switch (workKind(wc.wrId)) {
        case WorkKind::kControlSend: freeControl_.push_back(workIndex(wc.wrId)); break;
        case WorkKind::kData: freeStaging_.push_back(workIndex(wc.wrId)); break;
        case WorkKind::kPlacedNotice:
          // RC: the notice completes after the write before it, so that write
          // has landed (or, flushed, never will).
          freeControl_.push_back(workIndex(wc.wrId));
          placedInFlight_.fetch_sub(1);
          break;
        case WorkKind::kCredit: creditWriteInFlight_ = false; break;
        default: break;
      }
      bool expected =
          wc.status == WcStatus::kSuccess || (wc.status == WcStatus::kFlushed && stop_.load());
      if (!expected && sendFailure_.empty()) {
        sendFailure_ = describeCompletionError(wc);
        sendFailureReason_ =
            wc.status == WcStatus::kRetryExceeded ? Reason::kTimeout : Reason::kError;
      }
    }
    total += got;
    if (got < 32) break;
  }
  if (total > 0) {
    writeCreditsLocked();  // what was reposted while the last write was in flight
    sendSlotFreed_.notify_all();
  }
  return total;
}

bool IbPath::takeCreditLocked() {
  const uint64_t peerReceives =
      IbEndpoint::kControlRecvs + __atomic_load_n(endpoint_->creditWord(), __ATOMIC_ACQUIRE);
  if (consumingSent_ < peerReceives) {
    ++consumingSent_;
    return true;
  }
  // The peer has not reposted yet; its credit write raises nothing here.
  if (loop_ != nullptr) loop_->setDeadline(loopId_, Clock::now() + kCreditRecheck, true);
  return false;
}

void IbPath::writeCreditsLocked() {
  const uint64_t reposted = reposted_.load();
  if (creditWriteInFlight_ || reposted == repostedWritten_ || stop_.load() || !sendFailure_.empty())
    return;
  *endpoint_->creditSource() = reposted;
  SendRequest write;
  write.wrId = workId(WorkKind::kCredit, 0);
  write.op = SendRequest::Op::kWrite;  // consumes no receive: needs no credit itself
  write.sge = {reinterpret_cast<uint64_t>(endpoint_->creditSource()), sizeof(uint64_t),
               endpoint_->localKey()};
  write.remoteAddress = peerRegion_ + static_cast<uint64_t>(peerSlotCount_) * peerSlotBytes_;
  write.rkey = peerRkey_;
  if (postLocked(write)) {
    creditWriteInFlight_ = true;
    repostedWritten_ = reposted;
  }
}

void IbPath::reportSendFailure() {
  std::string failure;
  Reason reason;
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    failure = sendFailure_;
    reason = sendFailureReason_;
  }
  if (!failure.empty()) fail(reason, failure);
}

bool IbPath::sendControl(const std::vector<uint8_t>& frame) {
  if (stop_.load() || owner_ == nullptr) return false;
  return sendControlFrom(frame.data(), frame.size(), true);
}

bool IbPath::postControlLocked(const uint8_t* bytes, size_t length) {
  if (!takeCreditLocked()) return false;
  const uint32_t index = freeControl_.back();
  freeControl_.pop_back();
  std::memcpy(endpoint_->controlSend(index), bytes, length);
  SendRequest request;
  request.wrId = workId(WorkKind::kControlSend, index);
  request.op = SendRequest::Op::kSend;
  request.sge = {reinterpret_cast<uint64_t>(endpoint_->controlSend(index)),
                 static_cast<uint32_t>(length), endpoint_->localKey()};
  if (postLocked(request)) {
    pair_->sent(nowNs());  // any frame the peer receives proves us alive on the pair
    return true;
  }
  freeControl_.push_back(index);
  return false;  // the path fails: the credit taken is moot
}

bool IbPath::flushBacklogLocked() {
  bool posted = false;
  while (!backlog_.empty() && !freeControl_.empty() && !stop_.load() && sendFailure_.empty()) {
    const std::vector<uint8_t>& frame = backlog_.front();
    if (!postControlLocked(frame.data(), frame.size())) break;
    backlog_.pop_front();
    backlogProgressNs_ = nowNs();
    posted = true;
  }
  return posted;
}

bool IbPath::sendControlFrom(const uint8_t* bytes, size_t length, bool queue) {
  if (length > IbEndpoint::kControlBytes) {
    fail(Reason::kError, "control frame of " + std::to_string(length) + " bytes exceeds " +
                             std::to_string(IbEndpoint::kControlBytes));
    return false;
  }
  bool posted = false;
  int64_t backlogSince = 0;
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    if (!stop_.load() && sendFailure_.empty()) {
      if (backlog_.empty() && freeControl_.empty()) drainSendsLocked();
      if (backlog_.empty() && !freeControl_.empty()) posted = postControlLocked(bytes, length);
      if (!posted && queue && sendFailure_.empty()) {
        // Every buffer is in flight, so a send completion (an event) comes,
        // or the QP fails; or the peer owes us a credit, and the loop
        // re-checks its credit word. The loop posts the backlog then.
        if (backlog_.empty()) backlogProgressNs_ = nowNs();
        backlog_.emplace_back(bytes, bytes + length);
        backlogSince = backlogProgressNs_;
      }
    }
  }
  if (backlogSince != 0) {
    // Bounded: a backlog that does not move for a heartbeat fails the path.
    loop_->setDeadline(loopId_, atNs(backlogSince) + heartbeat_ + Millis(1), true);
    return true;
  }
  if (!posted) reportSendFailure();
  return posted;
}

void IbPath::sendData(const DataChunk& chunk) {
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    if (stop_.load()) return;
    queue_.push_back(chunk);
  }
  serviceSoon();
}

void IbPath::serviceSoon() {
  // One hand-over at a time: the flag is cleared when the loop takes it.
  if (loop_ != nullptr && !serviceDue_.exchange(true))
    loop_->setDeadline(loopId_, Clock::now(), true);
}

void IbPath::dropQueuedData() {
  std::lock_guard<std::mutex> lock(queueMutex_);
  queue_.clear();
}

bool IbPath::drainDirectWrites(Millis timeout) {
  dropQueuedData();
  const Clock::time_point deadline = Clock::now() + timeout;
  std::unique_lock<std::mutex> lock(sendMutex_);
  while (placedInFlight_.load() > 0) {
    drainSendsLocked();
    if (placedInFlight_.load() == 0) break;
    // A stopped path's QP is in ERR, but on a real fabric a write already on
    // the wire may still land: only the receiver's fence covers that.
    if (stop_.load() || Clock::now() > deadline) return false;
    sendSlotFreed_.wait_for(lock, Millis(1));
  }
  return true;
}

void IbPath::grant(uint32_t slot) {
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    pendingGrants_.push_back(slot);
    flushGrantsLocked();
  }
  reportSendFailure();
}

bool IbPath::flushGrantsLocked() {
  bool posted = false;
  while (!pendingGrants_.empty() && !stop_.load() && sendFailure_.empty() && takeCreditLocked()) {
    const uint32_t slot = pendingGrants_.front();
    pendingGrants_.pop_front();
    posted = true;
    const uint64_t grantNumber = grantsIssued_++;
    const uint32_t entry = static_cast<uint32_t>(grantNumber % peerSlotCount_);
    uint64_t* source = endpoint_->grantSource(entry);
    *source = fifoEntry(grantNumber, slot);
    SendRequest write;
    write.wrId = workId(WorkKind::kGrant, entry);
    write.op = SendRequest::Op::kWrite;
    write.signaled = false;  // the notice's completion stands for both
    write.sge = {reinterpret_cast<uint64_t>(source), sizeof(uint64_t), endpoint_->localKey()};
    write.remoteAddress = peerRegion_ + entry * sizeof(uint64_t);
    write.rkey = peerRkey_;
    // The notice: an empty SEND, so the sender gets a completion (an event)
    // for the grant; RC executes it after the write, so the entry is there.
    SendRequest notice;
    notice.wrId = workId(WorkKind::kGrant, entry);
    notice.op = SendRequest::Op::kSend;
    // Both under one lock: nothing else of this QP goes between them.
    if (postLocked(write)) postLocked(notice);
  }
  return posted;
}

void IbPath::handleControl(const uint8_t* bytes, uint32_t length) {
  FrameHeader header = parseFrameHeader(bytes, length);
  if (sizeof(FrameHeader) + header.bodyBytes != length) {
    throw ProtocolError("control message of " + std::to_string(length) +
                        " bytes whose header announces " +
                        std::to_string(sizeof(FrameHeader) + header.bodyBytes));
  }
  if (header.type == static_cast<uint8_t>(FrameType::kData)) {
    // The notice of a directly placed chunk (the header's size was checked).
    if (sender_) throw ProtocolError("a placed-data notice at the sending end");
    DataHeader data;
    std::memcpy(&data, bytes + sizeof(FrameHeader), sizeof(data));
    handlePlaced(data);
    return;
  }
  ControlFrame frame = decodeControl(header, bytes + sizeof(FrameHeader), header.bodyBytes);
  if (frame.type == FrameType::kHeartbeat) return;
  owner_->onControl(pathId_, frame);
}

void IbPath::handleData(uint32_t slot, uint32_t length) {
  if (slot >= IbEndpoint::kDataSlots) {
    throw ProtocolError("RDMA write names staging slot " + std::to_string(slot) + "; there are " +
                        std::to_string(IbEndpoint::kDataSlots));
  }
  const uint8_t* base = endpoint_->ring(slot);
  FrameHeader frameHeader = parseFrameHeader(base, sizeof(FrameHeader));
  if (frameHeader.type != static_cast<uint8_t>(FrameType::kData)) {
    throw ProtocolError(std::string(frameTypeName(static_cast<FrameType>(frameHeader.type))) +
                        " frame in a data staging slot");
  }
  DataHeader header;
  std::memcpy(&header, base + sizeof(FrameHeader), sizeof(header));
  if (header.bytes > endpoint_->chunkBytes()) {
    throw ProtocolError("DATA chunk of " + std::to_string(header.bytes) +
                        " bytes; chunks are at most " + std::to_string(endpoint_->chunkBytes()));
  }
  if (length != IbEndpoint::kDataHeadBytes + header.bytes) {
    throw ProtocolError("RDMA write of " + std::to_string(length) + " bytes carries a chunk of " +
                        std::to_string(header.bytes));
  }
  uint8_t* target = owner_->beginData(pathId_, header, false);
  if (target != nullptr) {
    std::memcpy(target, base + IbEndpoint::kDataHeadBytes, header.bytes);
    owner_->endData(pathId_, header, true);
  }
  grant(slot);  // stale or not, the slot is free again
}

void IbPath::handlePlaced(const DataHeader& header) {
  // The payload is already where beginData would point: the write before
  // this notice placed it. Nothing to copy; stale or duplicate notices
  // (nullptr) are dropped like staged chunks.
  if (owner_->beginData(pathId_, header, true) != nullptr) owner_->endData(pathId_, header, true);
}

bool IbPath::placeableHere(const DataChunk& chunk) const {
  const auto* source = dynamic_cast<const IbRegistration*>(chunk.source);
  if (source == nullptr || static_cast<size_t>(localNic_) >= source->nicCount() ||
      !source->lkey(localNic_)) {
    return false;
  }
  try {
    return IbPlacement::decode(chunk.placement->bytes).rkeyOf(remoteNic_).has_value();
  } catch (const ProtocolError&) {
    return true;  // not a missing key: pumpPlaced fails the path naming the problem
  }
}

bool IbPath::pumpPlaced(bool* failed) {
  *failed = false;
  if (placedInFlight_.load() >= static_cast<int>(IbEndpoint::kPlacedChunks)) return false;
  uint32_t notice = 0;
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    if (freeControl_.size() <= IbEndpoint::kControlReserve) drainSendsLocked();
    if (freeControl_.size() <= IbEndpoint::kControlReserve || !takeCreditLocked()) return false;
    notice = freeControl_.back();
    freeControl_.pop_back();
  }
  DataChunk chunk{};
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    if (!queue_.empty() && queue_.front().placement) {
      chunk = queue_.front();
      queue_.pop_front();
      placedInFlight_.fetch_add(1);
    }
  }
  auto giveBack = [&](bool claimed) {
    std::lock_guard<std::mutex> lock(sendMutex_);
    freeControl_.push_back(notice);
    --consumingSent_;  // the notice's credit, unused
    if (claimed) placedInFlight_.fetch_sub(1);
    sendSlotFreed_.notify_all();
  };
  if (!chunk.placement) {
    giveBack(false);
    return false;
  }
  const DataHeader& header = chunk.header;
  const auto* source = dynamic_cast<const IbRegistration*>(chunk.source);
  std::string problem;
  IbPlacement placement;
  std::optional<uint32_t> lkey;
  std::optional<uint32_t> rkey;
  try {
    placement = IbPlacement::decode(chunk.placement->bytes);
  } catch (const ProtocolError& error) {
    problem = error.what();
  }
  const uint64_t payload = reinterpret_cast<uint64_t>(chunk.payload);
  if (!problem.empty()) {
  } else if (source == nullptr) {
    problem = "the send buffer's registration is not an IB one";
  } else if (static_cast<size_t>(remoteNic_) >= placement.rkeys.size()) {
    problem = "the receiver's placement has rkeys of " + std::to_string(placement.rkeys.size()) +
              " NICs; this path reaches its NIC " + std::to_string(remoteNic_);
  } else if (static_cast<size_t>(localNic_) >= source->nicCount()) {
    problem = "the send registration covers " + std::to_string(source->nicCount()) + " NICs";
  } else if (!(lkey = source->lkey(localNic_))) {
    problem = "this path's NIC has no registration of the send buffer (" +
              source->refusal(localNic_) + ")";
  } else if (!(rkey = placement.rkeyOf(remoteNic_))) {
    problem = "the receiver's NIC " + std::to_string(remoteNic_) +
              " of this path has no registration of the receive buffer";
  } else if (header.offset > placement.capacity ||
             header.bytes > placement.capacity - header.offset) {
    problem = "chunk [" + std::to_string(header.offset) + ", +" + std::to_string(header.bytes) +
              ") exceeds the receiver's registered " + std::to_string(placement.capacity) +
              " bytes";
  } else if (header.bytes > 0 && !source->covers(payload, header.bytes)) {
    problem = "chunk outside the send registration";
  }
  if (!problem.empty()) {
    giveBack(true);
    fail(Reason::kError, "protocol error: direct placement: " + problem);
    *failed = true;
    return false;
  }
  uint8_t* head = endpoint_->controlSend(notice);
  const FrameHeader frameHeader = dataFrameHeader();
  std::memcpy(head, &frameHeader, sizeof(frameHeader));
  std::memcpy(head + sizeof(frameHeader), &header, sizeof(header));
  SendRequest write;
  write.wrId = workId(WorkKind::kPlacedWrite, notice);
  write.op = SendRequest::Op::kWrite;
  write.signaled = false;  // the notice's completion stands for both
  write.sge = {payload, header.bytes, *lkey};
  write.remoteAddress = placement.address + header.offset;
  write.rkey = *rkey;
  SendRequest notify;
  notify.wrId = workId(WorkKind::kPlacedNotice, notice);
  notify.op = SendRequest::Op::kSend;
  notify.sge = {reinterpret_cast<uint64_t>(head),
                static_cast<uint32_t>(sizeof(FrameHeader) + sizeof(DataHeader)),
                endpoint_->localKey()};
  bool posted;
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    // Both under one lock: nothing else of this QP goes between them.
    posted = (header.bytes == 0 || postLocked(write)) && postLocked(notify);
  }
  if (!posted) {
    giveBack(true);
    reportSendFailure();
    *failed = true;
    return false;
  }
  return true;
}

bool IbPath::pollReceives() {
  WorkCompletion wcs[16];
  int got;
  try {
    got = endpoint_->recvCq().poll(wcs, 16);
  } catch (const Error& error) {
    fail(Reason::kError, "receive queue from " + peerName_ + ": " + error.what());
    return true;
  }
  for (int i = 0; i < got && !stop_.load(); ++i) {
    const WorkCompletion& wc = wcs[i];
    if (wc.status != WcStatus::kSuccess) {
      // A flushed receive is only the echo of the QP entering ERR; the cause
      // (retry exceeded, an access error) is on the send queue: name that.
      if (wc.status == WcStatus::kFlushed) {
        {
          std::lock_guard<std::mutex> lock(sendMutex_);
          drainSendsLocked();
        }
        reportSendFailure();
      }
      fail(wc.status == WcStatus::kRetryExceeded ? Reason::kTimeout : Reason::kError,
           describeCompletionError(wc));
      return true;
    }
    pair_->heard(nowNs());
    const uint32_t index = workIndex(wc.wrId);
    try {
      if (workKind(wc.wrId) != WorkKind::kControlRecv || index >= IbEndpoint::kControlRecvs) {
        throw ProtocolError("completion for an unknown receive");
      }
      if (wc.opcode == WcOpcode::kRecv && wc.byteLength == 0) {
        // A grant's notice (a control frame is never empty): its FIFO entry
        // is in place, and pumpData, which runs after this poll, takes it.
        if (!sender_) throw ProtocolError("an empty SEND at the receiving end of a path");
      } else if (wc.opcode == WcOpcode::kRecv) {
        handleControl(endpoint_->controlRecv(index), wc.byteLength);
      } else if (wc.opcode == WcOpcode::kRecvRdmaWithImm && !sender_) {
        handleData(wc.immediate, wc.byteLength);
      } else {
        throw ProtocolError(sender_ ? "data written to the sending end of a path"
                                    : "unexpected completion kind");
      }
    } catch (const ProtocolError& error) {
      RECCL_LOG(kWarn, std::string("protocol error from ") + peerName_ + ": " + error.what());
      fail(Reason::kError, std::string("protocol error: ") + error.what());
      return true;
    }
    std::string error;
    if (!endpoint_->postReceive(index, &error)) {
      fail(Reason::kError, "ibv_post_recv: " + error);
      return true;
    }
    reposted_.fetch_add(1);
  }
  if (got > 0) {
    {
      std::lock_guard<std::mutex> lock(sendMutex_);
      writeCreditsLocked();  // one write per batch: the peer may be waiting for them
    }
    reportSendFailure();
  }
  return got > 0;
}

bool IbPath::pollSends() {
  bool moved;
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    moved = drainSendsLocked() > 0;
    moved = flushBacklogLocked() || moved;
    moved = flushGrantsLocked() || moved;
  }
  reportSendFailure();
  return moved;
}

bool IbPath::pumpData() {
  {
    // Data waits behind control frames waiting for a buffer: a control frame
    // goes out before any data queued after it.
    std::lock_guard<std::mutex> lock(sendMutex_);
    if (!backlog_.empty()) return false;
  }
  bool moved = false;
  while (!stop_.load()) {
    bool placed = false;
    {
      std::lock_guard<std::mutex> lock(queueMutex_);
      if (queue_.empty()) break;
      DataChunk& head = queue_.front();
      // A NIC of this path that refused the registration (a fatal error, a
      // dma-buf it cannot import) has no key for it: host memory is staged
      // instead; device memory cannot be and fails the path below.
      if (head.placement && head.placement->hostAccessible && !placeableHere(head) &&
          head.source != nullptr && head.source->hostAccessible()) {
        head.placement.reset();
      }
      placed = static_cast<bool>(head.placement);
    }
    if (placed) {
      bool failed = false;
      if (!pumpPlaced(&failed)) {
        if (failed) return true;
        break;  // waits for notices to complete
      }
      moved = true;
      continue;
    }
    const uint32_t entry = static_cast<uint32_t>(grantsUsed_ % IbEndpoint::kDataSlots);
    const uint64_t value = __atomic_load_n(endpoint_->ctsFifo(entry), __ATOMIC_ACQUIRE);
    if ((value >> 16) != grantsUsed_ + 1) break;  // no grant yet
    const uint32_t slot = static_cast<uint32_t>(value & 0xFFFF);
    if (slot >= peerSlotCount_) {
      fail(Reason::kError, "protocol error: the CTS FIFO grants slot " + std::to_string(slot) +
                               "; the receiver has " + std::to_string(peerSlotCount_));
      return true;
    }
    uint32_t staging = 0;
    {
      std::lock_guard<std::mutex> lock(sendMutex_);
      if (freeStaging_.empty()) drainSendsLocked();
      if (freeStaging_.empty() || !takeCreditLocked())
        break;  // the write's immediate takes a receive
      staging = freeStaging_.back();
      freeStaging_.pop_back();
    }
    DataChunk chunk{};
    bool have = false;
    {
      std::lock_guard<std::mutex> lock(queueMutex_);
      // The head may have changed since we looked (dropped and requeued): a
      // placed chunk is never staged (its buffer may be device memory).
      if (!queue_.empty() && !queue_.front().placement) {
        chunk = queue_.front();
        queue_.pop_front();
        have = true;
      }
    }
    if (!have || chunk.header.bytes + IbEndpoint::kDataHeadBytes > peerSlotBytes_) {
      {
        std::lock_guard<std::mutex> lock(sendMutex_);
        freeStaging_.push_back(staging);
        --consumingSent_;  // its credit, unused
      }
      if (have) {
        fail(Reason::kError, "a chunk of " + std::to_string(chunk.header.bytes) +
                                 " bytes does not fit the receiver's staging slots of " +
                                 std::to_string(peerSlotBytes_));
        return true;
      }
      break;
    }
    uint8_t* target = endpoint_->staging(staging);
    const FrameHeader frameHeader = dataFrameHeader();
    std::memcpy(target, &frameHeader, sizeof(frameHeader));
    std::memcpy(target + sizeof(frameHeader), &chunk.header, sizeof(chunk.header));
    if (chunk.header.bytes > 0) {
      std::memcpy(target + IbEndpoint::kDataHeadBytes, chunk.payload, chunk.header.bytes);
    }
    SendRequest request;
    request.wrId = workId(WorkKind::kData, staging);
    request.op = SendRequest::Op::kWriteWithImmediate;
    request.sge = {reinterpret_cast<uint64_t>(target),
                   static_cast<uint32_t>(IbEndpoint::kDataHeadBytes + chunk.header.bytes),
                   endpoint_->localKey()};
    request.remoteAddress = peerRegion_ + static_cast<uint64_t>(slot) * peerSlotBytes_;
    request.rkey = peerRkey_;
    request.immediate = slot;
    bool posted;
    {
      std::lock_guard<std::mutex> lock(sendMutex_);
      posted = postLocked(request);
      if (!posted) freeStaging_.push_back(staging);
    }
    if (!posted) {
      reportSendFailure();
      return true;
    }
    ++grantsUsed_;
    moved = true;
  }
  return moved;
}

bool IbPath::pauseIfBlackholed() {
  if (!NicHealth::instance().blackholed(healthId_)) return false;
  if (!paused_) {
    paused_ = true;
    loop_->setEvents(loopId_, 0);
  }
  loop_->setDeadline(loopId_, Clock::now() + kBlackholeRecheck, true);
  return true;
}

void IbPath::resume() {
  if (!paused_) return;
  paused_ = false;
  loop_->setEvents(loopId_, EPOLLIN);  // events that came meanwhile wait in the channel
}

void IbPath::onIo() {
  if (stop_.load() || failed_.load()) {
    // Nothing more to do here; a channel left readable would report again and again.
    loop_->setEvents(loopId_, 0);
    return;
  }
  // The blackhole drill: nothing in or out, so the silence check (a
  // deadline) fails the path as a real blackhole would.
  if (pauseIfBlackholed()) return;
  service(true);
}

void IbPath::onDeadline() {
  serviceDue_.store(false);  // before servicing: a later sendData hands over again
  if (stop_.load() || failed_.load()) return;
  const int64_t now = nowNs();
  const int64_t silentNs = now - pair_->lastHeardNs();
  if (silentNs > heartbeat_.count() * 1000000LL) {
    fail(Reason::kTimeout, "nothing from " + peerName_ +
                               (paused_ ? std::string(" (NIC blackholed)")
                                        : " for " + std::to_string(silentNs / 1000000) + " ms"));
    return;
  }
  int64_t backlogSince = 0;
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    if (!backlog_.empty()) backlogSince = backlogProgressNs_;
  }
  if (backlogSince != 0 && now - backlogSince > heartbeat_.count() * 1000000LL) {
    fail(Reason::kTimeout, "the peer " + peerName_ + " took no control frame for " +
                               std::to_string(heartbeat_.count()) + " ms");
    return;
  }
  if (pauseIfBlackholed()) return;
  resume();
  if (!sender_ && !granted_) {
    granted_ = true;
    for (uint32_t slot = 0; slot < IbEndpoint::kDataSlots; ++slot) grant(slot);
  }
  service(false);
  if (stop_.load() || failed_.load()) return;
  const Clock::time_point clockNow = Clock::now();
  if (clockNow >= nextBeat_) {
    // One path of the NIC pair beats for all of them, and only when nothing
    // went over the pair lately; only when a buffer is free and nothing waits:
    // a frame in flight or waiting speaks for us as well, and its own bound covers it.
    const int64_t quietNs = beatInterval_.count() * 1000000LL / 2;
    if (pair_->claimBeat(now, quietNs)) {
      const std::vector<uint8_t> beat = encodeHeartbeat();
      sendControlFrom(beat.data(), beat.size(), false);
    }
    nextBeat_ = nextBeatAfter(clockNow, beatInterval_);
  }
  // Next: the beat, or the moment silence (or a stuck backlog) would fail the path.
  Clock::time_point next = std::min(nextBeat_, atNs(pair_->lastHeardNs()) + heartbeat_ + Millis(1));
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    if (!backlog_.empty()) next = std::min(next, atNs(backlogProgressNs_) + heartbeat_ + Millis(1));
  }
  // Earlier only: this deadline was just taken, so one set meanwhile (work
  // handed over, a backlog's bound) is newer and must stay.
  loop_->setDeadline(loopId_, next, true);
}

bool IbPath::serviceRound() {
  bool moved = pollReceives();
  if (stop_.load() || failed_.load()) return false;
  moved = pollSends() || moved;
  if (sender_) moved = pumpData() || moved;
  return moved;
}

bool IbPath::workOutstanding() {
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    // Control buffers in flight alone (a heartbeat, a credit write) are not
    // work: an idle path's beats come and go by events.
    if (!backlog_.empty() || !pendingGrants_.empty() || placedInFlight_.load() > 0 ||
        (sender_ && freeStaging_.size() < IbEndpoint::kDataSlots)) {
      return true;
    }
  }
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    if (!queue_.empty()) return true;
  }
  // Requests of the connection waiting on this path (its data, its ACK).
  return owner_ != nullptr && owner_->expectsTraffic(pathId_);
}

void IbPath::service(bool events) {
  if (events) {
    // Take and acknowledge every waiting event; each disarmed its CQ.
    while (endpoint_->channel().takeEvent() != nullptr) {
    }
    armed_ = false;
  }
  for (;;) {
    bool moved = false;
    for (int round = 0; round < kRoundsPerTurn; ++round) {
      const bool movedNow = serviceRound();
      if (stop_.load() || failed_.load()) return;
      if (!movedNow) break;
      moved = true;
      if (round + 1 == kRoundsPerTurn) {
        // Still moving: what is left gets the next turn, after the loop's
        // other registrations (the CQs stay unarmed: that turn polls them).
        lastProgressNs_ = nowNs();
        serviceSoon();
        return;
      }
    }
    const int64_t now = nowNs();
    if (moved) lastProgressNs_ = now;
    if (busyPollNs_ > 0) {
      if (workOutstanding()) lastWorkNs_ = now;
      // Busy polling, the channel left quiet: while work is outstanding (and
      // a little past it, so the next message of a ping-pong finds the path
      // polling) and something completed within the window.
      if (now - lastWorkNs_ < busyPollNs_ && now - lastProgressNs_ < busyPollNs_) {
        // Nothing came this turn: let other runnable threads (the peer's,
        // the application's) have the core before the next poll. Without
        // contention this returns at once.
        if (!moved) std::this_thread::yield();
        serviceSoon();
        return;
      }
    }
    if (armed_) return;
    // Going to sleep: arm, then poll once more. A completion that landed
    // before the arm raises no event, so that poll finds it; a later one
    // raises the next event.
    try {
      endpoint_->sendCq().requestNotify();
      endpoint_->recvCq().requestNotify();
    } catch (const Error& error) {
      fail(Reason::kError, std::string("arming a completion queue: ") + error.what());
      return;
    }
    armed_ = true;
  }
}

}  // namespace reccl
