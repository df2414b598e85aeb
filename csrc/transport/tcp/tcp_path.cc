#include "transport/tcp/tcp_path.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <system_error>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"
#include "core/thread_name.h"

namespace reccl {

TcpPath::TcpPath(Role role, Fd control, std::vector<Fd> data, int localNic, int remoteNic,
                 int healthId, std::string peer, const Config& config)
    : role_(role),
      control_(std::move(control)),
      data_(std::move(data)),
      localNic_(localNic),
      remoteNic_(remoteNic),
      healthId_(healthId),
      peer_(std::move(peer)),
      heartbeat_(config.heartbeatMs),
      dataStallLimit_(config.heartbeatMs * 4) {
  // Every frame goes out at once: Nagle plus delayed ACKs would hold a small
  // CTS or ACK for ~40 ms (seen as 44 ms steps under NCCL).
  setNoDelay(control_.get());
  for (const auto& fd : data_) setNoDelay(fd.get());
}

TcpPath::~TcpPath() { stopAndJoin(); }

void TcpPath::stopAndJoin() {
  shutdown();
  std::lock_guard<std::mutex> lock(joinMutex_);
  for (auto& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
}

void TcpPath::start(PathOwner* owner, uint64_t pathId) {
  owner_ = owner;
  pathId_ = pathId;
  lastHeardNs_.store(nowNs());
  try {
    threads_.emplace_back([this] { controlLoop(); });
    for (size_t i = 0; i < data_.size(); ++i) {
      if (role_ == Role::kSender) {
        threads_.emplace_back([this, i] { writerLoop(i); });
      } else {
        threads_.emplace_back([this, i] { readerLoop(i); });
      }
    }
  } catch (const std::system_error& e) {
    shutdown();  // the threads already running see stop_ and end; the destructor joins them
    throw Error(std::string("could not start the path's threads to ") + peer_ + ": " + e.what());
  }
}

void TcpPath::shutdown() {
  if (stop_.exchange(true)) return;
  ::shutdown(control_.get(), SHUT_RDWR);
  for (const auto& fd : data_) ::shutdown(fd.get(), SHUT_RDWR);
  std::lock_guard<std::mutex> lock(queueMutex_);
  queue_.clear();
  queueCv_.notify_all();
}

bool TcpPath::blackholed() const { return NicHealth::instance().blackholed(healthId_); }

IoWatch TcpPath::watch(Millis stallLimit) {
  IoWatch result;
  result.stop = &stop_;
  result.healthId = healthId_;
  result.stallLimit = stallLimit;
  return result;
}

void TcpPath::fail(Reason reason, const std::string& detail) {
  // A path we stopped on purpose has not failed; report a real failure once.
  if (stop_.load() || failed_.exchange(true)) return;
  owner_->onPathFailed(pathId_, reason, detail);
}

bool TcpPath::sendControl(const std::vector<uint8_t>& frame) {
  if (stop_.load() || owner_ == nullptr) return false;
  IoResult result;
  {
    std::lock_guard<std::mutex> lock(controlWriteMutex_);
    result = sendAll(control_.get(), frame.data(), frame.size(), watch(heartbeat_));
  }
  if (result.ok()) return true;
  fail(result.code == IoCode::kStalled ? Reason::kTimeout : Reason::kError,
       "control write to " + peer_ + ": " + result.describe());
  return false;
}

void TcpPath::sendData(const DataChunk& chunk) {
  std::lock_guard<std::mutex> lock(queueMutex_);
  if (stop_.load()) return;
  queue_.push_back(chunk);
  queueCv_.notify_one();
}

void TcpPath::dropQueuedData() {
  std::lock_guard<std::mutex> lock(queueMutex_);
  queue_.clear();
}

void TcpPath::controlLoop() {
  nameThisThread("reccl-path-ctl");
  const Millis interval(std::max<int64_t>(5, heartbeat_.count() / 4));
  const std::vector<uint8_t> heartbeat = encodeHeartbeat();
  Clock::time_point nextBeat = Clock::now();
  std::vector<uint8_t> body;
  IoWatch idle = watch(Millis(0));
  while (!stop_.load()) {
    Clock::time_point now = Clock::now();
    if (now >= nextBeat) {
      if (!blackholed() && !sendControl(heartbeat)) return;
      nextBeat = now + interval;
    }
    int64_t silentNs = nowNs() - lastHeardNs_.load();
    if (silentNs > heartbeat_.count() * 1000000LL) {
      fail(Reason::kTimeout, "no heartbeat from " + peer_ + " for " +
                                 std::to_string(silentNs / 1000000) + " ms");
      return;
    }
    if (blackholed()) {
      std::this_thread::sleep_for(Millis(10));
      continue;
    }
    // Sleep until the next heartbeat is due or the peer's silence would fail
    // the path, whichever is first; a frame, or shutdown() closing the socket,
    // wakes it at once. No fixed polling slice: an idle path wakes ~1/interval.
    const int64_t beatInMs =
        std::chrono::duration_cast<Millis>(nextBeat - Clock::now()).count();
    const int64_t silenceInMs =
        (heartbeat_.count() * 1000000LL - (nowNs() - lastHeardNs_.load())) / 1000000 + 1;
    const int timeoutMs =
        static_cast<int>(std::clamp<int64_t>(std::min(beatInMs, silenceInMs), 1, interval.count()));
    pollfd pfd{control_.get(), POLLIN, 0};
    int ready = ::poll(&pfd, 1, timeoutMs);
    if (ready <= 0) continue;
    FrameHeader header{};
    IoResult result = recvAll(control_.get(), &header, sizeof(header), idle, heartbeat_);
    try {
      if (!result.ok()) {
        fail(result.code == IoCode::kStalled ? Reason::kTimeout : Reason::kError,
             "control read from " + peer_ + ": " + result.describe());
        return;
      }
      header = parseFrameHeader(reinterpret_cast<const uint8_t*>(&header), sizeof(header));
      body.resize(header.bodyBytes);
      if (header.bodyBytes > 0) {
        result = recvAll(control_.get(), body.data(), body.size(), watch(heartbeat_), heartbeat_);
        if (!result.ok()) {
          fail(Reason::kError, "control read from " + peer_ + ": " + result.describe());
          return;
        }
      }
      lastHeardNs_.store(nowNs());
      ControlFrame frame = decodeControl(header, body.data(), body.size());
      if (frame.type == FrameType::kHeartbeat) continue;
      owner_->onControl(pathId_, frame);
    } catch (const ProtocolError& error) {
      RECCL_LOG(kWarn, std::string("protocol error from ") + peer_ + ": " + error.what());
      fail(Reason::kError, std::string("protocol error: ") + error.what());
      return;
    }
  }
}

void TcpPath::writerLoop(size_t index) {
  nameThisThread("reccl-path-data");
  const int fd = data_[index].get();
  const FrameHeader frameHeader = dataFrameHeader();
  while (!stop_.load()) {
    DataChunk chunk{};
    {
      std::unique_lock<std::mutex> lock(queueMutex_);
      // No timeout: sendData() and shutdown() notify, so an idle writer never wakes.
      queueCv_.wait(lock, [&] { return stop_.load() || !queue_.empty(); });
      if (stop_.load()) return;
      chunk = queue_.front();
      queue_.pop_front();
    }
    uint8_t head[sizeof(FrameHeader) + sizeof(DataHeader)];
    std::memcpy(head, &frameHeader, sizeof(frameHeader));
    std::memcpy(head + sizeof(frameHeader), &chunk.header, sizeof(chunk.header));
    // MSG_MORE only when a payload follows: a corked header with nothing after it
    // waits for the peer's next (delayed) ACK or the 200 ms cork timer.
    const int headFlags = chunk.header.bytes > 0 ? MSG_MORE : 0;
    IoResult result = sendAll(fd, head, sizeof(head), watch(dataStallLimit_), headFlags);
    if (result.ok() && chunk.header.bytes > 0) {
      result = sendAll(fd, chunk.payload, chunk.header.bytes, watch(dataStallLimit_));
    }
    if (!result.ok()) {
      fail(result.code == IoCode::kStalled ? Reason::kTimeout : Reason::kError,
           "data write to " + peer_ + ": " + result.describe());
      return;
    }
  }
}

void TcpPath::readerLoop(size_t index) {
  nameThisThread("reccl-path-data");
  const int fd = data_[index].get();
  std::vector<uint8_t> scratch(64 << 10);
  IoWatch idle = watch(Millis(0));
  idle.progressNs = &lastHeardNs_;
  IoWatch busy = watch(dataStallLimit_);
  busy.progressNs = &lastHeardNs_;
  while (!stop_.load()) {
    uint8_t head[sizeof(FrameHeader) + sizeof(DataHeader)];
    IoResult result = recvAll(fd, head, sizeof(head), idle, dataStallLimit_);
    if (!result.ok()) {
      fail(result.code == IoCode::kStalled ? Reason::kTimeout : Reason::kError,
           "data read from " + peer_ + ": " + result.describe());
      return;
    }
    DataHeader header{};
    uint8_t* target = nullptr;
    try {
      FrameHeader frameHeader = parseFrameHeader(head, sizeof(FrameHeader));
      if (frameHeader.type != static_cast<uint8_t>(FrameType::kData)) {
        throw ProtocolError(std::string(frameTypeName(static_cast<FrameType>(frameHeader.type))) +
                            " frame on a data socket");
      }
      std::memcpy(&header, head + sizeof(FrameHeader), sizeof(header));
      if (header.bytes > kMaxChunkBytes) {
        throw ProtocolError("DATA chunk of " + std::to_string(header.bytes) +
                            " bytes; chunks are at most " + std::to_string(kMaxChunkBytes));
      }
      target = owner_->beginData(pathId_, header, false);
    } catch (const ProtocolError& error) {
      RECCL_LOG(kWarn, std::string("protocol error from ") + peer_ + ": " + error.what());
      fail(Reason::kError, std::string("protocol error: ") + error.what());
      return;
    }
    if (target != nullptr) {
      result = recvAll(fd, target, header.bytes, busy, dataStallLimit_);
      owner_->endData(pathId_, header, result.ok());
    } else {
      // Stale or duplicate: read and drop, keeping the stream in frame.
      uint64_t left = header.bytes;
      while (left > 0 && result.ok()) {
        size_t step = static_cast<size_t>(std::min<uint64_t>(left, scratch.size()));
        result = recvAll(fd, scratch.data(), step, busy, dataStallLimit_);
        left -= step;
      }
    }
    if (!result.ok()) {
      fail(result.code == IoCode::kStalled ? Reason::kTimeout : Reason::kError,
           "data read from " + peer_ + ": " + result.describe());
      return;
    }
  }
}

}  // namespace reccl
