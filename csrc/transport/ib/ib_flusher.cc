#include "transport/ib/ib_flusher.h"

#include <algorithm>
#include <thread>

#include "core/error.h"
#include "transport/ib/gid_select.h"

namespace reccl {

IbFlusher::IbFlusher(std::shared_ptr<VerbsDevice> device, const GidPolicy& policy, int timeout,
                     int retryCount)
    : device_(std::move(device)), landing_(64, 0) {
  PortAttributes port = device_->queryPort(kPort);
  if (!port.active)
    throw Error("flush QP: port " + std::to_string(kPort) + " of " + device_->name() + " is down");
  const GidEntry gid = chooseGid(readGidTable(*device_, kPort, port.gidTableLength), port.ethernet,
                                 policy, device_->name());
  landingMr_ = device_->registerMemory(landing_.data(), landing_.size(), false, false);
  cq_ = device_->createCompletionQueue(4, nullptr);
  qp_ = device_->createQueuePair(cq_.get(), cq_.get(), 4, 1);
  qp_->toInit(kPort);
  QpPeer self;  // connected to itself: the READ never leaves the NIC
  self.qpNumber = qp_->qpNumber();
  self.lid = port.lid;
  self.global = port.ethernet;  // IB: its own LID, no GRH
  self.gid = gid.gid;
  qp_->toReadyToReceive(self, kPort, gid.index, port.activeMtu, QpRoute{});
  qp_->toReadyToSend(0, timeout, retryCount);
}

void IbFlusher::flush(uint64_t address, uint32_t rkey, Millis timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  SendRequest read;
  read.wrId = nextId_++;
  read.op = SendRequest::Op::kRead;
  read.sge = {reinterpret_cast<uint64_t>(landing_.data()), 1, landingMr_->lkey()};
  read.remoteAddress = address;
  read.rkey = rkey;
  std::string error;
  if (!qp_->postSend(read, &error)) throw Error("flush read on " + device_->name() + ": " + error);
  const Clock::time_point deadline = Clock::now() + timeout;
  WorkCompletion wc;
  while (cq_->poll(&wc, 1) == 0) {
    if (Clock::now() > deadline) {
      qp_->toError();
      throw Error("flush read on " + device_->name() + " not complete within " +
                  std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(10));
  }
  if (wc.status != WcStatus::kSuccess) {
    throw Error("flush read on " + device_->name() + ": " + wcStatusName(wc.status));
  }
}

}  // namespace reccl
