// Sockets, shared by the transports (TCP paths, the IB bootstrap, the acceptor,
// the event loops' wake fds): an owning fd, bounded connects, and whole-buffer
// I/O that returns promptly when the path is stopped and reports a stall when no
// byte moves for too long (a silent drop looks exactly like that).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/clock.h"
#include "core/path.h"

namespace reccl {

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = other.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset();

 private:
  int fd_ = -1;
};

enum class IoCode { kOk, kEof, kError, kStopped, kStalled };

struct IoResult {
  IoCode code = IoCode::kOk;
  int error = 0;  // errno for kError
  bool ok() const { return code == IoCode::kOk; }
  std::string describe() const;
};

// A socket error in words: errno, or 0 for an end of stream.
std::string describeSocketError(int error);
// Whether a socket error (errno, or 0 for an end of stream) is the peer's host
// answering for the peer: a refused connection, a reset, a broken pipe or an
// end of stream (PathFailure::peerHostAnswered). Handshakes count only a refused
// connect: a connected socket was accepted by a live process.
bool answeredByPeerHost(int error);

// What a blocking transfer (a handshake; paths use the event loops) watches
// besides the socket.
struct IoWatch {
  const std::atomic<bool>* stop = nullptr;
  Millis stallLimit{0};         // 0 = wait for the first byte indefinitely (idle is fine)
};

IoResult sendAll(int fd, const void* data, size_t bytes, const IoWatch& watch, int flags = 0);
// With watch.stallLimit == 0 the wait for the first byte is unbounded but still
// returns on stop; once a byte arrives the stall limit `midFrameLimit` applies.
IoResult recvAll(int fd, void* data, size_t bytes, const IoWatch& watch, Millis midFrameLimit);

// Starts a non-blocking TCP connection from `localAddress` to `address:port`:
// the socket is writable once it is up (then finishConnect says how it went).
// An invalid Fd and the reason in `error` when it cannot even start.
Fd startConnect(const std::string& localAddress, const std::string& address, uint16_t port,
                PathFailure* failure);
// After a started connection turned writable: true when it is up (and sets
// TCP_NODELAY), else false with the reason in `error`.
bool finishConnect(int fd, const std::string& localAddress, const std::string& address,
                   uint16_t port, PathFailure* failure);
// A listening socket on `address` (port 0 = any); fills the chosen port.
Fd listenOn(const std::string& address, uint16_t* port, std::string* error);
void setNoDelay(int fd);
// An eventfd another thread signals to end a poll() that has no timeout, so a
// thread waiting for rare events (connections, link changes) never wakes idle.
Fd makeWakeFd();
void signalWake(int fd);
void setNonBlocking(int fd, bool on);
std::string peerAddress(int fd);

}  // namespace reccl
