#include "transport/tcp/tcp_path.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"

namespace reccl {

namespace {
constexpr uint32_t kReadable = EPOLLIN;
constexpr uint32_t kWritable = EPOLLOUT;
// How much one socket moves per wake-up before the loop turns to its other
// sockets (level-triggered: the rest follows at the next turn).
constexpr size_t kBytesPerTurn = 4 << 20;
constexpr int kFramesPerTurn = 64;

bool wouldBlock(int error) { return error == EAGAIN || error == EWOULDBLOCK || error == EINTR; }
}  // namespace

// The loops hold these, not the path: a registration outlives nothing it points
// at, since the path unregisters every socket (stopAndJoin) before it goes.
class TcpPath::SocketIo : public IoHandler {
 public:
  SocketIo(TcpPath* path, size_t index) : path_(path), index_(index) {}
  void onIo(uint32_t events) override { path_->onIo(index_, events); }
  void onDeadline() override { path_->onDeadline(index_); }

 private:
  TcpPath* const path_;
  const size_t index_;
};

TcpPath::TcpPath(Role role, Fd control, std::vector<Fd> data, int localNic, int remoteNic,
                 int healthId, std::string peer, std::shared_ptr<NicPairLiveness> pair,
                 const Config& config, std::shared_ptr<SameHostWindow> window,
                 std::shared_ptr<const PeerMemory> peerMemory)
    : role_(role),
      localNic_(localNic),
      remoteNic_(remoteNic),
      healthId_(healthId),
      peer_(std::move(peer)),
      ioThreadsPerNic_(EventLoops::perNic(config.ioThreads)),
      heartbeat_(config.heartbeatMs),
      beatInterval_(std::max<int64_t>(5, config.heartbeatMs / 4)),
      dataStallLimit_(config.heartbeatMs * 4),
      pair_(std::move(pair)),
      window_(std::move(window)),
      peerMemory_(std::move(peerMemory)) {
  sockets_.resize(1 + data.size());
  sockets_[kControl].fd = std::move(control);
  for (size_t i = 0; i < data.size(); ++i) sockets_[1 + i].fd = std::move(data[i]);
  if (!sockets_[kControl].fd.valid() || sockets_.size() < 2 || !sockets_[1].fd.valid()) {
    throw Error("a path to " + peer_ + " needs its control socket and its first data socket");
  }
  for (auto& socket : sockets_) {
    if (!socket.fd.valid()) continue;  // joins later (attachData)
    // Every frame goes out at once: Nagle plus delayed ACKs would hold a small
    // CTS or ACK for ~40 ms (seen as 44 ms steps under NCCL).
    setNoDelay(socket.fd.get());
    setNonBlocking(socket.fd.get(), true);
  }
}

TcpPath::~TcpPath() { stopAndJoin(); }

void TcpPath::start(PathOwner* owner, uint64_t pathId) {
  owner_ = owner;
  pathId_ = pathId;
  nextBeat_ = nextBeatAfter(Clock::now(), beatInterval_);
  const int64_t now = nowNs();
  lastControlCheckNs_ = now;  // before the loops know the path: its timer runs there
  try {
    std::lock_guard<std::mutex> lock(attachMutex_);
    for (size_t i = 0; i < sockets_.size(); ++i) {
      if (sockets_[i].fd.valid()) registerSocketLocked(i, now);
    }
    started_ = true;
  } catch (const Error& e) {
    shutdown();  // stopAndJoin (the destructor at the latest) unregisters what was added
    throw Error("could not start the path to " + peer_ + ": " + e.what());
  }
  sockets_[kControl].loop->setDeadline(sockets_[kControl].id, nextBeat_);
}

void TcpPath::registerSocketLocked(size_t index, int64_t now) {
  Socket& socket = sockets_[index];
  socket.lastProgressNs = now;
  // Set before add(), which sets the id before the loop may report the socket:
  // onIo uses both.
  socket.loop = &EventLoops::instance().pick(healthId_, ioThreadsPerNic_);
  const bool reads = index == kControl || role_ == Role::kReceiver;
  // A writer is polled only while it has a chunk to write (sendData arms it).
  try {
    socket.loop->add(socket.fd.get(), reads ? kReadable : 0,
                     std::make_shared<SocketIo>(this, index), socket.id);
  } catch (...) {
    socket.loop = nullptr;
    EventLoops::instance().release(healthId_);
    throw;
  }
  if (index == kControl) return;
  std::lock_guard<std::mutex> lock(queueMutex_);
  socket.joined = true;
  // Chunks already waiting: this writer takes its share at once.
  if (role_ == Role::kSender && !queue_.empty() && !socket.writerArmed) {
    socket.writerArmed = true;
    socket.loop->setEvents(socket.id, EPOLLOUT);
  }
}

bool TcpPath::attachData(size_t slot, Fd fd) {
  const size_t index = 1 + slot;
  std::lock_guard<std::mutex> lock(attachMutex_);
  if (index >= sockets_.size() || sockets_[index].fd.valid() || stop_.load() || sealed_)
    return false;
  setNoDelay(fd.get());
  setNonBlocking(fd.get(), true);
  sockets_[index].fd = std::move(fd);
  if (!started_) return true;  // start() registers it with the others
  try {
    registerSocketLocked(index, nowNs());
  } catch (const Error& e) {
    // The path goes on with the sockets it has.
    RECCL_LOG(kInfo, "a late data socket to " + peer_ + " could not join its path: " + e.what());
    sockets_[index].fd.reset();
    return false;
  }
  return true;
}

void TcpPath::shutdown() {
  // Before any request of this path can fail and its buffer be reused: the
  // receiver lands no payload it reads from here after this.
  if (window_) window_->revoke();
  const bool stoppedBefore = stop_.exchange(true);
  {
    // Microseconds: a write inside is one non-blocking sendmsg.
    std::unique_lock<std::mutex> lock(payloadMutex_);
    payloadWritesDone_.wait(lock, [&] { return payloadWrites_ == 0; });
  }
  if (stoppedBefore) return;
  {
    // A socket attached from now on is refused (attachData checks stop_ under this lock).
    std::lock_guard<std::mutex> lock(attachMutex_);
    for (const auto& socket : sockets_) {
      if (socket.fd.valid()) ::shutdown(socket.fd.get(), SHUT_RDWR);
    }
  }
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    queue_.clear();
  }
  framesDone_.notify_all();
  // A reader in the middle of a frame hands its buffer back (endData) at once,
  // on its own thread, even while a blackhole keeps its socket unpolled.
  if (role_ == Role::kReceiver) {
    std::lock_guard<std::mutex> lock(attachMutex_);
    for (size_t i = 1; i < sockets_.size(); ++i) {
      if (sockets_[i].loop != nullptr) sockets_[i].loop->setDeadline(sockets_[i].id, Clock::now());
    }
  }
}

void TcpPath::stopAndJoin() {
  shutdown();
  std::lock_guard<std::mutex> lock(joinMutex_);
  if (joined_) return;
  {
    std::lock_guard<std::mutex> attachLock(attachMutex_);
    sealed_ = true;  // the registrations below are final
  }
  for (auto& socket : sockets_) {
    if (socket.loop != nullptr) {
      socket.loop->remove(socket.id);
      EventLoops::instance().release(healthId_);
    }
  }
  // No loop calls into this path any more: release what a reader still holds.
  if (role_ == Role::kReceiver && owner_ != nullptr) {
    for (size_t i = 1; i < sockets_.size(); ++i) finishReader(sockets_[i]);
  }
  joined_ = true;
}

bool TcpPath::blackholed() const { return NicHealth::instance().blackholed(healthId_); }

void TcpPath::fail(Reason reason, const PathFailure& failure) {
  if (window_) window_->revoke();  // as in shutdown(): before the owner hears of it
  // A path we stopped on purpose has not failed; report a real failure once.
  if (stop_.load() || failed_.exchange(true)) return;
  owner_->onPathFailed(pathId_, reason, failure);
}

void TcpPath::failIo(const char* what, Reason reason, const std::string& why) {
  fail(reason, std::string(what) + " " + peer_ + ": " + why);
}

void TcpPath::failSocket(const char* what, int error) {
  fail(Reason::kError,
       PathFailure{std::string(what) + " " + peer_ + ": " + describeSocketError(error),
                   answeredByPeerHost(error)});
}

uint32_t TcpPath::pollMask(const Socket& socket) const {
  if (&socket == &sockets_[kControl]) {
    std::lock_guard<std::mutex> lock(controlMutex_);
    return kReadable | (controlOutSent_ < controlOut_.size() ? kWritable : 0);
  }
  if (role_ == Role::kReceiver) return kReadable;
  std::lock_guard<std::mutex> lock(queueMutex_);
  return socket.writerArmed ? kWritable : 0;
}

bool TcpPath::pauseIfBlackholed(Socket& socket) {
  if (!blackholed()) return false;
  if (!socket.paused) {
    socket.paused = true;
    socket.loop->setEvents(socket.id, 0);
  }
  socket.loop->setDeadline(socket.id, Clock::now() + kBlackholeRecheck, true);
  return true;
}

void TcpPath::resume(Socket& socket) {
  if (!socket.paused) return;
  socket.paused = false;
  socket.loop->setEvents(socket.id, pollMask(socket));
}

void TcpPath::onIo(size_t index, uint32_t events) {
  Socket& socket = sockets_[index];
  if (stop_.load()) {
    if (index != kControl && role_ == Role::kReceiver) finishReader(socket);
    socket.loop->setEvents(socket.id, 0);  // its EOF would report again and again
    return;
  }
  if (pauseIfBlackholed(socket)) return;
  if (index == kControl) {
    if (events & EPOLLOUT) flushControl();
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) readControl();
  } else if (role_ == Role::kSender) {
    writeData(socket);
  } else {
    readData(socket);
  }
}

void TcpPath::onDeadline(size_t index) {
  Socket& socket = sockets_[index];
  if (stop_.load()) {
    if (index != kControl && role_ == Role::kReceiver) finishReader(socket);
    return;
  }
  if (index == kControl) {
    controlTimer();
    return;
  }
  // A data socket's deadline: a stall check, or a blackhole recheck.
  const int64_t now = nowNs();
  const bool midFrame = socket.phase != DataPhase::kIdle;
  if (midFrame && now - socket.lastProgressNs > dataStallLimit_.count() * 1000000LL) {
    const bool sender = role_ == Role::kSender;
    if (!sender) finishReader(socket);
    socket.loop->setEvents(socket.id, 0);
    failIo(sender ? "data write to" : "data read from", Reason::kTimeout, "no progress (stalled)");
    return;
  }
  if (pauseIfBlackholed(socket)) {
    if (midFrame) {
      socket.loop->setDeadline(socket.id, atNs(socket.lastProgressNs) + dataStallLimit_, true);
    }
    return;
  }
  resume(socket);
  if (midFrame) socket.loop->setDeadline(socket.id, atNs(socket.lastProgressNs) + dataStallLimit_);
}

// ---------------------------------------------------------------- control socket

bool TcpPath::writeQueuedControl(int* error) {
  const int fd = sockets_[kControl].fd.get();
  while (controlOutSent_ < controlOut_.size()) {
    ssize_t sent = ::send(fd, controlOut_.data() + controlOutSent_,
                          controlOut_.size() - controlOutSent_, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (wouldBlock(errno)) return true;
      *error = errno;
      return false;
    }
    controlOutSent_ += static_cast<size_t>(sent);
    controlOutProgressNs_ = nowNs();
    pair_->sent(controlOutProgressNs_);
  }
  controlOut_.clear();
  controlOutSent_ = 0;
  return true;
}

bool TcpPath::sendControl(const std::vector<uint8_t>& frame) {
  if (stop_.load() || owner_ == nullptr) return false;
  Socket& control = sockets_[kControl];
  std::unique_lock<std::mutex> lock(controlMutex_);
  const bool idle = controlOutSent_ == controlOut_.size();
  if (idle) controlOutProgressNs_ = nowNs();
  controlOut_.insert(controlOut_.end(), frame.begin(), frame.end());
  int error = 0;
  // Written here and now when the socket takes it, the common case; what it
  // does not take goes out when the loop sees the socket writable.
  if (idle && !blackholed() && !writeQueuedControl(&error)) {
    lock.unlock();
    failSocket("control write to", error);
    return false;
  }
  if (controlOutSent_ == controlOut_.size()) return true;
  // Nobody waits for the rest, not even a caller holding its connection's lock:
  // a loop thread blocked there would starve every other socket of its loop.
  // The control deadline fails the path if the bytes do not move for a heartbeat.
  control.loop->setEvents(control.id, kReadable | kWritable);
  control.loop->setDeadline(control.id, atNs(controlOutProgressNs_) + heartbeat_, true);
  return true;
}

void TcpPath::flushControl() {
  Socket& control = sockets_[kControl];
  std::unique_lock<std::mutex> lock(controlMutex_);
  int error = 0;
  if (!writeQueuedControl(&error)) {
    lock.unlock();
    control.loop->setEvents(control.id, 0);
    failSocket("control write to", error);
    return;
  }
  if (controlOutSent_ == controlOut_.size()) control.loop->setEvents(control.id, EPOLLIN);
}

void TcpPath::readControl() {
  Socket& control = sockets_[kControl];
  const int fd = control.fd.get();
  for (int frames = 0; frames < kFramesPerTurn;) {
    uint8_t* into;
    size_t want;
    if (!controlInBody_) {
      into = controlHead_ + controlMoved_;
      want = sizeof(controlHead_) - controlMoved_;
    } else {
      into = controlBody_.data() + controlMoved_;
      want = controlBody_.size() - controlMoved_;
    }
    if (want > 0) {
      ssize_t got = ::recv(fd, into, want, MSG_DONTWAIT);
      if (got == 0 || (got < 0 && !wouldBlock(errno))) {
        control.loop->setEvents(control.id, 0);
        failSocket("control read from", got == 0 ? 0 : errno);
        return;
      }
      if (got < 0) return;  // the rest when it arrives
      controlMoved_ += static_cast<size_t>(got);
      if (static_cast<size_t>(got) < want) continue;
    }
    try {
      if (!controlInBody_) {
        controlHeader_ = parseFrameHeader(controlHead_, sizeof(controlHead_));
        controlBody_.resize(controlHeader_.bodyBytes);
        controlInBody_ = true;
        controlMoved_ = 0;
        continue;
      }
      controlInBody_ = false;
      controlMoved_ = 0;
      ++frames;
      pair_->heard(nowNs());
      ControlFrame frame = decodeControl(controlHeader_, controlBody_.data(), controlBody_.size());
      if (frame.type == FrameType::kHeartbeat) continue;
      owner_->onControl(pathId_, frame);
      if (stop_.load()) return;
    } catch (const ProtocolError& error) {
      RECCL_LOG(kWarn, std::string("protocol error from ") + peer_ + ": " + error.what());
      control.loop->setEvents(control.id, 0);
      fail(Reason::kError, std::string("protocol error: ") + error.what());
      return;
    }
  }
}

void TcpPath::controlTimer() {
  Socket& control = sockets_[kControl];
  const int64_t now = nowNs();
  const int64_t beatNs = beatInterval_.count() * 1000000LL;
  // The timer is never set more than a beat interval ahead, so a run this late
  // means this process did not run (descheduled, a paused VM, a stop signal),
  // and silence or a stuck write it did not watch is no evidence: both count
  // from now on. (Counting them anyway, or granting one beat interval, failed
  // live pairs in CI: a paused VM resumed with a NIC slowed to 10%, TCP
  // restarting from its retransmission timers, and both ends failed the pair.)
  if (now - lastControlCheckNs_ > 2 * beatNs) watchedSinceNs_ = now;
  lastControlCheckNs_ = now;
  const int64_t heardNs = std::max(pair_->lastHeardNs(), watchedSinceNs_);
  const int64_t silentNs = now - heardNs;
  if (silentNs > heartbeat_.count() * 1000000LL) {
    fail(Reason::kTimeout,
         "no heartbeat from " + peer_ + " for " + std::to_string(silentNs / 1000000) + " ms");
    return;
  }
  const Clock::time_point silenceDeadline = atNs(heardNs) + heartbeat_ + Millis(1);
  int64_t writeStuckSinceNs = 0;
  {
    std::lock_guard<std::mutex> lock(controlMutex_);
    if (controlOutSent_ < controlOut_.size()) {
      writeStuckSinceNs = std::max(controlOutProgressNs_, watchedSinceNs_);
    }
  }
  if (writeStuckSinceNs != 0 && now - writeStuckSinceNs > heartbeat_.count() * 1000000LL) {
    failIo("control write to", Reason::kTimeout, "no progress (stalled)");
    return;
  }
  const bool dark = pauseIfBlackholed(control);
  if (!dark) resume(control);
  const Clock::time_point clockNow = Clock::now();
  if (!dark && clockNow >= nextBeat_) {
    // One beat per NIC pair and interval, from whichever of its paths comes
    // first, and none when anything else went over the pair lately (any frame
    // or data proves us alive to the peer); none behind a stuck write either
    // (the stall check above speaks for it).
    const int64_t quietNs = beatInterval_.count() * 1000000LL / 2;
    if (writeStuckSinceNs == 0 && pair_->claimBeat(now, quietNs) &&
        !sendControl(encodeHeartbeat())) {
      return;
    }
    nextBeat_ = nextBeatAfter(clockNow, beatInterval_);
  }
  // Next: the beat, or the moment the pair's silence would fail the path.
  Clock::time_point next = std::min(nextBeat_, silenceDeadline);
  if (writeStuckSinceNs != 0)
    next = std::min(next, atNs(writeStuckSinceNs) + heartbeat_ + Millis(1));
  control.loop->setDeadline(control.id, next, dark);
}

// ---------------------------------------------------------------- data sockets

void TcpPath::sendData(const DataChunk& chunk) {
  bool grow = false;
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    if (stop_.load()) return;
    queue_.push_back(chunk);
    const bool woke = wakeWriterLocked();
    // Chunks queue behind every joined writer: the missing sockets' bandwidth is
    // wanted now. (One chunk alone may find the last writer not yet idle after
    // its previous chunk was acknowledged; that is no backlog.)
    if (!woke && queue_.size() >= 2 && grow_ && !growAsked_) {
      bool missing = false;
      for (size_t i = 1; i <= usableWritersLocked(); ++i) missing = missing || !sockets_[i].joined;
      grow = growAsked_ = missing;
    }
  }
  if (grow) grow_();
}

void TcpPath::dropQueuedData() {
  std::lock_guard<std::mutex> lock(queueMutex_);
  queue_.clear();
}

bool TcpPath::drainDirectWrites(Millis timeout) {
  std::unique_lock<std::mutex> lock(queueMutex_);
  queue_.clear();
  framesDone_.wait_for(lock, timeout, [&] { return framesWriting_ == 0 || stop_.load(); });
  return framesWriting_ == 0 && !stop_.load();
}

void TcpPath::awaitWritten(uint64_t seq, Millis timeout) {
  std::unique_lock<std::mutex> lock(queueMutex_);
  framesDone_.wait_for(lock, timeout, [&] {
    for (size_t i = 1; i < sockets_.size(); ++i) {
      if (sockets_[i].holdsChunk && sockets_[i].header.seq == seq) return stop_.load();
    }
    return true;
  });
}

bool TcpPath::enterPayloadWrite() {
  std::lock_guard<std::mutex> lock(payloadMutex_);
  if (stop_.load()) return false;
  ++payloadWrites_;
  return true;
}

void TcpPath::leavePayloadWrite() {
  std::lock_guard<std::mutex> lock(payloadMutex_);
  if (--payloadWrites_ == 0) payloadWritesDone_.notify_all();
}

void TcpPath::releaseChunkLocked(Socket& socket) {
  socket.holdsChunk = false;
  --framesWriting_;
  framesDone_.notify_all();  // drainDirectWrites and awaitWritten
}

void TcpPath::limitDataStreams(size_t streams) {
  std::lock_guard<std::mutex> lock(queueMutex_);
  streamLimit_ = streams;
}

bool TcpPath::wakeWriterLocked() {
  // One idle writer per chunk, taking turns, so chunks spread over sockets.
  const size_t writers = usableWritersLocked();
  for (size_t step = 0; step < writers; ++step) {
    Socket& socket = sockets_[1 + (nextWriter_ + step) % writers];
    if (!socket.joined || socket.writerArmed) continue;
    socket.writerArmed = true;
    socket.loop->setEvents(socket.id, EPOLLOUT);
    nextWriter_ = (nextWriter_ + step + 1) % writers;
    return true;
  }
  return false;
}

size_t TcpPath::usableWritersLocked() const {
  const size_t all = sockets_.size() - 1;
  return streamLimit_ == 0 ? all : std::min(streamLimit_, all);
}

void TcpPath::writeData(Socket& socket) {
  const int fd = socket.fd.get();
  for (size_t budget = kBytesPerTurn; budget > 0;) {
    if (socket.phase == DataPhase::kIdle) {
      std::lock_guard<std::mutex> lock(queueMutex_);
      if (socket.holdsChunk) releaseChunkLocked(socket);
      // A socket past the stream cap finishes its frame, then takes no more.
      const bool capped =
          static_cast<size_t>(&socket - &sockets_[kControl]) > usableWritersLocked();
      if (queue_.empty() || capped) {
        socket.writerArmed = false;
        socket.loop->setEvents(socket.id, 0);
        if (!queue_.empty()) wakeWriterLocked();  // hands the queue to a socket within the cap
        return;
      }
      const DataChunk chunk = queue_.front();
      queue_.pop_front();
      socket.holdsChunk = true;
      ++framesWriting_;
      // DATA_REF's body is DATA's header followed by the payload's address.
      const bool byReference = window_ && chunk.header.bytes >= kSameHostMinBytes;
      const FrameHeader frameHeader = byReference ? dataRefFrameHeader() : dataFrameHeader();
      std::memcpy(socket.head, &frameHeader, sizeof(frameHeader));
      std::memcpy(socket.head + sizeof(frameHeader), &chunk.header, sizeof(chunk.header));
      if (byReference) {
        const uint64_t address = reinterpret_cast<uint64_t>(chunk.payload);
        std::memcpy(socket.head + kDataHeadBytes, &address, sizeof(address));
      }
      socket.headBytes = byReference ? kRefHeadBytes : kDataHeadBytes;
      socket.header = chunk.header;
      socket.payload = chunk.payload;
      socket.moved = 0;
      socket.phase = DataPhase::kHead;
      socket.lastProgressNs = nowNs();
    }
    // Header and payload in one call: no corking, no extra segment.
    const size_t wirePayload = socket.headBytes == kRefHeadBytes ? 0 : socket.header.bytes;
    const size_t total = socket.headBytes + wirePayload;
    iovec parts[2];
    int count = 0;
    if (socket.moved < socket.headBytes) {
      parts[count++] = {socket.head + socket.moved, socket.headBytes - socket.moved};
    }
    if (wirePayload > 0) {
      const size_t done = socket.moved > socket.headBytes ? socket.moved - socket.headBytes : 0;
      parts[count++] = {const_cast<uint8_t*>(socket.payload) + done, wirePayload - done};
    }
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = static_cast<size_t>(count);
    if (wirePayload > 0 && !enterPayloadWrite()) {
      socket.loop->setEvents(socket.id, 0);
      return;
    }
    ssize_t sent = ::sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
    const int sendError = errno;
    if (wirePayload > 0) leavePayloadWrite();
    errno = sendError;
    if (sent < 0) {
      if (wouldBlock(errno)) {
        socket.loop->setDeadline(socket.id, atNs(socket.lastProgressNs) + dataStallLimit_, true);
        return;
      }
      const int error = errno;
      socket.loop->setEvents(socket.id, 0);
      failSocket("data write to", error);
      return;
    }
    socket.moved += static_cast<size_t>(sent);
    socket.lastProgressNs = nowNs();
    pair_->sent(socket.lastProgressNs);  // the peer hears data as well as beats
    budget -= std::min(budget, static_cast<size_t>(sent));
    if (socket.moved == total) {
      socket.phase = DataPhase::kIdle;
    } else if (socket.moved >= socket.headBytes) {
      socket.phase = DataPhase::kPayload;
    }
  }
  if (socket.phase == DataPhase::kIdle && socket.holdsChunk) {
    std::lock_guard<std::mutex> lock(queueMutex_);
    releaseChunkLocked(socket);
  }
}

void TcpPath::readData(Socket& socket) {
  const int fd = socket.fd.get();
  uint8_t scratch[16 << 10];
  for (size_t budget = kBytesPerTurn; budget > 0;) {
    uint8_t* into;
    size_t want;
    if (socket.phase != DataPhase::kPayload) {
      into = socket.head + socket.moved;
      want = socket.headBytes - socket.moved;
    } else {
      const size_t left = socket.header.bytes - socket.moved;
      into = socket.target != nullptr ? socket.target + socket.moved : scratch;
      want = socket.target != nullptr ? left : std::min(left, sizeof(scratch));
    }
    if (want > 0) {
      ssize_t got = ::recv(fd, into, want, MSG_DONTWAIT);
      if (got == 0 || (got < 0 && !wouldBlock(errno))) {
        const int error = got == 0 ? 0 : errno;
        if (!socket.carried && &socket != &sockets_[1]) {
          // A late-joined socket that ends before its first frame: the sender's
          // grow gave up half way and closed it unused. The path goes on; a
          // dead NIC or peer fails it through its other sockets.
          socket.loop->setEvents(socket.id, 0);
          ::shutdown(fd, SHUT_RDWR);
          RECCL_LOG(kInfo, "an unused data socket from " + peer_ + " closed (" +
                               describeSocketError(error) + "); the path goes on without it");
          return;
        }
        finishReader(socket);
        socket.loop->setEvents(socket.id, 0);
        failSocket("data read from", error);
        return;
      }
      if (got < 0) {
        if (socket.phase != DataPhase::kIdle) {
          socket.loop->setDeadline(socket.id, atNs(socket.lastProgressNs) + dataStallLimit_, true);
        }
        return;
      }
      const int64_t now = nowNs();
      socket.moved += static_cast<size_t>(got);
      socket.carried = true;
      socket.lastProgressNs = now;
      pair_->heard(now);  // data arriving proves the peer alive
      budget -= std::min(budget, static_cast<size_t>(got));
      if (socket.phase == DataPhase::kIdle) socket.phase = DataPhase::kHead;
      if (static_cast<size_t>(got) < want) continue;
    }
    if (socket.phase != DataPhase::kPayload && socket.headBytes == kRefHeadBytes) {
      if (!readByReference(socket)) return;
      if (stop_.load()) return;
      continue;
    }
    if (socket.phase != DataPhase::kPayload) {
      try {
        FrameHeader frameHeader = parseFrameHeader(socket.head, sizeof(FrameHeader));
        if (frameHeader.type == static_cast<uint8_t>(FrameType::kDataRef) && peerMemory_) {
          socket.headBytes = kRefHeadBytes;  // the payload's address follows
          continue;
        }
        if (frameHeader.type != static_cast<uint8_t>(FrameType::kData)) {
          throw ProtocolError(std::string(frameTypeName(static_cast<FrameType>(frameHeader.type))) +
                              " frame on a data socket" +
                              (peerMemory_ ? "" : " of a path without same-host reads"));
        }
        std::memcpy(&socket.header, socket.head + sizeof(FrameHeader), sizeof(DataHeader));
        socket.target = beginChunk(socket.header);
      } catch (const ProtocolError& error) {
        failProtocol(socket, error);
        return;
      }
      socket.phase = DataPhase::kPayload;
      socket.moved = 0;
    }
    if (socket.moved == socket.header.bytes) {
      // Stale or duplicate payloads (no target) were read and dropped, keeping the stream in frame.
      uint8_t* target = socket.target;
      socket.target = nullptr;
      socket.phase = DataPhase::kIdle;
      socket.moved = 0;
      if (target != nullptr) owner_->endData(pathId_, socket.header, true);
      if (stop_.load()) return;
    }
  }
}

uint8_t* TcpPath::beginChunk(const DataHeader& header) {
  if (header.bytes > kMaxChunkBytes) {
    throw ProtocolError("DATA chunk of " + std::to_string(header.bytes) +
                        " bytes; chunks are at most " + std::to_string(kMaxChunkBytes));
  }
  return owner_->beginData(pathId_, header, false);
}

void TcpPath::failProtocol(Socket& socket, const ProtocolError& error) {
  RECCL_LOG(kWarn, std::string("protocol error from ") + peer_ + ": " + error.what());
  socket.phase = DataPhase::kIdle;
  socket.loop->setEvents(socket.id, 0);
  fail(Reason::kError, std::string("protocol error: ") + error.what());
}

bool TcpPath::readByReference(Socket& socket) {
  DataRefBody body{};
  std::memcpy(&body, socket.head + sizeof(FrameHeader), sizeof(body));
  socket.header = body.header;
  socket.phase = DataPhase::kIdle;
  socket.headBytes = kDataHeadBytes;
  socket.moved = 0;
  uint8_t* target = nullptr;
  try {
    target = beginChunk(body.header);
  } catch (const ProtocolError& error) {
    failProtocol(socket, error);
    return false;
  }
  if (target == nullptr) return true;  // stale or duplicate: nothing to read
  std::string why;
  const bool landed = peerMemory_->read(target, body.address, body.header.bytes, &why);
  owner_->endData(pathId_, body.header, landed);
  if (!landed) {
    socket.loop->setEvents(socket.id, 0);
    fail(Reason::kError, why);
    return false;
  }
  NicHealth::instance().counters(healthId_).sameHostBytes.fetch_add(body.header.bytes);
  return true;
}

void TcpPath::finishReader(Socket& socket) {
  uint8_t* target = socket.target;
  socket.target = nullptr;
  socket.phase = DataPhase::kIdle;
  socket.headBytes = kDataHeadBytes;
  socket.moved = 0;
  if (target != nullptr) owner_->endData(pathId_, socket.header, false);
}

}  // namespace reccl
