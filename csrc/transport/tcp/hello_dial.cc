#include "transport/tcp/hello_dial.h"

#include "core/error.h"

namespace reccl {

Fd dialWithHello(const std::string& localAddress, const HandleEndpoint& remote,
                 const HelloBody& hello, Millis timeout, std::string* error,
                 uint64_t* acceptorTransport) {
  Fd fd = connectFrom(localAddress, remote.address, remote.port, timeout, error);
  if (!fd.valid()) return fd;
  IoWatch watch;
  watch.stallLimit = timeout;
  std::vector<uint8_t> frame = encodeHello(hello);
  IoResult result = sendAll(fd.get(), frame.data(), frame.size(), watch);
  uint8_t reply[sizeof(FrameHeader) + sizeof(HelloAckBody)];
  if (result.ok()) result = recvAll(fd.get(), reply, sizeof(reply), watch, timeout);
  if (!result.ok()) {
    *error = "handshake with " + remote.address + ": " +
             (result.code == IoCode::kEof ? "refused by the listener (wrong secret, closed "
                                            "listener or unknown connection)"
                                          : result.describe());
    return Fd();
  }
  try {
    FrameHeader header = parseFrameHeader(reply, sizeof(reply));
    ControlFrame ack = decodeControl(header, reply + sizeof(FrameHeader), sizeof(HelloAckBody));
    if (ack.type != FrameType::kHelloAck || !ack.helloAccepted) {
      throw ProtocolError("handshake not accepted");
    }
    if (acceptorTransport != nullptr) *acceptorTransport = ack.helloAcceptorTransport;
  } catch (const ProtocolError& e) {
    *error = "handshake with " + remote.address + ": " + e.what();
    return Fd();
  }
  return fd;
}

}  // namespace reccl
