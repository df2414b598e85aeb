// The receiving end. It posts buffers (CTS), places arriving chunks, and on
// ACTIVATE fences the old epoch and reports, per buffer still outstanding, the
// first byte it does not have, so the sender resumes exactly there.
//
// The fence never blocks a callback (they run on event-loop threads shared by
// every socket of the process): ACTIVATE only records the answer it owes, and
// the RESYNC goes out from whichever callback ends the last copy of an older
// epoch, or from service() once the fence's deadline has passed.
#pragma once

#include <map>
#include <optional>
#include <utility>

#include "core/connection.h"
#include "core/spread.h"

namespace reccl {

class RecvConnection : public Connection, public std::enable_shared_from_this<RecvConnection> {
 public:
  RecvConnection(ConnectionEnv env, uint64_t id, std::vector<PathCandidate> candidates,
                 uint64_t chunkBytes);

  // Throws Error when the connection has failed or is closed, too many
  // receives are outstanding, or `registration` (optional, owned by the
  // caller, kept until the request completes) does not cover the buffer. A
  // registered receive is announced with a PLACE frame before its CTS, so the
  // sender may write into it directly.
  std::shared_ptr<Request> irecv(uint8_t* data, uint64_t capacity,
                                 const MemoryRegistration* registration = nullptr);
  // A path the sender dialed. Returns false if the connection no longer takes paths.
  bool attachPath(int index, PathCandidate nics, std::shared_ptr<Path> path);

  ~RecvConnection() override;

  // The local NICs (bit i: NIC i) whose paths placed chunks directly into
  // this connection's receive buffers since the last call, and clears them:
  // the NICs whose writes a GPU flush must order. After a failover in the
  // middle of a receive that is more than the active path's NIC.
  uint64_t takePlacedNics();

  void service() override;
  uint8_t* beginData(uint64_t pathId, const DataHeader& header, bool placed) override;
  void endData(uint64_t pathId, const DataHeader& header, bool landed) override;

 protected:
  void failPendingLocked(const std::string& why) override;
  void onActiveLostLocked(int index, Reason reason) override;
  void onOtherLostLocked(int index, Reason reason) override;
  bool roleQuietLocked() const override { return notifyQueue_.empty() && !pendingResync_; }
  bool requestsPendingLocked() const override { return !recvs_.empty(); }
  void onRoleControlLocked(uint64_t pathId, const ControlFrame& frame, Lock& lock) override;

 private:
  struct PostedRecv {
    std::shared_ptr<Request> request;
    int64_t messageBytes = -1;     // learned from the first chunk
    std::vector<uint64_t> landed;  // per chunk, its units that landed (core/spread.h pieces)
    size_t landedCount = 0;        // chunks all of whose units landed
    std::vector<uint8_t> place;    // the PLACE frame of a registered receive; empty if none
    bool hostAccessible = true;    // false: device memory, direct placement only
    int copies = 0;                // chunks a path is copying into it now (beginData..endData)
  };
  // A receive that ended (every chunk landed, or it failed) while a path was
  // still copying into its buffer (a duplicate piece from another lane): the
  // completion or failure waits for the last copy to end, so the owner, who may
  // reuse or free the buffer once told, never does so under a copy.
  struct EndingRecv {
    std::shared_ptr<Request> request;
    int copies = 0;
    std::string why;    // empty: completes with `bytes`
    uint64_t bytes = 0;
    void end() const {
      if (why.empty()) {
        request->complete(bytes);
      } else {
        request->fail(why);
      }
    }
  };
  // An ACTIVATE adopted but not answered yet: its RESYNC waits until no copy
  // of an older epoch is in progress.
  struct PendingResync {
    int index = -1;        // the slot it came on, active since (a loss drops it)
    ActivateBody body{};
    int previous = -1;     // the slot active before, for the switch event
    Clock::time_point cutAt;     // older copies still running then: their paths are failed
    Clock::time_point giveUpAt;  // and still running then: answered anyway (logged)
    bool cut = false;
  };
  // What answers an ACTIVATE; sent unlocked, PLACE frames first.
  struct ResyncAnswer {
    std::shared_ptr<Path> path;  // null: nothing to send
    std::vector<std::vector<uint8_t>> frames;
    void send() const;
  };
  // Adopts the epoch and records the answer owed; never waits.
  void activateLocked(int index, const ActivateBody& body);
  // The answer to the pending ACTIVATE once the fence holds or its last
  // deadline has passed, else nothing (and the supervisor is asked to come
  // back at the next deadline). Past the first deadline it fails the paths
  // whose copies still run, which ends them within a turn of their loops.
  ResyncAnswer answerIfFencedLocked();
  bool olderEpochCopyingLocked() const;
  // Counts a chunk that landed; when it completes its receive, returns the
  // path to ACK it on (with the message's size in `ackBytes`).
  std::shared_ptr<Path> landLocked(uint64_t pathId, const DataHeader& header, uint64_t* ackBytes);
  uint64_t resumeOffsetLocked(const PostedRecv& recv) const;
  // Fails a posted receive now, or once no path copies into it any more;
  // returns the next receive.
  std::map<uint64_t, PostedRecv>::iterator failRecvLocked(
      std::map<uint64_t, PostedRecv>::iterator it, const std::string& why);

  const uint64_t chunkBytes_;
  const ChunkPieces pieces_;
  // How long copies of the old epoch get before their paths are stopped.
  const Millis fenceGrace_;
  std::map<uint64_t, PostedRecv> recvs_;
  std::map<uint64_t, EndingRecv> ending_;  // by seq, see EndingRecv
  uint64_t nextSeq_ = 0;
  // Payload copies in progress per (epoch, path id). Keyed by epoch, not path:
  // a path active in an older epoch may be activated again while its copies
  // of that epoch still run (a failback superseded at once), and those must
  // be fenced too.
  std::map<std::pair<uint64_t, uint64_t>, int> copying_;
  std::optional<PendingResync> pendingResync_;
  // Paths that failed while active or carrying data, to tell the sender about
  // over another path.
  std::vector<std::pair<int, Reason>> notifyQueue_;
  // Slots that delivered data this epoch: more than the active one while the
  // sender spreads (send_connection.h). Bit i: slot i.
  uint64_t dataSlots_ = 0;
  uint64_t placedNics_ = 0;  // takePlacedNics
  int64_t lostActiveNs_ = 0;
  int lostActiveFrom_ = -1;
  Reason lostActiveReason_ = Reason::kNone;
};

}  // namespace reccl
