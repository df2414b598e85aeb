// Point-to-point send/recv on their own lane of connections (so they never
// interleave with collectives). Each message is a 64-byte header (tag, dtype,
// count) followed by the data; the receiver checks the header, so a send and a
// recv that disagree fail on both sides with a message naming both. Messages
// between two ranks match in posting order; recv from any source posts a header
// receive on every connected peer and takes the first to arrive.
//
// Sends are posted at once. Receives are posted in order by progress(), which
// every test()/wait() drives (a receive cannot be posted before its sender has
// connected, and later receives wait behind an unresolved any-source receive).
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/data_type.h"
#include "engine/links.h"

namespace reccl {

class P2p;

class P2pOp {
 public:
  // True when finished; throws when it failed (MismatchError on disagreement).
  bool test();
  // Waits up to `timeout`; throws TimeoutError past it.
  void wait(Millis timeout);
  // The peer: for a recv from any source, known once test() returned true.
  int peer() const;
  bool isSend() const { return send_; }
  std::string label() const;

 private:
  friend class P2p;
  bool testLocked();
  void checkHeaderLocked();

  std::weak_ptr<P2p> owner_;
  bool send_ = false;
  bool anySource_ = false;
  int peer_ = -1;
  int tag_ = 0;
  DataType dtype_ = DataType::kUInt8;
  uint64_t count_ = 0;
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
  std::unique_ptr<uint8_t[]> header_;
  std::shared_ptr<Request> headerRequest_;
  std::shared_ptr<Request> dataRequest_;
  bool posted_ = false;
  bool headerChecked_ = false;
  bool done_ = false;
  std::string error_;
  bool mismatch_ = false;
};

class P2p : public std::enable_shared_from_this<P2p> {
 public:
  P2p(std::shared_ptr<Links> links, std::string group);

  std::shared_ptr<P2pOp> send(int peer, int tag, const void* data, uint64_t count, DataType dtype);
  // peer -1: from any source.
  std::shared_ptr<P2pOp> recv(int peer, int tag, void* data, uint64_t count, DataType dtype);

  // Posts the receives that can be posted now, in order.
  void progress();
  const std::string& group() const { return group_; }

 private:
  friend class P2pOp;
  void progressLocked();
  void postRecvLocked(P2pOp& op, const std::shared_ptr<RecvConnection>& from);
  bool resolveAnyLocked(P2pOp& op, const std::vector<bool>& blocked);

  std::shared_ptr<Links> links_;
  const std::string group_;
  std::mutex mutex_;
  std::deque<std::shared_ptr<P2pOp>> unposted_;  // receives, in posting order
  // Per peer: a header receive posted for an any-source receive, not yet claimed.
  struct Spare {
    std::unique_ptr<uint8_t[]> buffer;
    std::shared_ptr<Request> request;
  };
  std::vector<Spare> spare_;
};

}  // namespace reccl
