#include "transport/ib/qp_exchange.h"

#include <cstring>

#include "core/error.h"
#include "core/frame.h"

namespace reccl {

namespace {

constexpr uint32_t kExchangeMagic = 0x51434552;  // "RECQ"

#pragma pack(push, 1)
struct WireExchange {
  uint32_t magic;
  uint16_t version;
  uint8_t role;
  uint8_t mtu;
  uint32_t qpNumber;
  uint32_t packetSequence;
  uint16_t lid;
  uint8_t linkLayer;  // 1 Ethernet (RoCE), 2 InfiniBand
  uint8_t reserved;
  uint8_t gid[16];
  uint64_t regionAddress;
  uint32_t rkey;
  uint32_t slotCount;
  uint32_t slotBytes;
};
#pragma pack(pop)
static_assert(sizeof(WireExchange) == 56, "QP exchange wire size");
static_assert(offsetof(WireExchange, gid) == 20 && offsetof(WireExchange, regionAddress) == 36,
              "QP exchange layout");
static_assert(sizeof(WireExchange) <= kQpExchangeBytes, "exchange must fit its fixed size");

}  // namespace

std::vector<uint8_t> encodeQpExchange(const QpExchange& exchange) {
  WireExchange wire{};
  wire.magic = kExchangeMagic;
  wire.version = kProtocolVersion;
  wire.role = static_cast<uint8_t>(exchange.role);
  wire.mtu = static_cast<uint8_t>(exchange.mtu);
  wire.qpNumber = exchange.qp.qpNumber;
  wire.packetSequence = exchange.qp.packetSequence;
  wire.lid = exchange.qp.lid;
  wire.linkLayer = exchange.ethernet ? 1 : 2;
  std::memcpy(wire.gid, exchange.qp.gid.data(), 16);
  wire.regionAddress = exchange.regionAddress;
  wire.rkey = exchange.rkey;
  wire.slotCount = exchange.slotCount;
  wire.slotBytes = exchange.slotBytes;
  std::vector<uint8_t> out(kQpExchangeBytes, 0);
  std::memcpy(out.data(), &wire, sizeof(wire));
  return out;
}

QpExchange decodeQpExchange(const uint8_t* bytes, size_t length, QpExchange::Role role) {
  if (length != kQpExchangeBytes) {
    throw ProtocolError("QP exchange of " + std::to_string(length) + " bytes; expected " +
                        std::to_string(kQpExchangeBytes));
  }
  WireExchange wire;
  std::memcpy(&wire, bytes, sizeof(wire));
  auto bad = [](const std::string& what) { throw ProtocolError("QP exchange: " + what); };
  if (wire.magic != kExchangeMagic) bad("bad magic");
  if (wire.version != kProtocolVersion) {
    bad("protocol version " + std::to_string(wire.version) + "; this library speaks " +
        std::to_string(kProtocolVersion));
  }
  if (wire.role != static_cast<uint8_t>(role)) {
    bad(std::string("expected the ") +
        (role == QpExchange::Role::kSender ? "sender's" : "receiver's") + " description");
  }
  if (wire.mtu < 1 || wire.mtu > 5) bad("MTU enum " + std::to_string(wire.mtu) + " not in 1..5");
  if (wire.qpNumber == 0 || wire.qpNumber >= (1u << 24)) {
    bad("QP number " + std::to_string(wire.qpNumber) + " not in 1..2^24-1");
  }
  if (wire.packetSequence >= (1u << 24)) bad("packet sequence number beyond 24 bits");
  if (wire.linkLayer != 1 && wire.linkLayer != 2) {
    bad("link layer " + std::to_string(wire.linkLayer) + "; 1 (Ethernet) or 2 (InfiniBand)");
  }
  if (wire.regionAddress == 0) bad("null region address");
  if (wire.slotCount == 0 || wire.slotCount > kMaxIbSlots) {
    bad("slot count " + std::to_string(wire.slotCount) + " not in 1.." +
        std::to_string(kMaxIbSlots));
  }
  if (role == QpExchange::Role::kSender && wire.slotBytes != sizeof(uint64_t)) {
    bad("CTS FIFO entries of " + std::to_string(wire.slotBytes) + " bytes; they are 8");
  }
  if (role == QpExchange::Role::kReceiver &&
      (wire.slotBytes < 4096 || wire.slotBytes > kMaxChunkBytes + 4096)) {
    bad("staging slots of " + std::to_string(wire.slotBytes) + " bytes; valid 4096.." +
        std::to_string(kMaxChunkBytes + 4096));
  }
  QpExchange out;
  out.role = role;
  out.mtu = wire.mtu;
  out.qp.qpNumber = wire.qpNumber;
  out.qp.packetSequence = wire.packetSequence;
  out.qp.lid = wire.lid;
  out.ethernet = wire.linkLayer == 1;
  std::memcpy(out.qp.gid.data(), wire.gid, 16);
  out.regionAddress = wire.regionAddress;
  out.rkey = wire.rkey;
  out.slotCount = wire.slotCount;
  out.slotBytes = wire.slotBytes;
  return out;
}

}  // namespace reccl
