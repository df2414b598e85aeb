#include "transport/hello_dial.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace reccl {

namespace {

constexpr size_t kAckBytes = sizeof(FrameHeader) + sizeof(HelloAckBody);

enum class Stage { kConnecting, kSending, kAwaitingAck, kDone };

struct Handshake {
  Fd fd;
  Stage stage = Stage::kConnecting;
  std::vector<uint8_t> hello;
  size_t sent = 0;
  uint8_t ack[kAckBytes] = {};
  size_t received = 0;
};

bool transient(int error) { return error == EAGAIN || error == EWOULDBLOCK || error == EINTR; }

}  // namespace

std::vector<Fd> dialWithHellos(const std::string& localAddress, const HandleEndpoint& remote,
                               const std::vector<HelloBody>& hellos, Millis timeout,
                               PathFailure* failure, uint64_t* acceptorTransport,
                               bool* sameHostReads) {
  const Clock::time_point deadline = Clock::now() + timeout;
  // Once a socket is connected a live process accepted it: whatever the
  // listener then does (a close, a reset: wrong secret, NIC down, an unknown
  // connection, too many handshakes at once) is a live process answering, never
  // the peer's host answering for a dead one. Only a refused connect says that.
  auto fail = [&](const std::string& why) {
    *failure = {"handshake with " + remote.address + ": " + why, false};
    return std::vector<Fd>{};
  };
  std::vector<Handshake> shakes(hellos.size());
  for (size_t i = 0; i < hellos.size(); ++i) {
    shakes[i].fd = startConnect(localAddress, remote.address, remote.port, failure);
    if (!shakes[i].fd.valid()) return {};
    shakes[i].hello = encodeHello(hellos[i]);
  }
  size_t done = 0;
  std::vector<pollfd> polled;
  std::vector<Handshake*> owners;
  while (done < shakes.size()) {
    polled.clear();
    owners.clear();
    for (auto& shake : shakes) {
      if (shake.stage == Stage::kDone) continue;
      polled.push_back({shake.fd.get(),
                        static_cast<short>(shake.stage == Stage::kAwaitingAck ? POLLIN : POLLOUT),
                        0});
      owners.push_back(&shake);
    }
    const int64_t leftMs = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
    if (leftMs < 0) return fail("no answer within " + std::to_string(timeout.count()) + " ms");
    const int ready = ::poll(polled.data(), polled.size(), static_cast<int>(leftMs) + 1);
    if (ready < 0 && errno != EINTR) return fail(std::string("poll: ") + std::strerror(errno));
    for (size_t k = 0; k < polled.size() && ready > 0; ++k) {
      if (polled[k].revents == 0) continue;
      Handshake& shake = *owners[k];
      if (shake.stage == Stage::kConnecting) {
        if (!finishConnect(shake.fd.get(), localAddress, remote.address, remote.port, failure)) {
          return {};
        }
        shake.stage = Stage::kSending;
      }
      if (shake.stage == Stage::kSending) {
        const ssize_t sent = ::send(shake.fd.get(), shake.hello.data() + shake.sent,
                                    shake.hello.size() - shake.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent < 0) {
          if (transient(errno)) continue;
          return fail(describeSocketError(errno));
        }
        shake.sent += static_cast<size_t>(sent);
        if (shake.sent == shake.hello.size()) shake.stage = Stage::kAwaitingAck;
        continue;
      }
      const ssize_t got = ::recv(shake.fd.get(), shake.ack + shake.received,
                                 kAckBytes - shake.received, MSG_DONTWAIT);
      if (got == 0) {
        return fail(
            "refused by the listener (wrong secret, closed listener or unknown connection)");
      }
      if (got < 0) {
        if (transient(errno)) continue;
        return fail(describeSocketError(errno));
      }
      shake.received += static_cast<size_t>(got);
      if (shake.received < kAckBytes) continue;
      try {
        FrameHeader header = parseFrameHeader(shake.ack, kAckBytes);
        ControlFrame ack =
            decodeControl(header, shake.ack + sizeof(FrameHeader), sizeof(HelloAckBody));
        if (ack.type != FrameType::kHelloAck || !ack.helloAccepted) {
          throw ProtocolError("handshake not accepted");
        }
        if (acceptorTransport != nullptr) *acceptorTransport = ack.helloAcceptorTransport;
        if (sameHostReads != nullptr && &shake == &shakes.front()) {
          *sameHostReads = ack.helloSameHostReads;
        }
      } catch (const ProtocolError& e) {
        return fail(e.what());
      }
      shake.stage = Stage::kDone;
      ++done;
    }
  }
  std::vector<Fd> sockets;
  for (auto& shake : shakes) sockets.push_back(std::move(shake.fd));
  return sockets;
}

Fd dialWithHello(const std::string& localAddress, const HandleEndpoint& remote,
                 const HelloBody& hello, Millis timeout, PathFailure* failure,
                 uint64_t* acceptorTransport) {
  std::vector<Fd> sockets =
      dialWithHellos(localAddress, remote, {hello}, timeout, failure, acceptorTransport);
  return sockets.empty() ? Fd() : std::move(sockets.front());
}

}  // namespace reccl
