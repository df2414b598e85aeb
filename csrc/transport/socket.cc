#include "transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace reccl {

namespace {
constexpr int kPollSliceMs = 50;  // how often a blocked transfer rechecks stop and its limit
// A wait with no stall limit has only `stop` to recheck (shutdown() wakes it anyway).
constexpr int kIdlePollSliceMs = 250;

bool parseAddress(const std::string& address, uint16_t port, sockaddr_in* out) {
  std::memset(out, 0, sizeof(*out));
  out->sin_family = AF_INET;
  out->sin_port = htons(port);
  return inet_pton(AF_INET, address.c_str(), &out->sin_addr) == 1;
}

// Waits for `events` in slices; kOk when ready.
IoResult waitReady(int fd, short events, const IoWatch& watch, Millis limit,
                   Clock::time_point* lastProgress) {
  for (;;) {
    if (watch.stop != nullptr && watch.stop->load()) return {IoCode::kStopped, 0};
    if (limit.count() > 0 && Clock::now() - *lastProgress > limit) return {IoCode::kStalled, 0};
    const int slice = limit.count() > 0 ? kPollSliceMs : kIdlePollSliceMs;
    pollfd pfd{fd, events, 0};
    int ready = ::poll(&pfd, 1, slice);
    if (ready > 0) return {IoCode::kOk, 0};
    if (ready < 0 && errno != EINTR) return {IoCode::kError, errno};
  }
}
}  // namespace

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string describeSocketError(int error) {
  return error == 0 ? "connection closed by peer" : std::strerror(error);
}

bool answeredByPeerHost(int error) {
  return error == 0 || error == ECONNREFUSED || error == ECONNRESET || error == EPIPE;
}

std::string IoResult::describe() const {
  switch (code) {
    case IoCode::kOk: return "ok";
    case IoCode::kEof: return describeSocketError(0);
    case IoCode::kError: return describeSocketError(error);
    case IoCode::kStopped: return "stopped";
    case IoCode::kStalled: return "no progress (stalled)";
  }
  return "?";
}

IoResult sendAll(int fd, const void* data, size_t bytes, const IoWatch& watch, int flags) {
  const auto* cursor = static_cast<const uint8_t*>(data);
  Clock::time_point lastProgress = Clock::now();
  while (bytes > 0) {
    if (watch.stop != nullptr && watch.stop->load()) return {IoCode::kStopped, 0};
    // Try first and poll only when the socket is full: the common case is one syscall.
    ssize_t sent = ::send(fd, cursor, bytes, MSG_NOSIGNAL | MSG_DONTWAIT | flags);
    if (sent < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return {IoCode::kError, errno};
      IoResult ready = waitReady(fd, POLLOUT, watch, watch.stallLimit, &lastProgress);
      if (!ready.ok()) return ready;
      continue;
    }
    cursor += sent;
    bytes -= static_cast<size_t>(sent);
    lastProgress = Clock::now();
  }
  return {};
}

IoResult recvAll(int fd, void* data, size_t bytes, const IoWatch& watch, Millis midFrameLimit) {
  auto* cursor = static_cast<uint8_t*>(data);
  Clock::time_point lastProgress = Clock::now();
  Millis limit = watch.stallLimit;
  while (bytes > 0) {
    if (watch.stop != nullptr && watch.stop->load()) return {IoCode::kStopped, 0};
    ssize_t got = ::recv(fd, cursor, bytes, MSG_DONTWAIT);
    if (got == 0) return {IoCode::kEof, 0};
    if (got < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return {IoCode::kError, errno};
      IoResult ready = waitReady(fd, POLLIN, watch, limit, &lastProgress);
      if (!ready.ok()) return ready;
      continue;
    }
    cursor += got;
    bytes -= static_cast<size_t>(got);
    lastProgress = Clock::now();
    limit = midFrameLimit;
  }
  return {};
}

namespace {
std::string connectLabel(const std::string& localAddress, const std::string& address,
                         uint16_t port) {
  return "connect " + localAddress + "->" + address + ":" + std::to_string(port);
}
}  // namespace

Fd startConnect(const std::string& localAddress, const std::string& address, uint16_t port,
                PathFailure* failure) {
  sockaddr_in local{}, remote{};
  if (!parseAddress(localAddress, 0, &local) || !parseAddress(address, port, &remote)) {
    *failure = {"bad IPv4 address " + localAddress + " or " + address};
    return Fd();
  }
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) {
    *failure = {std::string("socket: ") + std::strerror(errno)};
    return Fd();
  }
  // Bound to the NIC's address (so the path leaves by that NIC) but without
  // reserving a port: the kernel picks it at connect() from the full 4-tuple,
  // so a rank with thousands of outgoing sockets does not run out of
  // ephemeral ports. Best effort: older kernels reserve one at bind() as before.
  const int noPort = 1;
  ::setsockopt(fd.get(), IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &noPort, sizeof(noPort));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0) {
    *failure = {"bind to " + localAddress + ": " + std::strerror(errno)};
    return Fd();
  }
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&remote), sizeof(remote)) != 0 &&
      errno != EINPROGRESS) {
    const int error = errno;
    *failure = {connectLabel(localAddress, address, port) + ": " + std::strerror(error),
                answeredByPeerHost(error), error == ECONNREFUSED};
    return Fd();
  }
  return fd;
}

bool finishConnect(int fd, const std::string& localAddress, const std::string& address,
                   uint16_t port, PathFailure* failure) {
  int soError = 0;
  socklen_t len = sizeof(soError);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soError, &len) != 0) soError = errno;
  if (soError != 0) {
    *failure = {connectLabel(localAddress, address, port) + ": " + std::strerror(soError),
                answeredByPeerHost(soError), soError == ECONNREFUSED};
    return false;
  }
  setNoDelay(fd);
  return true;
}

Fd listenOn(const std::string& address, uint16_t* port, std::string* error) {
  sockaddr_in local{};
  if (!parseAddress(address, *port, &local)) {
    *error = "bad IPv4 address " + address;
    return Fd();
  }
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0 ||
      ::listen(fd.get(), 512) != 0) {
    *error = "listen on " + address + ": " + std::strerror(errno);
    return Fd();
  }
  socklen_t len = sizeof(local);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len);
  *port = ntohs(local.sin_port);
  setNonBlocking(fd.get(), true);
  return fd;
}

void setNoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void setNonBlocking(int fd, bool on) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

std::string peerAddress(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &addr.sin_addr, text, sizeof(text));
  return std::string(text) + ":" + std::to_string(ntohs(addr.sin_port));
}

Fd makeWakeFd() {
  Fd fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!fd.valid()) throw Error(std::string("eventfd: ") + std::strerror(errno));
  return fd;
}

void signalWake(int fd) {
  const uint64_t one = 1;
  ssize_t written = ::write(fd, &one, sizeof(one));
  (void)written;  // EAGAIN: already signalled
}

}  // namespace reccl
