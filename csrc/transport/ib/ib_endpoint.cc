#include "transport/ib/ib_endpoint.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "transport/ib/gid_select.h"

namespace reccl {

IbEndpoint::IbEndpoint(std::shared_ptr<VerbsDevice> device, Role role, uint64_t chunkBytes,
                       uint32_t packetSequence)
    : device_(std::move(device)),
      role_(role),
      chunkBytes_(chunkBytes),
      slotBytes_(static_cast<uint32_t>((kDataHeadBytes + chunkBytes + 63) / 64 * 64)),
      packetSequence_(packetSequence & 0xFFFFFF) {
  const size_t dataBytes = role_ == Role::kSender ? static_cast<size_t>(kDataSlots) * slotBytes_
                                                  : kDataSlots * sizeof(uint64_t);
  local_.assign((kControlRecvs + kControlSends) * kControlBytes + dataBytes + sizeof(uint64_t), 0);
  remote_.assign((role_ == Role::kSender ? kDataSlots * sizeof(uint64_t)
                                         : static_cast<size_t>(kDataSlots) * slotBytes_) +
                     sizeof(uint64_t),
                 0);
  // Never relaxed ordering: the FIFO entry and staged chunks must be in
  // place when the SEND or immediate after them completes.
  localMr_ = device_->registerMemory(local_.data(), local_.size(), false, false);
  remoteMr_ = device_->registerMemory(remote_.data(), remote_.size(), true, false);
  // + 1: the one credit write in flight.
  const int maxSend = static_cast<int>(kControlSends + 2 * kDataSlots + kPlacedChunks + 5);
  const int maxRecv = static_cast<int>(kControlRecvs);
  channel_ = device_->createCompletionChannel();
  sendCq_ = device_->createCompletionQueue(maxSend, channel_.get());
  recvCq_ = device_->createCompletionQueue(maxRecv, channel_.get());
  qp_ = device_->createQueuePair(sendCq_.get(), recvCq_.get(), maxSend, maxRecv);
  qp_->toInit(kPort);
  for (uint32_t i = 0; i < kControlRecvs; ++i) {
    std::string error;
    if (!postReceive(i, &error)) throw Error("posting receive buffers: " + error);
  }
}

bool IbEndpoint::postReceive(uint32_t i, std::string* error) {
  RecvRequest request;
  request.wrId = workId(WorkKind::kControlRecv, i);
  request.sge = {reinterpret_cast<uint64_t>(controlRecv(i)), static_cast<uint32_t>(kControlBytes),
                 localMr_->lkey()};
  return qp_->postRecv(request, error);
}

QpExchange IbEndpoint::describe(const GidPolicy& policy) {
  PortAttributes port = device_->queryPort(kPort);
  if (!port.active)
    throw Error("port " + std::to_string(kPort) + " of " + device_->name() + " is down");
  // One table query per dial, chosen from the table as it is now (after a
  // flap the same address may sit at another index).
  const GidEntry gid = chooseGid(readGidTable(*device_, kPort, port.gidTableLength), port.ethernet,
                                 policy, device_->name());
  gidIndex_ = gid.index;
  gid_ = gid.gid;
  ethernet_ = port.ethernet;
  if (!port.ethernet && port.lid == 0) {
    throw Error("port " + std::to_string(kPort) + " of " + device_->name() +
                " is InfiniBand without a LID (is a subnet manager running?)");
  }
  mtu_ = port.activeMtu;
  QpExchange out;
  out.role = role_ == Role::kSender ? QpExchange::Role::kSender : QpExchange::Role::kReceiver;
  out.qp.qpNumber = qp_->qpNumber();
  out.qp.packetSequence = packetSequence_;
  out.qp.lid = port.lid;
  out.qp.gid = gid.gid;
  out.ethernet = port.ethernet;
  out.mtu = mtu_;
  out.regionAddress = reinterpret_cast<uint64_t>(remote_.data());
  out.rkey = remoteMr_->rkey();
  out.slotCount = kDataSlots;
  out.slotBytes = role_ == Role::kSender ? sizeof(uint64_t) : slotBytes_;
  return out;
}

namespace {

// Runs one ibv_modify_qp transition, trying again while it answers ETIMEDOUT
// (RoCE neighbour resolution that has not finished yet is transient).
template <typename Transition>
void modifyRetryingTimeouts(const char* what, Transition transition) {
  for (int attempt = 1;; ++attempt) {
    try {
      transition();
      return;
    } catch (const ModifyQpTimedOut& error) {
      if (attempt == IbEndpoint::kModifyQpAttempts) {
        throw Error(std::string(what) + " still timed out after " +
                    std::to_string(IbEndpoint::kModifyQpAttempts) + " attempts " +
                    std::to_string(IbEndpoint::kModifyQpRetryDelay.count()) +
                    " ms apart (is the peer's address reachable / its neighbour entry "
                    "resolvable?): " +
                    error.what());
      }
      std::this_thread::sleep_for(IbEndpoint::kModifyQpRetryDelay);
    }
  }
}

}  // namespace

void IbEndpoint::connect(const QpExchange& peer, int timeout, int retryCount,
                         const QpRoute& route) {
  auto layer = [](bool ethernet) { return ethernet ? "Ethernet (RoCE)" : "InfiniBand"; };
  if (peer.ethernet != ethernet_) {
    throw Error(
        std::string("link layers differ: ") + device_->name() + " is " + layer(ethernet_) +
        ", the peer's device is " + layer(peer.ethernet) +
        "; RoCE and InfiniBand ports cannot reach each other (RECCL_IB_HCA selects devices)");
  }
  QpPeer remote = peer.qp;
  // The first 8 bytes of an IB GID are its subnet prefix.
  remote.global = ethernet_ || std::memcmp(gid_.data(), peer.qp.gid.data(), 8) != 0;
  modifyRetryingTimeouts("moving the QP to RTR", [&] {
    qp_->toReadyToReceive(remote, kPort, gidIndex_, std::min(mtu_, peer.mtu), route);
  });
  modifyRetryingTimeouts("moving the QP to RTS",
                         [&] { qp_->toReadyToSend(packetSequence_, timeout, retryCount); });
}

void IbEndpoint::probe(const QpExchange& peer, Millis timeout) {
  SendRequest request;
  request.wrId = workId(WorkKind::kProbe, 0);
  request.op = SendRequest::Op::kWrite;
  request.sge = {reinterpret_cast<uint64_t>(controlSend(0)), sizeof(uint64_t), localMr_->lkey()};
  request.remoteAddress = peer.regionAddress;
  request.rkey = peer.rkey;
  std::string error;
  if (!qp_->postSend(request, &error)) throw Error("probe write: " + error);
  const Clock::time_point deadline = Clock::now() + timeout;
  WorkCompletion wc;
  while (sendCq_->poll(&wc, 1) == 0) {
    if (Clock::now() > deadline) {
      qp_->toError();  // no late completion of it may surprise the path
      throw Error("probe write not acknowledged within " + std::to_string(timeout.count()) +
                  " ms (link blackholed or peer unreachable)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (wc.status != WcStatus::kSuccess) {
    throw Error(std::string("probe write: ") + wcStatusName(wc.status));
  }
}

}  // namespace reccl
