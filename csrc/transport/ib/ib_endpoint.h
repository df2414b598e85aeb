// The verbs resources of one end of one IB path: an RC QP with its send and
// receive completion queues, both on one completion channel (the fd an event
// loop polls), and two registered regions. The local region
// (only this end touches it) holds the control receive and send buffers and
// either the sender's data staging slots or the receiver's grant sources. The
// remote region (the peer may RDMA-write it, nothing else) is the sender's
// CTS FIFO or the receiver's staging ring. Members are declared so that the
// QP goes first, then the CQs, then their channel, and the memory last.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/clock.h"
#include "core/frame.h"
#include "transport/ib/gid_select.h"
#include "transport/ib/qp_exchange.h"
#include "transport/ib/verbs_api.h"

namespace reccl {

class IbEndpoint {
 public:
  enum class Role { kSender, kReceiver };
  static constexpr int kPort = 1;
  static constexpr uint32_t kDataSlots = 4;       // staging slots (and FIFO entries) per path
  // Receives kept posted. A peer sends a receive-consuming request (SEND,
  // WRITE WITH IMMEDIATE) only with a credit: we write how many receives we
  // reposted so far (beyond these) into its credit word.
  static constexpr uint32_t kControlRecvs = 32;
  static constexpr uint32_t kControlSends = 32;   // control frames in flight
  // Directly placed chunks in flight: each is a WRITE plus a notice SEND that
  // borrows a control send buffer, of which kControlReserve stay for frames.
  static constexpr uint32_t kPlacedChunks = 16;
  static constexpr uint32_t kControlReserve = kControlSends - kPlacedChunks;
  static constexpr size_t kControlBytes = (sizeof(FrameHeader) + kMaxControlBody + 63) / 64 * 64;
  // FrameHeader + DataHeader in front of each staged chunk.
  static constexpr size_t kDataHeadBytes = 64;
  static_assert(sizeof(FrameHeader) + sizeof(DataHeader) <= kDataHeadBytes, "data head fits");
  // connect() tries a QP transition that answers ETIMEDOUT this often, this
  // far apart, before it gives up (bounded: about half a second in all).
  static constexpr int kModifyQpAttempts = 10;
  static constexpr Millis kModifyQpRetryDelay{50};

  // Creates the QP (in INIT, receives posted) and registers the regions.
  IbEndpoint(std::shared_ptr<VerbsDevice> device, Role role, uint64_t chunkBytes,
             uint32_t packetSequence);
  IbEndpoint(const IbEndpoint&) = delete;
  IbEndpoint& operator=(const IbEndpoint&) = delete;

  // Our side of the QP exchange, with the source GID chosen now from the
  // port's current table under `policy`. Throws Error when none is usable.
  QpExchange describe(const GidPolicy& policy);
  // INIT -> RTR -> RTS towards `peer`; a transition that answers ETIMEDOUT
  // is retried (kModifyQpAttempts, kModifyQpRetryDelay), then throws Error.
  // Both ends must have one link layer (Error naming both otherwise). RoCE
  // always routes by GID (a GRH); InfiniBand by the peer's LID, with a GRH
  // only when the peer's subnet prefix differs from ours (a router between).
  void connect(const QpExchange& peer, int timeout, int retryCount, const QpRoute& route);
  // Proves the connected QP reaches the peer before the path is used: one
  // 8-byte RDMA WRITE into the start of the peer's region (overwritten before
  // it is ever read) must complete within `timeout`. Throws Error otherwise
  // (a blackholed link then fails the dial instead of being failed back onto).
  // Call before the path starts: it polls the send CQ itself.
  void probe(const QpExchange& peer, Millis timeout);

  Role role() const { return role_; }
  uint64_t chunkBytes() const { return chunkBytes_; }
  uint32_t slotBytes() const { return slotBytes_; }
  VerbsQueuePair& qp() { return *qp_; }
  VerbsCompletionQueue& sendCq() { return *sendCq_; }
  VerbsCompletionQueue& recvCq() { return *recvCq_; }
  VerbsCompletionChannel& channel() { return *channel_; }
  uint32_t localKey() const { return localMr_->lkey(); }

  uint8_t* controlRecv(uint32_t i) { return local_.data() + i * kControlBytes; }
  uint8_t* controlSend(uint32_t i) { return local_.data() + (kControlRecvs + i) * kControlBytes; }
  uint8_t* staging(uint32_t i) { return dataArea() + static_cast<size_t>(i) * slotBytes_; }
  uint64_t* grantSource(uint32_t i) { return reinterpret_cast<uint64_t*>(dataArea()) + i; }
  uint64_t* ctsFifo(uint32_t i) { return reinterpret_cast<uint64_t*>(remote_.data()) + i; }
  uint8_t* ring(uint32_t i) { return remote_.data() + static_cast<size_t>(i) * slotBytes_; }
  // Our credit word, which the peer RDMA-writes (the receives it reposted so
  // far), right after the FIFO or ring: at slotCount * slotBytes as described.
  uint64_t* creditWord() {
    return reinterpret_cast<uint64_t*>(remote_.data() + remote_.size()) - 1;
  }
  // Where we stage the count we write into the peer's credit word.
  uint64_t* creditSource() {
    return reinterpret_cast<uint64_t*>(local_.data() + local_.size()) - 1;
  }
  // Posts control receive buffer `i`; false (reason in `error`) if refused.
  bool postReceive(uint32_t i, std::string* error);

 private:
  uint8_t* dataArea() { return local_.data() + (kControlRecvs + kControlSends) * kControlBytes; }

  const std::shared_ptr<VerbsDevice> device_;
  const Role role_;
  const uint64_t chunkBytes_;
  const uint32_t slotBytes_;
  const uint32_t packetSequence_;
  int gidIndex_ = -1;
  Gid gid_{};
  bool ethernet_ = true;  // our port's link layer
  int mtu_ = 3;
  std::vector<uint8_t> local_;
  std::vector<uint8_t> remote_;
  std::unique_ptr<VerbsMemoryRegion> localMr_;
  std::unique_ptr<VerbsMemoryRegion> remoteMr_;
  std::unique_ptr<VerbsCompletionChannel> channel_;
  std::unique_ptr<VerbsCompletionQueue> sendCq_;
  std::unique_ptr<VerbsCompletionQueue> recvCq_;
  std::unique_ptr<VerbsQueuePair> qp_;
};

// Work request ids: what a completion is about, and which buffer.
enum class WorkKind : uint32_t {
  kControlRecv = 1,
  kControlSend = 2,
  kData = 3,
  kGrant = 4,
  kProbe = 5,
  kPlacedWrite = 6,   // a chunk written straight into the peer's buffer (unsignaled)
  kPlacedNotice = 7,  // the SEND after it that tells the peer it landed
  kCredit = 8,        // the count of our reposted receives, written into the peer's credit word
};
inline uint64_t workId(WorkKind kind, uint32_t index) {
  return (static_cast<uint64_t>(kind) << 32) | index;
}
inline WorkKind workKind(uint64_t id) { return static_cast<WorkKind>(id >> 32); }
inline uint32_t workIndex(uint64_t id) { return static_cast<uint32_t>(id); }

}  // namespace reccl
