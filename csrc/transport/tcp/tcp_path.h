// A path over TCP: one control socket (CTS, ACK, ACTIVATE, RESYNC, heartbeats)
// and several data sockets, so a large message is striped over all of them.
// The path has no threads of its own: its non-blocking sockets are served by
// the process's event loops (event_loop.h), each socket by one loop, and its
// timers (heartbeat, the peer's silence, stalled transfers) sit in the loops'
// timer wheels. Silence on its NIC pair or a stalled transfer fails the path.
//
// A path starts with the control socket and the first data socket and carries
// everything on them; its other data sockets join later (attachData), when
// chunks first queue behind every joined data socket at the sender (the grow
// callback), so a connection that only carries small messages one at a time
// costs two handshakes per path, not 1 + RECCL_NSOCKS (docs/scale.md, set-up).
//
// Between two processes of one host the path may carry large payloads by
// reference: the data sockets carry DATA_REF frames and the receiver copies
// each payload out of the sender's memory (transport/same_host.h).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "core/path.h"
#include "transport/event_loop.h"
#include "transport/nic_pair_liveness.h"
#include "transport/same_host.h"
#include "transport/socket.h"

namespace reccl {

class TcpPath : public Path {
 public:
  enum class Role { kSender, kReceiver };
  // `pair`: the liveness this path shares with every path between the same
  // two NICs of the same two transports. `data` has one entry per data socket
  // the path may have; entries not yet connected are invalid, except the first.
  // Same-host reads (both null: none): a sender's `window` sends payloads of
  // kSameHostMinBytes or more as DATA_REF; a receiver's `peerMemory` reads them.
  TcpPath(Role role, Fd control, std::vector<Fd> data, int localNic, int remoteNic, int healthId,
          std::string peer, std::shared_ptr<NicPairLiveness> pair, const Config& config,
          std::shared_ptr<SameHostWindow> window = nullptr,
          std::shared_ptr<const PeerMemory> peerMemory = nullptr);
  ~TcpPath() override;

  void start(PathOwner* owner, uint64_t pathId) override;
  bool sendControl(const std::vector<uint8_t>& frame) override;
  void sendData(const DataChunk& chunk) override;
  void dropQueuedData() override;
  // Drops queued data and waits until no data socket is in the middle of a
  // frame, which reads its payload from the caller's buffer until the frame
  // is out: after a switch the message completes over the new path and the
  // caller owns that buffer again. False (at `timeout`, or once stopped) when
  // a frame is still half written: the caller fails and joins the path.
  bool drainDirectWrites(Millis timeout) override;
  void awaitWritten(uint64_t seq, Millis timeout) override;
  void limitDataStreams(size_t streams) override;
  void shutdown() override;
  void stopAndJoin() override;
  int localNic() const override { return localNic_; }
  int remoteNic() const override { return remoteNic_; }
  std::string peer() const override { return peer_; }
  std::shared_ptr<PairHeard> pairHeard() const override { return pair_; }

  // Adds data socket `slot` (0-based), connected after the path was made; false
  // (and the socket closed) when the slot is taken or out of range or the path
  // is stopping. Any thread.
  bool attachData(size_t slot, Fd fd);
  size_t dataSlots() const { return sockets_.size() - 1; }
  // Sender, before start(): `grow` runs once (on the thread of a sendData), the
  // first time chunks queue behind every joined data socket while some slot is
  // still empty; it connects the missing sockets and attaches them.
  void setGrow(std::function<void()> grow) { grow_ = std::move(grow); }

 private:
  class SocketIo;
  static constexpr size_t kControl = 0;  // sockets_[0]; data sockets follow
  static constexpr size_t kDataHeadBytes = sizeof(FrameHeader) + sizeof(DataHeader);
  static constexpr size_t kRefHeadBytes = sizeof(FrameHeader) + sizeof(DataRefBody);
  static_assert(offsetof(DataRefBody, address) == sizeof(DataHeader),
                "DATA_REF extends DATA's header");

  // Where a data socket is in its current frame.
  enum class DataPhase {
    kIdle,     // between frames: a writer has nothing taken, a reader waits for a header
    kHead,     // frame header + DataHeader partly moved
    kPayload,  // payload partly moved (a reader: into `target`, or dropped if null)
  };

  struct Socket {
    Fd fd;
    EventLoop* loop = nullptr;
    uint64_t id = 0;      // the loop's registration
    bool paused = false;  // not polled while the NIC is blackholed (the loop's thread only)
    // Data sockets; only the socket's loop thread touches these (stopAndJoin
    // after the loop let go of it).
    DataPhase phase = DataPhase::kIdle;
    uint8_t head[kRefHeadBytes] = {};
    size_t headBytes = kDataHeadBytes;  // the current frame's head: DATA's, or DATA_REF's once seen
    size_t moved = 0;  // bytes of head, then of payload, moved so far
    DataHeader header{};
    const uint8_t* payload = nullptr;  // writer: the chunk's bytes
    bool holdsChunk = false;  // writer: took a chunk whose frame is not yet all out
    uint8_t* target = nullptr;  // reader: where the payload goes; null = drop
    int64_t lastProgressNs = 0;
    bool carried = false;  // reader: some byte arrived on it
    bool writerArmed = false;  // writer: polled for EPOLLOUT (guarded by queueMutex_)
    bool joined = false;  // registered with its loop and usable (guarded by queueMutex_)
  };

  // Event handling, each on the socket's loop thread.
  void onIo(size_t index, uint32_t events);
  void onDeadline(size_t index);
  void readControl();
  void flushControl();
  void controlTimer();
  void writeData(Socket& socket);
  // Writer: the frame of the chunk it held is out (framesWriting_ drops).
  void releaseChunkLocked(Socket& socket);
  // Around each write that reads a caller's payload: enter fails once the path
  // is stopped, and shutdown waits for every write inside to leave, so no
  // request of this path fails (and frees its buffer) under a running sendmsg.
  bool enterPayloadWrite();
  void leavePayloadWrite();
  // The data sockets chunks may go to: all, or the first streamLimit_.
  size_t usableWritersLocked() const;
  // Arms the next idle writer within the cap; false when none is idle.
  bool wakeWriterLocked();
  void readData(Socket& socket);
  // Releases a reader's half-read frame (endData(false)) once the path stops.
  void finishReader(Socket& socket);
  // Reader: checks a chunk's header from the wire (ProtocolError) and asks the
  // owner where its payload goes (nullptr: dropped).
  uint8_t* beginChunk(const DataHeader& header);
  // Reader: a frame broke the protocol; the socket stops and the path fails.
  void failProtocol(Socket& socket, const ProtocolError& error);
  // Reader: a whole DATA_REF head is in; reads its payload from the sender.
  // False when the path failed.
  bool readByReference(Socket& socket);
  // While the NIC is blackholed a socket is not polled; its deadline rechecks.
  bool pauseIfBlackholed(Socket& socket);
  void resume(Socket& socket);
  uint32_t pollMask(const Socket& socket) const;
  // Registers socket `index` with a loop; attachMutex_ held, the path started.
  void registerSocketLocked(size_t index, int64_t now);

  void fail(Reason reason, const PathFailure& failure);
  void fail(Reason reason, const std::string& detail) { fail(reason, PathFailure{detail}); }
  void failIo(const char* what, Reason reason, const std::string& why);
  // A socket error (errno, or 0 for an end of stream) ended the path.
  void failSocket(const char* what, int error);
  bool blackholed() const;
  // Writes what the kernel takes of the queued control bytes; false on error
  // (`error` set). Caller holds controlMutex_.
  bool writeQueuedControl(int* error);

  const Role role_;
  std::vector<Socket> sockets_;
  const int localNic_;
  const int remoteNic_;
  const int healthId_;
  const std::string peer_;
  const int ioThreadsPerNic_;
  const Millis heartbeat_;
  const Millis beatInterval_;
  // A data socket may stall under congestion while the control socket still
  // proves the peer alive; only a much longer stall fails the path on its own
  // (a dead NIC silences the control socket too, within one heartbeat).
  const Millis dataStallLimit_;
  PathOwner* owner_ = nullptr;
  uint64_t pathId_ = 0;

  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  const std::shared_ptr<NicPairLiveness> pair_;
  const std::shared_ptr<SameHostWindow> window_;  // sender, same-host reads on
  const std::shared_ptr<const PeerMemory> peerMemory_;  // receiver, same-host reads on

  // Control frames being read (the control socket's loop thread only).
  uint8_t controlHead_[sizeof(FrameHeader)] = {};
  FrameHeader controlHeader_{};
  std::vector<uint8_t> controlBody_;
  size_t controlMoved_ = 0;  // bytes of header, then of body
  bool controlInBody_ = false;
  Clock::time_point nextBeat_;
  // The control timer's previous run, and its last run that came late (this
  // process had not run): silence and stuck writes count only from there. The
  // control loop thread only.
  int64_t lastControlCheckNs_ = 0;
  int64_t watchedSinceNs_ = 0;

  // Control frames being written, from any thread; what the socket does not
  // take at once waits here for the loop.
  mutable std::mutex controlMutex_;
  std::vector<uint8_t> controlOut_;
  size_t controlOutSent_ = 0;
  int64_t controlOutProgressNs_ = 0;

  mutable std::mutex queueMutex_;
  std::deque<DataChunk> queue_;
  // Chunks taken by writers whose frames are not yet out (queueMutex_), and
  // the wake-up of drainDirectWrites when that reaches 0 or the path stops.
  size_t framesWriting_ = 0;
  std::condition_variable framesDone_;
  std::mutex payloadMutex_;
  size_t payloadWrites_ = 0;  // writers inside a sendmsg that reads a payload
  std::condition_variable payloadWritesDone_;
  size_t nextWriter_ = 1;  // round robin over data sockets for the next wake-up
  size_t streamLimit_ = 0;  // data sockets written on, 0: all (queueMutex_)
  std::mutex joinMutex_;  // concurrent stopAndJoin calls: one unregisters, the other waits
  bool joined_ = false;
  // Guards the sockets' fd and loop against a late attachData (held only
  // around registrations and shutdown's sweep, never while a loop is waited on).
  std::mutex attachMutex_;
  bool started_ = false;  // start() registered the sockets present (attachMutex_)
  bool sealed_ = false;  // stopAndJoin took the registrations: no more (attachMutex_)
  std::function<void()> grow_;
  bool growAsked_ = false;  // queueMutex_
};

}  // namespace reccl
