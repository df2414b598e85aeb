// A path over one RC queue pair. Control frames (CTS, ACK, ACTIVATE, RESYNC,
// NOTIFY, heartbeats) travel as SENDs into receive buffers kept posted at the
// peer. Data is receiver-driven: the receiver grants a staging slot by an RDMA
// WRITE of a FIFO entry into the sender's CTS FIFO; the sender stages the
// chunk (frame header, DataHeader, payload) and RDMA-WRITEs it into that slot
// WITH IMMEDIATE = slot, which raises a completion at the receiver; the
// receiver checks it, copies the payload where the connection says
// (PathOwner::beginData) and grants the slot again.
//
// Direct placement (zero copy): a chunk whose receive buffer the receiver
// registered (its placement: address, capacity, one rkey per receiver NIC)
// and whose send buffer the sender registered is RDMA-WRITten from the send
// buffer (the lkey of this path's NIC) to the receive buffer (the rkey of the
// NIC this path reaches), followed on the same QP by a SEND of the frame
// header + DataHeader into a control receive buffer. RC executes them in
// order, so when the notice arrives the payload is in place; the receiver
// only records it (beginData(placed)). No grant, no copy at either end.
//
// One progress thread per path polls both completion queues and the FIFO.
// A CQE error (retry exceeded, flush, access) or heartbeat silence fails the
// path; shutdown() moves the QP to ERR first, so once it returns no write of
// this path can land anywhere.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/config.h"
#include "core/path.h"
#include "transport/ib/ib_endpoint.h"

namespace reccl {

class IbPath : public Path {
 public:
  // `endpoint` is connected (RTS) to the peer that sent `peer`.
  IbPath(std::unique_ptr<IbEndpoint> endpoint, const QpExchange& peer, int localNic, int remoteNic,
         int healthId, std::string peerName, const Config& config);
  ~IbPath() override;

  void start(PathOwner* owner, uint64_t pathId) override;
  bool sendControl(const std::vector<uint8_t>& frame) override;
  void sendData(const DataChunk& chunk) override;
  void dropQueuedData() override;
  bool drainDirectWrites(Millis timeout) override;
  void shutdown() override;
  void stopAndJoin() override;
  int localNic() const override { return localNic_; }
  int remoteNic() const override { return remoteNic_; }
  std::string peer() const override { return peerName_; }

 private:
  void run();
  // Each returns true if it did something.
  bool pollReceives();
  bool pollSends();
  bool pumpData();
  void handleControl(const uint8_t* bytes, uint32_t length);
  void handleData(uint32_t immediate, uint32_t length);
  void handlePlaced(const DataHeader& header);
  // Takes the queue's head if it is a placed chunk and posts it; false if
  // there is none or it must wait (buffers, in-flight bound).
  bool pumpPlaced(bool* failed);
  void grant(uint32_t slot);
  // Under sendMutex_: drains the send CQ, freeing buffers; the first error is
  // kept in sendFailure_ for the caller to report unlocked.
  int drainSendsLocked();
  bool postLocked(const SendRequest& request);
  void reportSendFailure();
  void fail(Reason reason, const std::string& detail);
  std::string describeCompletionError(const WorkCompletion& wc) const;
  bool sendControlFrom(const uint8_t* bytes, size_t length);

  std::unique_ptr<IbEndpoint> endpoint_;
  const bool sender_;
  const uint64_t peerRegion_;
  const uint32_t peerRkey_;
  const uint32_t peerSlotCount_;
  const uint32_t peerSlotBytes_;
  const int localNic_;
  const int remoteNic_;
  const int healthId_;
  const std::string peerName_;
  const Millis heartbeat_;
  const int ibTimeout_;
  const int ibRetryCount_;
  PathOwner* owner_ = nullptr;
  uint64_t pathId_ = 0;

  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::atomic<int64_t> lastHeardNs_{0};

  std::mutex sendMutex_;  // the QP's send queue and the buffers it uses
  std::condition_variable sendSlotFreed_;
  std::vector<uint32_t> freeControl_;
  std::vector<uint32_t> freeStaging_;
  std::string sendFailure_;
  Reason sendFailureReason_ = Reason::kNone;
  uint64_t grantsIssued_ = 0;  // receiver: FIFO entries written so far

  std::mutex queueMutex_;
  std::deque<DataChunk> queue_;
  uint64_t grantsUsed_ = 0;  // sender: FIFO entries consumed so far (progress thread only)
  // Placed chunks taken off the queue whose notice has not completed yet: a
  // write of this path may still land in the peer's buffer while it is > 0.
  std::atomic<int> placedInFlight_{0};

  std::mutex joinMutex_;  // concurrent stopAndJoin calls: one joins, the other waits
  std::thread thread_;
};

}  // namespace reccl
