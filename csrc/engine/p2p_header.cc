#include "engine/p2p_header.h"

#include <cstring>
#include <string>

#include "core/error.h"

namespace reccl {

namespace {

constexpr uint32_t kP2pMagic = 0x50434552;  // "RECP" little-endian
constexpr uint8_t kP2pVersion = 1;

#pragma pack(push, 1)
struct WireP2pHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t dtype;
  uint16_t reserved0;
  int32_t tag;
  int32_t sender;
  uint64_t count;
  uint64_t bytes;
  uint8_t reserved[32];
};
#pragma pack(pop)
static_assert(sizeof(WireP2pHeader) == kP2pHeaderBytes, "p2p header is 64 bytes");

}  // namespace

void encodeP2pHeader(const P2pMessage& message, uint8_t* out) {
  WireP2pHeader wire{};
  wire.magic = kP2pMagic;
  wire.version = kP2pVersion;
  wire.dtype = static_cast<uint8_t>(message.dtype);
  wire.tag = message.tag;
  wire.sender = message.sender;
  wire.count = message.count;
  wire.bytes = message.bytes;
  std::memcpy(out, &wire, sizeof(wire));
}

P2pMessage decodeP2pHeader(const uint8_t* bytes, size_t length) {
  if (length != kP2pHeaderBytes) {
    throw ProtocolError("header of " + std::to_string(length) + " bytes, expected " +
                        std::to_string(kP2pHeaderBytes));
  }
  WireP2pHeader wire;
  std::memcpy(&wire, bytes, sizeof(wire));
  if (wire.magic != kP2pMagic || wire.version != kP2pVersion || !isValidDataType(wire.dtype)) {
    throw ProtocolError("malformed message header (the peer is out of step)");
  }
  P2pMessage out;
  out.tag = wire.tag;
  out.sender = wire.sender;
  out.dtype = static_cast<DataType>(wire.dtype);
  out.count = wire.count;
  out.bytes = wire.bytes;
  return out;
}

}  // namespace reccl
