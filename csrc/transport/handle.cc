#include "transport/handle.h"

#include <arpa/inet.h>

#include <cstring>

#include "core/error.h"

namespace reccl {

namespace {
constexpr uint32_t kHandleMagic = 0x48434552;  // "RECH"

#pragma pack(push, 1)
struct WireHandle {
  uint32_t magic;
  uint16_t version;
  uint8_t nicCount;
  uint8_t listenerNic;
  uint8_t listenerBackup;  // 0xff: none
  uint8_t reserved[3];
  uint64_t listenId;
  uint8_t secret[kSecretBytes];
  uint32_t chunkBytes;
  struct {
    uint32_t ipv4;  // network order
    uint16_t port;  // host order
  } nics[kMaxHandleNics];
};
#pragma pack(pop)
static_assert(sizeof(WireHandle) == kHandleWireBytes, "handle wire size");
static_assert(kHandleWireBytes <= kHandleBytes, "handle must fit NCCL's 128 bytes");
static_assert(offsetof(WireHandle, listenId) == 12 && offsetof(WireHandle, nics) == 40,
              "handle layout");
}  // namespace

std::vector<uint8_t> encodeHandle(const ListenHandle& handle) {
  if (handle.nics.empty() || handle.nics.size() > kMaxHandleNics) {
    throw Error("a handle carries 1.." + std::to_string(kMaxHandleNics) + " NICs, not " +
                std::to_string(handle.nics.size()));
  }
  WireHandle wire{};
  wire.magic = kHandleMagic;
  wire.version = kProtocolVersion;
  wire.nicCount = static_cast<uint8_t>(handle.nics.size());
  wire.listenerNic = static_cast<uint8_t>(handle.listenerNic);
  wire.listenerBackup =
      handle.listenerBackup < 0 ? 0xff : static_cast<uint8_t>(handle.listenerBackup);
  wire.listenId = handle.listenId;
  std::memcpy(wire.secret, handle.secret, kSecretBytes);
  wire.chunkBytes = handle.chunkBytes;
  for (size_t i = 0; i < handle.nics.size(); ++i) {
    in_addr addr{};
    inet_pton(AF_INET, handle.nics[i].address.c_str(), &addr);
    wire.nics[i].ipv4 = addr.s_addr;
    wire.nics[i].port = handle.nics[i].port;
  }
  std::vector<uint8_t> out(kHandleBytes, 0);
  std::memcpy(out.data(), &wire, sizeof(wire));
  return out;
}

ListenHandle decodeHandle(const uint8_t* bytes, size_t length) {
  if (length < kHandleBytes) {
    throw ProtocolError("connection handle of " + std::to_string(length) +
                        " bytes; a reccl handle has " + std::to_string(kHandleBytes));
  }
  WireHandle wire;
  std::memcpy(&wire, bytes, sizeof(wire));
  if (wire.magic != kHandleMagic) throw ProtocolError("not a reccl connection handle (bad magic)");
  if (wire.version != kProtocolVersion) {
    throw ProtocolError("handle from protocol version " + std::to_string(wire.version) +
                        "; this library speaks " + std::to_string(kProtocolVersion));
  }
  if (wire.nicCount == 0 || wire.nicCount > kMaxHandleNics || wire.listenerNic >= wire.nicCount ||
      (wire.listenerBackup != 0xff && wire.listenerBackup >= wire.nicCount)) {
    throw ProtocolError("handle with invalid NIC count or indices");
  }
  if (wire.chunkBytes < 4096 || wire.chunkBytes > kMaxChunkBytes) {
    throw ProtocolError("handle with chunk size " + std::to_string(wire.chunkBytes) +
                        " outside 4096.." + std::to_string(kMaxChunkBytes));
  }
  ListenHandle handle;
  handle.listenId = wire.listenId;
  std::memcpy(handle.secret, wire.secret, kSecretBytes);
  handle.chunkBytes = wire.chunkBytes;
  handle.listenerNic = wire.listenerNic;
  handle.listenerBackup = wire.listenerBackup == 0xff ? -1 : wire.listenerBackup;
  for (size_t i = 0; i < wire.nicCount; ++i) {
    char text[INET_ADDRSTRLEN] = {};
    in_addr addr{};
    addr.s_addr = wire.nics[i].ipv4;
    inet_ntop(AF_INET, &addr, text, sizeof(text));
    handle.nics.push_back({text, wire.nics[i].port});
  }
  return handle;
}

}  // namespace reccl
