// Fuzzes the point-to-point header decoder (engine/p2p_header.h): the 64 bytes
// in front of every send, as the receiving rank gets them (any length may
// arrive: the receive is posted for 64). Properties: only ProtocolError
// escapes; an accepted header names a valid dtype; encodeP2pHeader(decoded)
// decodes to the same message and re-encodes to the same bytes.
#include <cstring>
#include <vector>

#include "core/error.h"
#include "engine/p2p_header.h"
#include "fuzz_check.h"

namespace {

bool sameMessage(const reccl::P2pMessage& a, const reccl::P2pMessage& b) {
  return a.tag == b.tag && a.sender == b.sender && a.dtype == b.dtype && a.count == b.count &&
         a.bytes == b.bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  reccl::P2pMessage message;
  try {
    message = reccl::decodeP2pHeader(data, size);
  } catch (const reccl::ProtocolError&) {
    return 0;
  }
  FUZZ_CHECK(reccl::isValidDataType(static_cast<uint8_t>(message.dtype)));
  FUZZ_CHECK(std::strlen(reccl::dataTypeName(message.dtype)) > 0);
  std::vector<uint8_t> encoded(reccl::kP2pHeaderBytes);
  reccl::encodeP2pHeader(message, encoded.data());
  reccl::P2pMessage again;
  try {
    again = reccl::decodeP2pHeader(encoded.data(), encoded.size());
  } catch (const reccl::ProtocolError& error) {
    std::fprintf(stderr, "encodeP2pHeader's bytes were refused: %s\n", error.what());
    std::abort();
  }
  FUZZ_CHECK(sameMessage(message, again));
  std::vector<uint8_t> twice(reccl::kP2pHeaderBytes);
  reccl::encodeP2pHeader(again, twice.data());
  FUZZ_CHECK(twice == encoded);
  return 0;
}
