#include "core/frame.h"

#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace reccl {

const char* frameTypeName(FrameType type) {
  switch (type) {
    case FrameType::kHello: return "HELLO";
    case FrameType::kHelloAck: return "HELLO_ACK";
    case FrameType::kCts: return "CTS";
    case FrameType::kAck: return "ACK";
    case FrameType::kActivate: return "ACTIVATE";
    case FrameType::kResync: return "RESYNC";
    case FrameType::kNotify: return "NOTIFY";
    case FrameType::kHeartbeat: return "HEARTBEAT";
    case FrameType::kData: return "DATA";
    case FrameType::kClose: return "CLOSE";
    case FrameType::kCancel: return "CANCEL";
    case FrameType::kPlace: return "PLACE";
    case FrameType::kDataRef: return "DATA_REF";
  }
  return "UNKNOWN";
}

namespace {

// Exact body size for fixed-size types; 0 for variable (Resync).
bool fixedBodySize(FrameType type, size_t* size) {
  switch (type) {
    case FrameType::kHello: *size = sizeof(HelloBody); return true;
    case FrameType::kHelloAck: *size = sizeof(HelloAckBody); return true;
    case FrameType::kCts: *size = sizeof(CtsBody); return true;
    case FrameType::kAck: *size = sizeof(AckBody); return true;
    case FrameType::kActivate: *size = sizeof(ActivateBody); return true;
    case FrameType::kNotify: *size = sizeof(NotifyBody); return true;
    case FrameType::kHeartbeat: *size = 0; return true;
    case FrameType::kClose: *size = 0; return true;
    case FrameType::kData: *size = sizeof(DataHeader); return true;
    case FrameType::kCancel: *size = sizeof(CancelBody); return true;
    case FrameType::kPlace: *size = sizeof(PlaceBody); return true;
    case FrameType::kDataRef: *size = sizeof(DataRefBody); return true;
    case FrameType::kResync: return false;
  }
  return false;
}

bool knownType(uint8_t type) {
  return type >= static_cast<uint8_t>(FrameType::kHello) &&
         type <= static_cast<uint8_t>(FrameType::kDataRef);
}

std::vector<uint8_t> frame(FrameType type, const void* body, size_t bodyBytes) {
  std::vector<uint8_t> out(sizeof(FrameHeader) + bodyBytes);
  FrameHeader header{};
  header.magic = kFrameMagic;
  header.type = static_cast<uint8_t>(type);
  header.bodyBytes = static_cast<uint32_t>(bodyBytes);
  std::memcpy(out.data(), &header, sizeof(header));
  if (bodyBytes > 0) std::memcpy(out.data() + sizeof(header), body, bodyBytes);
  return out;
}

template <typename T>
T readBody(const uint8_t* body) {
  T value;
  std::memcpy(&value, body, sizeof(T));
  return value;
}

}  // namespace

FrameHeader parseFrameHeader(const uint8_t* bytes, size_t length) {
  if (length < sizeof(FrameHeader)) {
    throw ProtocolError("truncated frame header: " + std::to_string(length) + " of " +
                        std::to_string(sizeof(FrameHeader)) + " bytes");
  }
  FrameHeader header = readBody<FrameHeader>(bytes);
  if (header.magic != kFrameMagic) {
    throw ProtocolError("bad frame magic 0x" + [&] {
      char text[16];
      std::snprintf(text, sizeof(text), "%08x", header.magic);
      return std::string(text);
    }() + ": not a reccl peer");
  }
  if (!knownType(header.type)) {
    throw ProtocolError("unknown frame type " + std::to_string(header.type) +
                        "; valid types are 1..13");
  }
  FrameType type = static_cast<FrameType>(header.type);
  size_t expected = 0;
  if (fixedBodySize(type, &expected)) {
    if (header.bodyBytes != expected) {
      throw ProtocolError(std::string(frameTypeName(type)) + " frame with a " +
                          std::to_string(header.bodyBytes) + "-byte body; expected " +
                          std::to_string(expected));
    }
  } else if (header.bodyBytes < sizeof(ResyncHeader) || header.bodyBytes > kMaxControlBody ||
             (header.bodyBytes - sizeof(ResyncHeader)) % sizeof(ResyncEntry) != 0) {
    throw ProtocolError("RESYNC frame with a " + std::to_string(header.bodyBytes) +
                        "-byte body; expected " + std::to_string(sizeof(ResyncHeader)) + " + n*" +
                        std::to_string(sizeof(ResyncEntry)) +
                        " with n <= " + std::to_string(kMaxOutstanding));
  }
  return header;
}

ControlFrame decodeControl(const FrameHeader& header, const uint8_t* body, size_t length) {
  if (length != header.bodyBytes) {
    throw ProtocolError("frame body of " + std::to_string(length) + " bytes; header says " +
                        std::to_string(header.bodyBytes));
  }
  ControlFrame out;
  out.type = static_cast<FrameType>(header.type);
  switch (out.type) {
    case FrameType::kHello:
      out.hello = readBody<HelloBody>(body);
      if (out.hello.version != kProtocolVersion) {
        throw ProtocolError("peer speaks protocol version " + std::to_string(out.hello.version) +
                            "; this library speaks " + std::to_string(kProtocolVersion));
      }
      if (out.hello.socketKind > static_cast<uint8_t>(SocketKind::kData) ||
          out.hello.socketCount == 0 || out.hello.socketCount > 16 ||
          (out.hello.socketKind == static_cast<uint8_t>(SocketKind::kData) &&
           out.hello.socketIndex >= out.hello.socketCount)) {
        throw ProtocolError("HELLO with an invalid socket kind/index/count");
      }
      out.hello.senderNicName[kNicNameBytes - 1] = '\0';
      break;
    case FrameType::kHelloAck: {
      const HelloAckBody ack = readBody<HelloAckBody>(body);
      out.helloAccepted = ack.accepted == 1;
      out.helloAcceptorTransport = ack.acceptorTransport;
      if (ack.sameHostReads > 1)
        throw ProtocolError("HELLO_ACK with same-host flag " + std::to_string(ack.sameHostReads) +
                            " (0 or 1)");
      out.helloSameHostReads = ack.sameHostReads == 1;
      break;
    }
    case FrameType::kCts: out.cts = readBody<CtsBody>(body); break;
    case FrameType::kAck: out.ack = readBody<AckBody>(body); break;
    case FrameType::kActivate: out.activate = readBody<ActivateBody>(body); break;
    case FrameType::kNotify: out.notify = readBody<NotifyBody>(body); break;
    case FrameType::kCancel: out.cancel = readBody<CancelBody>(body); break;
    case FrameType::kPlace:
      out.place = readBody<PlaceBody>(body);
      if (out.place.length == 0 || out.place.length > kMaxPlacementBytes ||
          out.place.hostAccessible > 1) {
        throw ProtocolError("PLACE with a " + std::to_string(out.place.length) +
                            "-byte placement (1.." + std::to_string(kMaxPlacementBytes) +
                            ") or host flag " + std::to_string(out.place.hostAccessible) +
                            " (0 or 1)");
      }
      break;
    case FrameType::kResync: {
      out.resync = readBody<ResyncHeader>(body);
      size_t count = (length - sizeof(ResyncHeader)) / sizeof(ResyncEntry);
      if (out.resync.count != count) {
        throw ProtocolError("RESYNC says " + std::to_string(out.resync.count) +
                            " entries but carries " + std::to_string(count));
      }
      out.entries.resize(count);
      if (count > 0) {
        std::memcpy(out.entries.data(), body + sizeof(ResyncHeader), count * sizeof(ResyncEntry));
      }
      break;
    }
    case FrameType::kHeartbeat:
    case FrameType::kClose: break;
    case FrameType::kData:
    case FrameType::kDataRef:
      throw ProtocolError(std::string(frameTypeName(out.type)) +
                          " frame where a control frame was expected");
  }
  return out;
}

std::vector<uint8_t> encodeHello(const HelloBody& body) {
  return frame(FrameType::kHello, &body, sizeof(body));
}
std::vector<uint8_t> encodeHelloAck(bool accepted, uint64_t acceptorTransport, bool sameHostReads) {
  HelloAckBody body{static_cast<uint8_t>(accepted ? 1 : 0), acceptorTransport,
                    static_cast<uint8_t>(sameHostReads ? 1 : 0)};
  return frame(FrameType::kHelloAck, &body, sizeof(body));
}
std::vector<uint8_t> encodeCts(uint64_t seq, uint64_t bytes) {
  CtsBody body{seq, bytes};
  return frame(FrameType::kCts, &body, sizeof(body));
}
std::vector<uint8_t> encodeAck(uint64_t seq, uint64_t bytes) {
  AckBody body{seq, bytes};
  return frame(FrameType::kAck, &body, sizeof(body));
}
std::vector<uint8_t> encodeActivate(uint64_t epoch, uint8_t pathIndex, uint8_t reason) {
  ActivateBody body{epoch, pathIndex, reason};
  return frame(FrameType::kActivate, &body, sizeof(body));
}
std::vector<uint8_t> encodeResync(uint64_t epoch, uint64_t nextSeq,
                                  const std::vector<ResyncEntry>& entries) {
  std::vector<uint8_t> body(sizeof(ResyncHeader) + entries.size() * sizeof(ResyncEntry));
  ResyncHeader header{epoch, nextSeq, static_cast<uint32_t>(entries.size())};
  std::memcpy(body.data(), &header, sizeof(header));
  if (!entries.empty()) {
    std::memcpy(body.data() + sizeof(header), entries.data(), entries.size() * sizeof(ResyncEntry));
  }
  return frame(FrameType::kResync, body.data(), body.size());
}
std::vector<uint8_t> encodeNotify(uint8_t pathIndex, uint8_t reason) {
  NotifyBody body{pathIndex, reason};
  return frame(FrameType::kNotify, &body, sizeof(body));
}
std::vector<uint8_t> encodeHeartbeat() { return frame(FrameType::kHeartbeat, nullptr, 0); }
std::vector<uint8_t> encodeClose() { return frame(FrameType::kClose, nullptr, 0); }
std::vector<uint8_t> encodeCancel(uint64_t seq, uint64_t bytes) {
  CancelBody body{seq, bytes};
  return frame(FrameType::kCancel, &body, sizeof(body));
}

std::vector<uint8_t> encodePlace(uint64_t seq, bool hostAccessible,
                                 const std::vector<uint8_t>& placement) {
  if (placement.empty() || placement.size() > kMaxPlacementBytes) {
    throw Error("a placement of " + std::to_string(placement.size()) + " bytes; 1.." +
                std::to_string(kMaxPlacementBytes) + " fit a PLACE frame");
  }
  PlaceBody body{};
  body.seq = seq;
  body.hostAccessible = hostAccessible ? 1 : 0;
  body.length = static_cast<uint8_t>(placement.size());
  std::memcpy(body.placement, placement.data(), placement.size());
  return frame(FrameType::kPlace, &body, sizeof(body));
}

namespace {
FrameHeader headerOf(FrameType type, size_t bodyBytes) {
  FrameHeader header{};
  header.magic = kFrameMagic;
  header.type = static_cast<uint8_t>(type);
  header.bodyBytes = static_cast<uint32_t>(bodyBytes);
  return header;
}
}  // namespace

FrameHeader dataFrameHeader() { return headerOf(FrameType::kData, sizeof(DataHeader)); }
FrameHeader dataRefFrameHeader() { return headerOf(FrameType::kDataRef, sizeof(DataRefBody)); }

}  // namespace reccl
