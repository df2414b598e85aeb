// The connection handle a listener hands out (NCCL passes it between ranks
// out of band): where each of the listener's NICs accepts, which NIC it listens
// on and its backup, the chunk size, and the secret a dialer must present.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/frame.h"

namespace reccl {

constexpr size_t kHandleBytes = 128;  // NCCL_NET_HANDLE_MAXSIZE
constexpr size_t kMaxHandleNics = 12;
// Bytes of the handle the encoding uses (handle.cc pins its struct to it); NCCL's
// plugin keeps a pending connection in the tail after them (net_plugin.cc).
constexpr size_t kHandleWireBytes = 112;

struct HandleEndpoint {
  std::string address;  // dotted IPv4
  uint16_t port = 0;
};

struct ListenHandle {
  uint64_t listenId = 0;
  uint8_t secret[kSecretBytes] = {};
  uint32_t chunkBytes = 0;
  int listenerNic = 0;
  int listenerBackup = -1;
  std::vector<HandleEndpoint> nics;  // by the listener's NIC index (rail)
  // Not on the wire: the dialer's tag, sent in every HELLO of the connection.
  uint64_t dialerTag = 0;
};

std::vector<uint8_t> encodeHandle(const ListenHandle& handle);
// Validates everything; throws ProtocolError saying what is wrong.
ListenHandle decodeHandle(const uint8_t* bytes, size_t length);

}  // namespace reccl
