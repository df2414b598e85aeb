// Fuzzes the frame parser (core/frame.h) on a byte stream as a peer sends it on
// a control socket: header, body, header, body... Every control type, HELLO and
// HELLO_ACK included, goes through parseFrameHeader and decodeControl; a DATA or
// DATA_REF header is followed by its DataHeader as on a data socket.
// Properties: only ProtocolError escapes; every accepted control frame
// re-encodes (with the encoders of frame.h) to bytes that decode to the same
// frame, and for the types whose every byte is meaningful to exactly the input.
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/frame.h"
#include "fuzz_check.h"

namespace {

using reccl::ControlFrame;
using reccl::FrameHeader;
using reccl::FrameType;

std::vector<uint8_t> encode(const ControlFrame& frame) {
  switch (frame.type) {
    case FrameType::kHello: return reccl::encodeHello(frame.hello);
    case FrameType::kHelloAck:
      return reccl::encodeHelloAck(frame.helloAccepted, frame.helloAcceptorTransport,
                                   frame.helloSameHostReads);
    case FrameType::kCts: return reccl::encodeCts(frame.cts.seq, frame.cts.bytes);
    case FrameType::kAck: return reccl::encodeAck(frame.ack.seq, frame.ack.bytes);
    case FrameType::kActivate:
      return reccl::encodeActivate(frame.activate.epoch, frame.activate.pathIndex,
                                   frame.activate.reason);
    case FrameType::kResync:
      return reccl::encodeResync(frame.resync.epoch, frame.resync.nextSeq, frame.entries);
    case FrameType::kNotify:
      return reccl::encodeNotify(frame.notify.pathIndex, frame.notify.reason);
    case FrameType::kHeartbeat: return reccl::encodeHeartbeat();
    case FrameType::kClose: return reccl::encodeClose();
    case FrameType::kCancel: return reccl::encodeCancel(frame.cancel.seq, frame.cancel.bytes);
    case FrameType::kPlace:
      return reccl::encodePlace(frame.place.seq, frame.place.hostAccessible == 1,
                                std::vector<uint8_t>(frame.place.placement,
                                                     frame.place.placement + frame.place.length));
    case FrameType::kData:
    case FrameType::kDataRef: break;
  }
  FUZZ_CHECK(!"a data frame came out of decodeControl");
  return {};
}

// Decodes what an encoder made: that must never be refused.
ControlFrame decodeWhole(const std::vector<uint8_t>& bytes) {
  try {
    const FrameHeader header = reccl::parseFrameHeader(bytes.data(), bytes.size());
    FUZZ_CHECK(bytes.size() == sizeof(FrameHeader) + header.bodyBytes);
    return reccl::decodeControl(header, bytes.data() + sizeof(FrameHeader), header.bodyBytes);
  } catch (const reccl::ProtocolError& error) {
    std::fprintf(stderr, "an encoder's frame was refused: %s\n", error.what());
    std::abort();
  }
}

bool sameFrame(const ControlFrame& a, const ControlFrame& b) {
  if (a.type != b.type) return false;
  switch (a.type) {
    case FrameType::kHello: return std::memcmp(&a.hello, &b.hello, sizeof(a.hello)) == 0;
    case FrameType::kHelloAck:
      return a.helloAccepted == b.helloAccepted &&
             a.helloAcceptorTransport == b.helloAcceptorTransport &&
             a.helloSameHostReads == b.helloSameHostReads;
    case FrameType::kCts: return a.cts.seq == b.cts.seq && a.cts.bytes == b.cts.bytes;
    case FrameType::kAck: return a.ack.seq == b.ack.seq && a.ack.bytes == b.ack.bytes;
    case FrameType::kActivate:
      return std::memcmp(&a.activate, &b.activate, sizeof(a.activate)) == 0;
    case FrameType::kResync:
      return std::memcmp(&a.resync, &b.resync, sizeof(a.resync)) == 0 &&
             a.entries.size() == b.entries.size() &&
             (a.entries.empty() || std::memcmp(a.entries.data(), b.entries.data(),
                                               a.entries.size() * sizeof(a.entries[0])) == 0);
    case FrameType::kNotify: return std::memcmp(&a.notify, &b.notify, sizeof(a.notify)) == 0;
    case FrameType::kCancel:
      return a.cancel.seq == b.cancel.seq && a.cancel.bytes == b.cancel.bytes;
    case FrameType::kPlace:
      return a.place.seq == b.place.seq && a.place.hostAccessible == b.place.hostAccessible &&
             a.place.length == b.place.length &&
             std::memcmp(a.place.placement, b.place.placement, a.place.length) == 0;
    default: return true;
  }
}

// Types whose encoding carries no reserved or padding bytes: the input itself
// is the only encoding of what it says.
bool canonical(FrameType type) {
  switch (type) {
    case FrameType::kCts:
    case FrameType::kAck:
    case FrameType::kActivate:
    case FrameType::kResync:
    case FrameType::kNotify:
    case FrameType::kHeartbeat:
    case FrameType::kClose:
    case FrameType::kCancel: return true;
    default: return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  size_t at = 0;
  while (at < size) {
    try {
      const FrameHeader header = reccl::parseFrameHeader(data + at, size - at);
      const uint8_t* body = data + at + sizeof(FrameHeader);
      const size_t available = size - at - sizeof(FrameHeader);
      if (header.bodyBytes > available) return 0;  // the rest has not arrived
      if (header.type == static_cast<uint8_t>(FrameType::kData) ||
          header.type == static_cast<uint8_t>(FrameType::kDataRef)) {
        reccl::DataHeader chunk;
        std::memcpy(&chunk, body, sizeof(chunk));  // the sizes parseFrameHeader vouched for
        FUZZ_CHECK(header.bodyBytes >= sizeof(chunk));
      } else {
        const ControlFrame frame = reccl::decodeControl(header, body, header.bodyBytes);
        const std::vector<uint8_t> again = encode(frame);
        FUZZ_CHECK(sameFrame(decodeWhole(again), frame));
        if (canonical(frame.type)) {
          FUZZ_CHECK(again.size() == sizeof(FrameHeader) + header.bodyBytes);
          FUZZ_CHECK(std::memcmp(again.data() + sizeof(FrameHeader), body, header.bodyBytes) == 0);
        }
      }
      at += sizeof(FrameHeader) + header.bodyBytes;
    } catch (const reccl::ProtocolError&) {
      return 0;  // the connection would fail here; nothing after it is read
    }
  }
  return 0;
}
