// Fuzzes the IB QP exchange decoder (transport/ib/qp_exchange.h): the 64 bytes
// each end of an IB path reads from its peer over the bootstrap socket. The
// first input byte picks the role the peer must have (even: sender, odd:
// receiver), the rest is the exchange. Properties: only ProtocolError escapes;
// an accepted exchange has a QP number and PSN within 24 bits, a region, 1..64
// slots of the role's size; encodeQpExchange(decoded) decodes to the same
// exchange and re-encodes to the same bytes.
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/frame.h"
#include "fuzz_check.h"
#include "transport/ib/qp_exchange.h"

namespace {

using reccl::QpExchange;

bool sameExchange(const QpExchange& a, const QpExchange& b) {
  return a.role == b.role && a.qp.qpNumber == b.qp.qpNumber &&
         a.qp.packetSequence == b.qp.packetSequence && a.qp.lid == b.qp.lid &&
         a.qp.gid == b.qp.gid && a.ethernet == b.ethernet && a.mtu == b.mtu &&
         a.regionAddress == b.regionAddress && a.rkey == b.rkey && a.slotCount == b.slotCount &&
         a.slotBytes == b.slotBytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const QpExchange::Role role =
      (data[0] & 1) ? QpExchange::Role::kReceiver : QpExchange::Role::kSender;
  QpExchange exchange;
  try {
    exchange = reccl::decodeQpExchange(data + 1, size - 1, role);
  } catch (const reccl::ProtocolError&) {
    return 0;
  }
  FUZZ_CHECK(exchange.role == role);
  FUZZ_CHECK(exchange.qp.qpNumber > 0 && exchange.qp.qpNumber < (1u << 24));
  FUZZ_CHECK(exchange.qp.packetSequence < (1u << 24));
  FUZZ_CHECK(exchange.mtu >= 1 && exchange.mtu <= 5);
  FUZZ_CHECK(exchange.regionAddress != 0);
  FUZZ_CHECK(exchange.slotCount >= 1 && exchange.slotCount <= reccl::kMaxIbSlots);
  if (role == QpExchange::Role::kSender) {
    FUZZ_CHECK(exchange.slotBytes == sizeof(uint64_t));
  } else {
    FUZZ_CHECK(exchange.slotBytes >= 4096 && exchange.slotBytes <= reccl::kMaxChunkBytes + 4096);
  }
  const std::vector<uint8_t> encoded = reccl::encodeQpExchange(exchange);
  QpExchange again;
  try {
    again = reccl::decodeQpExchange(encoded.data(), encoded.size(), role);
  } catch (const reccl::ProtocolError& error) {
    std::fprintf(stderr, "encodeQpExchange's bytes were refused: %s\n", error.what());
    std::abort();
  }
  FUZZ_CHECK(sameExchange(exchange, again));
  FUZZ_CHECK(reccl::encodeQpExchange(again) == encoded);
  return 0;
}
