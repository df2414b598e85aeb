#include "transport/ib/ib_path.h"

#include <cstring>
#include <system_error>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"
#include "core/thread_name.h"
#include "transport/ib/ib_registration.h"

namespace reccl {

namespace {

// A FIFO entry: the grant's sequence number + 1 (so a zeroed entry is never a
// grant) above the 16-bit slot index. One aligned 8-byte word, so the sender
// never sees half of an entry.
uint64_t fifoEntry(uint64_t grant, uint32_t slot) { return ((grant + 1) << 16) | slot; }

}  // namespace

IbPath::IbPath(std::unique_ptr<IbEndpoint> endpoint, const QpExchange& peer, int localNic,
               int remoteNic, int healthId, std::string peerName, const Config& config)
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
      heartbeat_(config.heartbeatMs),
      ibTimeout_(config.ibTimeout),
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
  if (thread_.joinable()) thread_.join();
}

void IbPath::start(PathOwner* owner, uint64_t pathId) {
  owner_ = owner;
  pathId_ = pathId;
  lastHeardNs_.store(nowNs());
  try {
    thread_ = std::thread([this] { run(); });
  } catch (const std::system_error& e) {
    shutdown();
    throw Error(std::string("could not start the IB path's thread: ") + e.what());
  }
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
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    queue_.clear();
  }
  sendSlotFreed_.notify_all();
}

void IbPath::fail(Reason reason, const std::string& detail) {
  // A path we stopped on purpose has not failed; report a real failure once.
  if (stop_.load() || owner_ == nullptr || failed_.exchange(true)) return;
  owner_->onPathFailed(pathId_, reason, detail);
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
    int got = endpoint_->sendCq().poll(wcs, 32);
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
        default: break;
      }
      bool expected = wc.status == WcStatus::kSuccess || (wc.status == WcStatus::kFlushed && stop_.load());
      if (!expected && sendFailure_.empty()) {
        sendFailure_ = describeCompletionError(wc);
        sendFailureReason_ = wc.status == WcStatus::kRetryExceeded ? Reason::kTimeout : Reason::kError;
      }
    }
    total += got;
    if (got < 32) break;
  }
  if (total > 0) sendSlotFreed_.notify_all();
  return total;
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
  return sendControlFrom(frame.data(), frame.size());
}

bool IbPath::sendControlFrom(const uint8_t* bytes, size_t length) {
  if (length > IbEndpoint::kControlBytes) {
    fail(Reason::kError, "control frame of " + std::to_string(length) + " bytes exceeds " +
                             std::to_string(IbEndpoint::kControlBytes));
    return false;
  }
  const Clock::time_point deadline = Clock::now() + heartbeat_;
  bool posted = false;
  bool timedOut = false;
  {
    std::unique_lock<std::mutex> lock(sendMutex_);
    while (freeControl_.empty() && !stop_.load() && sendFailure_.empty()) {
      if (drainSendsLocked() > 0) continue;
      if (Clock::now() > deadline) {
        timedOut = true;
        break;
      }
      sendSlotFreed_.wait_for(lock, Millis(1));
    }
    if (!freeControl_.empty() && !stop_.load() && sendFailure_.empty()) {
      uint32_t index = freeControl_.back();
      freeControl_.pop_back();
      std::memcpy(endpoint_->controlSend(index), bytes, length);
      SendRequest request;
      request.wrId = workId(WorkKind::kControlSend, index);
      request.op = SendRequest::Op::kSend;
      request.sge = {reinterpret_cast<uint64_t>(endpoint_->controlSend(index)),
                     static_cast<uint32_t>(length), endpoint_->localKey()};
      posted = postLocked(request);
      if (!posted) freeControl_.push_back(index);
    }
  }
  if (timedOut) {
    fail(Reason::kTimeout, "the peer " + peerName_ + " took no control frame for " +
                               std::to_string(heartbeat_.count()) + " ms");
  }
  if (!posted) reportSendFailure();
  return posted;
}

void IbPath::sendData(const DataChunk& chunk) {
  std::lock_guard<std::mutex> lock(queueMutex_);
  if (stop_.load()) return;
  queue_.push_back(chunk);
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
    const uint64_t grantNumber = grantsIssued_++;
    const uint32_t entry = static_cast<uint32_t>(grantNumber % peerSlotCount_);
    uint64_t* source = endpoint_->grantSource(entry);
    *source = fifoEntry(grantNumber, slot);
    SendRequest request;
    request.wrId = workId(WorkKind::kGrant, entry);
    request.op = SendRequest::Op::kWrite;
    request.sge = {reinterpret_cast<uint64_t>(source), sizeof(uint64_t), endpoint_->localKey()};
    request.remoteAddress = peerRegion_ + entry * sizeof(uint64_t);
    request.rkey = peerRkey_;
    postLocked(request);
  }
  reportSendFailure();
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
    throw ProtocolError("DATA chunk of " + std::to_string(header.bytes) + " bytes; chunks are at most " +
                        std::to_string(endpoint_->chunkBytes()));
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

bool IbPath::pumpPlaced(bool* failed) {
  *failed = false;
  if (placedInFlight_.load() >= static_cast<int>(IbEndpoint::kPlacedChunks)) return false;
  uint32_t notice = 0;
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    if (freeControl_.size() <= IbEndpoint::kControlReserve) drainSendsLocked();
    if (freeControl_.size() <= IbEndpoint::kControlReserve) return false;
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
  } else if (header.offset > placement.capacity || header.bytes > placement.capacity - header.offset) {
    problem = "chunk [" + std::to_string(header.offset) + ", +" + std::to_string(header.bytes) +
              ") exceeds the receiver's registered " + std::to_string(placement.capacity) + " bytes";
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
  write.sge = {payload, header.bytes, source->lkey(localNic_)};
  write.remoteAddress = placement.address + header.offset;
  write.rkey = placement.rkeys[static_cast<size_t>(remoteNic_)];
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
  int got = endpoint_->recvCq().poll(wcs, 16);
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
    lastHeardNs_.store(nowNs());
    const uint32_t index = workIndex(wc.wrId);
    try {
      if (workKind(wc.wrId) != WorkKind::kControlRecv || index >= IbEndpoint::kControlRecvs) {
        throw ProtocolError("completion for an unknown receive");
      }
      if (wc.opcode == WcOpcode::kRecv) {
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
  }
  return got > 0;
}

bool IbPath::pollSends() {
  int drained;
  {
    std::lock_guard<std::mutex> lock(sendMutex_);
    drained = drainSendsLocked();
  }
  reportSendFailure();
  return drained > 0;
}

bool IbPath::pumpData() {
  bool moved = false;
  while (!stop_.load()) {
    bool placed = false;
    {
      std::lock_guard<std::mutex> lock(queueMutex_);
      if (queue_.empty()) break;
      placed = static_cast<bool>(queue_.front().placement);
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
      if (freeStaging_.empty()) break;
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

void IbPath::run() {
  nameThisThread("reccl-ib-path");
  if (!sender_) {
    for (uint32_t slot = 0; slot < IbEndpoint::kDataSlots; ++slot) grant(slot);
  }
  const Millis beatInterval(std::max<int64_t>(5, heartbeat_.count() / 4));
  const std::vector<uint8_t> heartbeat = encodeHeartbeat();
  Clock::time_point nextBeat = Clock::now();
  int idleMicros = 0;
  NicHealth& health = NicHealth::instance();
  while (!stop_.load()) {
    if (health.blackholed(healthId_)) {
      // The blackhole drill (inject_fault): nothing in or out, so the silence
      // check below fails the path as a real blackhole would.
      std::this_thread::sleep_for(Millis(10));
      if (nowNs() - lastHeardNs_.load() > heartbeat_.count() * 1000000LL) {
        fail(Reason::kTimeout, "nothing from " + peerName_ + " (NIC blackholed)");
        break;
      }
      continue;
    }
    bool busy = pollReceives();
    busy = pollSends() || busy;
    if (sender_) busy = pumpData() || busy;
    if (stop_.load()) break;
    Clock::time_point now = Clock::now();
    if (now >= nextBeat) {
      sendControlFrom(heartbeat.data(), heartbeat.size());
      nextBeat = now + beatInterval;
    }
    int64_t silentNs = nowNs() - lastHeardNs_.load();
    if (silentNs > heartbeat_.count() * 1000000LL) {
      fail(Reason::kTimeout, "nothing from " + peerName_ + " for " +
                                 std::to_string(silentNs / 1000000) + " ms");
      break;
    }
    // Polling, not completion channels: back off to at most 1 ms when idle.
    idleMicros = busy ? 0 : std::min(idleMicros * 2 + 20, 1000);
    if (idleMicros > 0) std::this_thread::sleep_for(std::chrono::microseconds(idleMicros));
  }
}

}  // namespace reccl
