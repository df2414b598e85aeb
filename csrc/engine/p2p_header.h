// The 64-byte header in front of every point-to-point message (engine/p2p.h):
// what the sender says it sends. The receiver compares it with its own recv;
// decoding trusts nothing from the peer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/data_type.h"

namespace reccl {

constexpr size_t kP2pHeaderBytes = 64;

struct P2pMessage {
  int32_t tag = 0;
  int32_t sender = -1;  // the sender's rank in the group (for the receiver's error text)
  DataType dtype = DataType::kUInt8;
  uint64_t count = 0;  // elements
  uint64_t bytes = 0;  // count * element size
};

// Writes kP2pHeaderBytes bytes at `out`.
void encodeP2pHeader(const P2pMessage& message, uint8_t* out);
// `length`: the bytes that arrived. Throws ProtocolError for a header of another
// size, another magic or version, or an unknown dtype.
P2pMessage decodeP2pHeader(const uint8_t* bytes, size_t length);

}  // namespace reccl
