#include "engine/p2p.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "engine/descriptor.h"
#include "engine/op_context.h"
#include "engine/p2p_header.h"

namespace reccl {

namespace {

std::string describeMessage(int tag, DataType dtype, uint64_t count) {
  return "tag " + std::to_string(tag) + ", " + dataTypeName(dtype) + "[" + std::to_string(count) +
         "]";
}

std::string seconds(Millis ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

}  // namespace

// ------------------------------------------------------------------ P2pOp

std::string P2pOp::label() const {
  std::string group;
  if (auto owner = owner_.lock()) group = " in process group '" + owner->group() + "'";
  if (send_)
    return "send to rank " + std::to_string(peer_) + " (tag " + std::to_string(tag_) + ")" + group;
  if (anySource_ && peer_ < 0)
    return "recv from any rank (tag " + std::to_string(tag_) + ")" + group;
  return "recv from rank " + std::to_string(peer_) + " (tag " + std::to_string(tag_) + ")" + group;
}

int P2pOp::peer() const {
  auto owner = owner_.lock();
  if (!owner) return peer_;
  std::lock_guard<std::mutex> lock(owner->mutex_);
  return peer_;
}

void P2pOp::checkHeaderLocked() {
  if (headerChecked_ || !headerRequest_) return;
  uint64_t got = 0;
  std::string error;
  if (!headerRequest_->test(&got, &error) || !error.empty()) return;
  headerChecked_ = true;
  P2pMessage header;
  try {
    header = decodeP2pHeader(header_.get(), got);
  } catch (const ProtocolError& e) {
    error_ = "reccl: " + label() + ": " + e.what();
    done_ = true;
    return;
  }
  const DataType theirs = header.dtype;
  if (header.tag != tag_ || theirs != dtype_ || header.count != count_ || header.bytes != bytes_) {
    mismatch_ = true;
    error_ =
        "reccl: send/recv mismatch" +
        std::string(owner_.lock() ? " in process group '" + owner_.lock()->group() + "'" : "") +
        ": rank " + std::to_string(header.sender) + " sent (" +
        describeMessage(header.tag, theirs, header.count) + ") but this rank's recv from rank " +
        std::to_string(peer_) + " expects (" + describeMessage(tag_, dtype_, count_) +
        "); sends and recvs between two ranks match in posting order";
    done_ = true;
  }
}

bool P2pOp::testLocked() {
  if (done_) {
    if (!error_.empty()) {
      if (mismatch_) throw MismatchError(error_);
      throw Error(error_);
    }
    return true;
  }
  if (!posted_) return false;
  if (!send_) {
    checkHeaderLocked();
    if (done_) return testLocked();
  }
  for (auto* request : {&headerRequest_, &dataRequest_}) {
    if (!*request) continue;
    uint64_t got = 0;
    std::string error;
    if (!(*request)->test(&got, &error)) return false;
    if (!error.empty()) {
      error_ = "reccl: " + label() + " failed: " + error;
      if (send_ && error.find("larger than the posted receive") != std::string::npos) {
        error_ += " (the matching recv expects a smaller tensor)";
      }
      done_ = true;
      return testLocked();
    }
    if (request == &dataRequest_ && !send_ && got != bytes_) {
      error_ = "reccl: " + label() + ": got " + std::to_string(got) + " bytes, expected " +
               std::to_string(bytes_);
      done_ = true;
      return testLocked();
    }
  }
  done_ = true;
  return true;
}

bool P2pOp::test() {
  auto owner = owner_.lock();
  if (!owner) {
    if (done_) return testLocked();
    throw AbortedError("reccl: " + label() + ": the process group was destroyed");
  }
  owner->progress();
  std::lock_guard<std::mutex> lock(owner->mutex_);
  return testLocked();
}

void P2pOp::wait(Millis timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  for (;;) {
    if (test()) return;
    if (Clock::now() >= deadline) {
      throw TimeoutError("reccl: " + label() + " timed out after " + seconds(timeout));
    }
    std::shared_ptr<Request> next;
    if (auto owner = owner_.lock()) {
      std::lock_guard<std::mutex> lock(owner->mutex_);
      uint64_t got;
      std::string error;
      if (posted_) {
        next =
            headerRequest_ && !headerRequest_->test(&got, &error) ? headerRequest_ : dataRequest_;
      }
    }
    Millis left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    if (next) {
      next->wait(std::max(Millis(0), std::min(Millis(50), left)));
    } else {
      std::this_thread::sleep_for(std::max(Millis(0), std::min(Millis(1), left)));
    }
  }
}

// ------------------------------------------------------------------ P2p

P2p::P2p(std::shared_ptr<Links> links, std::string group)
    : links_(std::move(links)), group_(std::move(group)), spare_(links_->size()) {}

std::shared_ptr<P2pOp> P2p::send(int peer, int tag, const void* data, uint64_t count,
                                 DataType dtype) {
  if (peer < 0 || peer >= links_->size() || peer == links_->rank()) {
    throw ConfigError("send to rank " + std::to_string(peer) +
                      ": not another rank of this group of " + std::to_string(links_->size()));
  }
  auto op = std::make_shared<P2pOp>();
  op->owner_ = weak_from_this();
  op->send_ = true;
  op->peer_ = peer;
  op->tag_ = tag;
  op->dtype_ = dtype;
  op->count_ = count;
  op->data_ = const_cast<uint8_t*>(static_cast<const uint8_t*>(data));
  op->bytes_ = count * elementSize(dtype);
  op->header_.reset(new uint8_t[kP2pHeaderBytes]);
  P2pMessage header;
  header.tag = tag;
  header.sender = links_->rank();
  header.dtype = dtype;
  header.count = count;
  header.bytes = op->bytes_;
  encodeP2pHeader(header, op->header_.get());
  auto to = links_->sender(peer, 0, Lane::kP2p);
  std::lock_guard<std::mutex> lock(mutex_);  // header and data back to back
  op->headerRequest_ = to->isend(op->header_.get(), kP2pHeaderBytes);
  op->dataRequest_ = to->isend(op->data_, op->bytes_);
  op->posted_ = true;
  return op;
}

std::shared_ptr<P2pOp> P2p::recv(int peer, int tag, void* data, uint64_t count, DataType dtype) {
  if (peer != -1 && (peer < 0 || peer >= links_->size() || peer == links_->rank())) {
    throw ConfigError("recv from rank " + std::to_string(peer) +
                      ": not another rank of this group of " + std::to_string(links_->size()));
  }
  if (links_->size() == 1 && peer == -1) {
    throw ConfigError("recv from any source in a group of one rank would never complete");
  }
  auto op = std::make_shared<P2pOp>();
  op->owner_ = weak_from_this();
  op->anySource_ = peer == -1;
  op->peer_ = peer;
  op->tag_ = tag;
  op->dtype_ = dtype;
  op->count_ = count;
  op->data_ = static_cast<uint8_t*>(data);
  op->bytes_ = count * elementSize(dtype);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    unposted_.push_back(op);
    progressLocked();
  }
  return op;
}

void P2p::progress() {
  std::lock_guard<std::mutex> lock(mutex_);
  progressLocked();
}

void P2p::postRecvLocked(P2pOp& op, const std::shared_ptr<RecvConnection>& from) {
  Spare& spare = spare_.at(op.peer_);
  if (spare.request) {  // a header already posted for an earlier any-source receive
    op.header_ = std::move(spare.buffer);
    op.headerRequest_ = std::move(spare.request);
    spare = Spare{};
  } else {
    op.header_.reset(new uint8_t[kP2pHeaderBytes]);
    op.headerRequest_ = from->irecv(op.header_.get(), kP2pHeaderBytes);
  }
  op.dataRequest_ = from->irecv(op.data_, op.bytes_);
  op.posted_ = true;
}

bool P2p::resolveAnyLocked(P2pOp& op, const std::vector<bool>& blocked) {
  const int size = links_->size();
  for (int p = 0; p < size; ++p) {
    if (p == links_->rank() || blocked[p] || spare_[p].request) continue;
    auto from = links_->tryReceiver(p, 0, Lane::kP2p);
    if (!from) continue;
    spare_[p].buffer.reset(new uint8_t[kP2pHeaderBytes]);
    spare_[p].request = from->irecv(spare_[p].buffer.get(), kP2pHeaderBytes);
  }
  for (int p = 0; p < size; ++p) {
    if (!spare_[p].request || blocked[p]) continue;
    uint64_t got = 0;
    std::string error;
    if (!spare_[p].request->test(&got, &error)) continue;
    op.peer_ = p;
    postRecvLocked(op, links_->tryReceiver(p, 0, Lane::kP2p));
    return true;
  }
  return false;
}

void P2p::progressLocked() {
  std::vector<bool> blocked(links_->size(), false);  // peers with an earlier unposted receive
  bool anyPending = false;
  for (auto it = unposted_.begin(); it != unposted_.end();) {
    P2pOp& op = **it;
    bool posted = false;
    try {
      if (op.anySource_ && op.peer_ < 0) {
        posted = !anyPending && resolveAnyLocked(op, blocked);
        if (!posted) anyPending = true;
      } else if (!anyPending && !blocked[op.peer_]) {
        auto from = links_->tryReceiver(op.peer_, 0, Lane::kP2p);
        if (from) {
          postRecvLocked(op, from);
          posted = true;
        }
      }
    } catch (const std::exception& e) {
      op.error_ = std::string("reccl: ") + op.label() + " failed: " + e.what();
      op.done_ = true;
      op.posted_ = true;
      posted = true;
    }
    if (posted) {
      it = unposted_.erase(it);
    } else {
      if (op.peer_ >= 0) blocked[op.peer_] = true;
      ++it;
    }
  }
}

}  // namespace reccl
