// What the two ends of an IB path tell each other over the bootstrap socket
// before their QPs can talk (as NCCL's IB transport does over its socket):
// QP number, packet sequence, LID/GID and MTU, plus the one region the peer may
// write into: the sender's CTS FIFO or the receiver's staging ring. Decoding
// checks every field; nothing from the wire is trusted.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transport/ib/verbs_api.h"

namespace reccl {

constexpr uint32_t kMaxIbSlots = 64;

struct QpExchange {
  enum class Role : uint8_t { kSender = 0, kReceiver = 1 };
  Role role = Role::kSender;
  QpPeer qp;                   // qp.global: decided by the receiving end (IbEndpoint::connect)
  bool ethernet = true;  // link layer of the describing port: Ethernet (RoCE) or InfiniBand
  int mtu = 3;
  uint64_t regionAddress = 0;  // sender: CTS FIFO; receiver: staging ring
  uint32_t rkey = 0;
  uint32_t slotCount = 0;
  uint32_t slotBytes = 0;  // sender: one FIFO entry (8); receiver: one ring slot
};

constexpr size_t kQpExchangeBytes = 64;
// The byte the sender writes last, once its QP is ready to send.
constexpr uint8_t kQpReadyByte = 0x52;

std::vector<uint8_t> encodeQpExchange(const QpExchange& exchange);
// Throws ProtocolError naming the bad field. `role`: what the peer must be.
QpExchange decodeQpExchange(const uint8_t* bytes, size_t length, QpExchange::Role role);

}  // namespace reccl
