// One path of a connection: a local NIC talking to a remote NIC. Transports
// implement Path; connections implement PathOwner. Narrow on purpose: a transport
// moves frames and payloads, the connection decides what they mean.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/events.h"
#include "core/frame.h"
#include "core/memory_registration.h"

namespace reccl {

// Why a path broke or a dial failed, as its transport saw it.
struct PathFailure {
  std::string what;
  // The peer's host answered for the peer: a refused dial (nothing listens on
  // its port), a reset or an end of stream. A peer process that died on a live
  // host leaves exactly this; a link or host that is down does not (silence, no
  // route, a timeout). While every failure since traffic stopped says so, a
  // connection waits RECCL_PEER_GONE_TIMEOUT_MS, not RECCL_NO_PATH_TIMEOUT_MS.
  bool peerHostAnswered = false;
  // A dial refused at connect (nothing listens on the peer's port): the one
  // answer a live process never gives, since its listener lives as long as its
  // transport. Required, besides the above, before a connection is failed early.
  bool nothingListens = false;
};

// A slice of a message queued on a sending path. The payload stays in the
// caller's buffer, which outlives the request. With `placement` (the receiver
// registered its buffer) and `source` (so did the sender) a transport that can
// may write the payload straight into the receiver's buffer; otherwise, or if
// it cannot, it carries the chunk as it always does.
struct DataChunk {
  DataHeader header;
  const uint8_t* payload;
  std::shared_ptr<const Placement> placement;
  const MemoryRegistration* source = nullptr;
};

// When anything last arrived from the peer's transport over one NIC pair (nowNs):
// every path between the same two NICs of the same two transports shares it, so
// it speaks for the peer process as long as any connection to it moves traffic.
// It also keeps when a dial over the pair was last refused at connect, so that
// one connection's evidence of a dead peer serves every connection to it (one
// that only receives never dials).
class PairHeard {
 public:
  virtual ~PairHeard() = default;
  virtual int64_t lastHeardNs() const = 0;
  virtual void refusedAt(int64_t nowNs) = 0;
  virtual int64_t lastRefusedNs() const = 0;
};

class PathOwner {
 public:
  virtual ~PathOwner() = default;
  // Called from the path's I/O threads, which may serve other paths too. None
  // of them may block for long, nor wait for anything another callback does
  // (that callback may be queued behind it on the same thread).
  virtual void onControl(uint64_t pathId, const ControlFrame& frame) = 0;
  // Where the payload of `header` goes; nullptr discards it. Throws ProtocolError
  // for a frame that breaks the protocol (the path then fails). `placed`: the
  // payload was already written into the receive buffer by the sender's NIC
  // (direct placement; the path copies nothing and only reports it landed).
  virtual uint8_t* beginData(uint64_t pathId, const DataHeader& header, bool placed) = 0;
  // Pairs with beginData whatever it returned; `landed` = every payload byte arrived.
  virtual void endData(uint64_t pathId, const DataHeader& header, bool landed) = 0;
  // The path is broken; called at most once per path.
  virtual void onPathFailed(uint64_t pathId, Reason reason, const PathFailure& failure) = 0;
  // Whether traffic is due on this path soon: it is the active one and the
  // owner holds requests not yet complete (sends not acknowledged, receives
  // not filled). A transport that can poll for completions polls while this
  // holds instead of sleeping (docs/ib.md, "Busy polling"). Takes the owner's
  // lock briefly: never call it holding a lock of the path.
  virtual bool expectsTraffic(uint64_t pathId) { return false; }
};

class Path {
 public:
  virtual ~Path() = default;  // stopAndJoin(): a fence
  // Starts I/O; callbacks go to `owner` until the path is stopped and joined.
  // Throws Error (the path shut down, to be failed by the caller) when the
  // system refuses the path its threads: a connection loses that path, the
  // process does not die.
  virtual void start(PathOwner* owner, uint64_t pathId) = 0;
  // Sends a whole control frame, after every earlier one; never waits for the
  // peer (callers may hold their connection's lock, and callbacks share I/O
  // threads). False when the path is failing.
  virtual bool sendControl(const std::vector<uint8_t>& frame) = 0;
  virtual void sendData(const DataChunk& chunk) = 0;  // queued, written by path threads
  virtual void dropQueuedData() = 0;
  // Caps the parallel streams (a TCP path's data sockets) the path writes data
  // on; 0 lifts the cap. A spreading connection caps its lanes at one: each
  // surviving NIC then carries lanes of several connections beside its own, and
  // every extra flow into its queue adds losses, and retransmission timeouts,
  // at the end of each step (docs/transport.md, "Spreading").
  virtual void limitDataStreams(size_t streams) { (void)streams; }
  // Drops queued data, then waits (at most `timeout`) until no write this path
  // placed directly into the peer's buffers can still land there (each has
  // completed: an RC completion means placed) and no write still reads the
  // caller's buffer (a TCP frame half written), or the path is stopped. True
  // when that holds; false, the caller fails the path and stops and joins it.
  virtual bool drainDirectWrites(Millis timeout) {
    (void)timeout;
    dropQueuedData();
    return true;
  }
  // Returns once no writer of this path still reads message `seq`'s payload,
  // or after `timeout`. The peer's ACK can overtake a writer on its way back
  // from the call that sent the message's last bytes; the request completes,
  // and its buffer may be freed, only after this.
  virtual void awaitWritten(uint64_t seq, Millis timeout) {
    (void)seq;
    (void)timeout;
  }
  // Stops all I/O at once (blocked calls return); threads exit soon after.
  virtual void shutdown() = 0;
  // Once shut down, the instant from which nothing the peer sent on this path
  // can still be landing in local memory. An RDMA QP moved to the error state
  // takes no more packets, but writes it accepted just before may still be on
  // their way to memory, so that is the shutdown plus a short delay (NCCL
  // waits NCCL_IB_RESILIENCY_PORT_FAILOVER_PROBE_DELAY, 10 ms). A receiver
  // reports what it has (RESYNC) only after it. Data that lands only through
  // the receiver's own copy (fenced there by epochs) has nothing to wait for.
  virtual Clock::time_point quietAfter() const { return {}; }
  // What this path's NIC pair has heard from the peer's transport; nullptr
  // where the transport does not know.
  virtual std::shared_ptr<PairHeard> pairHeard() const { return nullptr; }
  // shutdown(), then waits until no thread runs, or will run, this path's I/O
  // (its own threads, or the event loops serving its sockets): once it
  // returns, no callback reaches the owner. The owner calls it before letting
  // go of the path, since its reference need not be the last: a path thread may
  // hold one while it sends (even on its own path), and dropping the last one
  // there would make that thread join itself. Idempotent; never call it from
  // one of the path's own threads.
  virtual void stopAndJoin() = 0;
  virtual int localNic() const = 0;
  virtual int remoteNic() const = 0;
  virtual std::string peer() const = 0;  // remote address for events and errors
};

}  // namespace reccl
