#include "transport/acceptor.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"
#include "core/thread_name.h"

namespace reccl {

namespace {
constexpr size_t kHelloFrameBytes = sizeof(FrameHeader) + sizeof(HelloBody);
constexpr size_t kMaxPending = 256;  // half-open handshakes held at once
constexpr Millis kRefusalLogInterval{10000};
}  // namespace

Acceptor::Acceptor(std::string address, std::string nicName, uint64_t transportId,
                   Millis handshakeTimeout, Authenticate authenticate, Admit admit)
    : address_(std::move(address)),
      nicName_(std::move(nicName)),
      transportId_(transportId),
      handshakeTimeout_(handshakeTimeout),
      authenticate_(std::move(authenticate)),
      admit_(std::move(admit)),
      refusals_(LogLevel::kWarn, kRefusalLogInterval, "refused connections on " + nicName_) {
  std::string error;
  listener_ = listenOn(address_, &port_, &error);
  if (!listener_.valid()) throw Error("cannot listen on NIC " + nicName_ + ": " + error);
  wake_ = makeWakeFd();
  thread_ = std::thread([this] { run(); });
}

Acceptor::~Acceptor() {
  stop_.store(true);
  signalWake(wake_.get());
  thread_.join();
}

void Acceptor::refuse(const Pending& pending, const char* kind, const std::string& why) {
  NicHealth& health = NicHealth::instance();
  health.countRejectedHandshake();
  refusals_.log(kind, "refused connection from " + pending.peer + " on " + nicName_ + ": " + why);
  Event event;
  event.kind = EventKind::kHandshakeRejected;
  event.reason = Reason::kError;
  event.nic = nicName_;
  event.peer = pending.peer;
  event.detail = why;
  health.emit(std::move(event));
}

bool Acceptor::advance(Pending& pending) {
  uint8_t buffer[kHelloFrameBytes];
  size_t want = kHelloFrameBytes - pending.bytes.size();
  ssize_t got = ::recv(pending.fd.get(), buffer, want, MSG_DONTWAIT);
  if (got == 0) {
    refuse(pending, "closed early", "closed before completing the handshake");
    return true;
  }
  if (got < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
    refuse(pending, "read error", std::string("read error: ") + std::strerror(errno));
    return true;
  }
  pending.bytes.insert(pending.bytes.end(), buffer, buffer + got);
  try {
    // Check the header as soon as it is there, so junk is refused early.
    if (pending.bytes.size() >= sizeof(FrameHeader)) {
      FrameHeader header = parseFrameHeader(pending.bytes.data(), pending.bytes.size());
      if (header.type != static_cast<uint8_t>(FrameType::kHello)) {
        throw ProtocolError(std::string("expected HELLO, got ") +
                            frameTypeName(static_cast<FrameType>(header.type)));
      }
    }
    if (pending.bytes.size() < kHelloFrameBytes) return false;
    FrameHeader header = parseFrameHeader(pending.bytes.data(), pending.bytes.size());
    ControlFrame hello =
        decodeControl(header, pending.bytes.data() + sizeof(FrameHeader), sizeof(HelloBody));
    Verdict verdict = authenticate_(hello.hello);
    if (verdict.kind == Verdict::kDecline) {
      RECCL_LOG(kInfo,
                "declined a path from " + pending.peer + " on " + nicName_ + ": " + verdict.why);
      return true;
    }
    if (verdict.kind == Verdict::kReject) {
      refuse(pending, "not authenticated", verdict.why);
      return true;
    }
    std::vector<uint8_t> ack = encodeHelloAck(true, transportId_, verdict.sameHostReads);
    IoWatch watch;
    watch.stallLimit = handshakeTimeout_;
    watch.stop = &stop_;
    if (!sendAll(pending.fd.get(), ack.data(), ack.size(), watch).ok()) {
      refuse(pending, "no answer sent", "could not answer the handshake");
      return true;
    }
    admit_(hello.hello, verdict, std::move(pending.fd), pending.peer);
  } catch (const ProtocolError& error) {
    refuse(pending, "malformed", std::string("malformed handshake: ") + error.what());
  }
  return true;
}

void Acceptor::run() {
  nameThisThread("reccl-accept");
  std::vector<Pending> pending;
  while (!stop_.load()) {
    std::vector<pollfd> fds;
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({listener_.get(), POLLIN, 0});
    for (const auto& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
    // Asleep until a peer connects or sends, a handshake's deadline passes or
    // the count of refusals held back from the log is due.
    int64_t timeoutMs = -1;
    auto until = [&](Clock::time_point when) {
      const int64_t left =
          std::max<int64_t>(0, std::chrono::duration_cast<Millis>(when - Clock::now()).count() + 1);
      timeoutMs = timeoutMs < 0 ? left : std::min(timeoutMs, left);
    };
    for (const auto& p : pending) until(p.deadline);
    const Clock::time_point summaryDue = refusals_.flushDue();
    if (summaryDue != Clock::time_point::max()) until(summaryDue);
    int ready = ::poll(fds.data(), fds.size(), static_cast<int>(timeoutMs));
    if (ready < 0 && errno != EINTR) {
      RECCL_LOG(kWarn, std::string("acceptor poll: ") + std::strerror(errno));
      continue;
    }
    std::vector<Pending> next;
    Clock::time_point now = Clock::now();
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      bool finished = false;
      if (fds[i + 2].revents != 0) finished = advance(p);
      if (!finished && now > p.deadline) {
        refuse(p, "timed out",
               "no handshake within " + std::to_string(handshakeTimeout_.count()) + " ms");
        finished = true;
      }
      if (!finished) next.push_back(std::move(p));
    }
    pending = std::move(next);
    if (fds[1].revents & POLLIN) {
      for (;;) {
        int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        Pending p;
        p.fd = Fd(fd);
        p.peer = peerAddress(fd);
        p.deadline = now + handshakeTimeout_;
        if (pending.size() >= kMaxPending) {
          refuse(p, "too many at once", "too many handshakes in progress");
          continue;
        }
        pending.push_back(std::move(p));
      }
    }
  }
}

}  // namespace reccl
