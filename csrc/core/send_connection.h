// The sending end. It dials the paths, picks the active one, and after any
// switch probes the receiver (ACTIVATE) and resumes every unfinished message
// from the first byte the receiver does not have (RESYNC). A send completes
// only when the receiver acknowledges it, so nothing is lost with a path.
#pragma once

#include <map>

#include "core/connection.h"
#include "core/health.h"
#include "core/spread.h"

namespace reccl {

// Opens a path asynchronously; `done` runs on another thread with the path or
// why there is none.
class Dialer {
 public:
  using Done = std::function<void(std::shared_ptr<Path> path, const PathFailure& failure)>;
  virtual ~Dialer() = default;
  virtual void dial(int pathIndex, PathCandidate nics, Done done) = 0;
};

class SendConnection : public Connection, public std::enable_shared_from_this<SendConnection> {
 public:
  SendConnection(ConnectionEnv env, uint64_t id, std::vector<PathCandidate> candidates,
                 std::unique_ptr<Dialer> dialer, uint64_t chunkBytes);

  // Throws Error when the connection has failed or is closed, or when
  // `registration` (optional, owned by the caller, kept until the request
  // completes) does not cover the buffer. With a registration, and a receive
  // the receiver registered too, a transport that can writes the payload
  // straight into the receive buffer (docs/ib.md, direct placement).
  std::shared_ptr<Request> isend(const uint8_t* data, uint64_t bytes,
                                 const MemoryRegistration* registration = nullptr);
  // True once the receiver has answered an activation; false and `error()` set
  // when it can no longer happen.
  bool ready() const;
  // Starts the up-front dials now, from the caller's thread, instead of at the
  // supervisor's next round (a connection's first use waits for them).
  void dialNow();

  ~SendConnection() override;

  void service() override;
  uint8_t* beginData(uint64_t pathId, const DataHeader& header, bool placed) override;
  void endData(uint64_t pathId, const DataHeader& header, bool landed) override;

 protected:
  void failPendingLocked(const std::string& why) override;
  void onActiveLostLocked(int index, Reason reason) override;
  void onOtherLostLocked(int index, Reason reason) override;
  bool roleQuietLocked() const override;
  bool requestsPendingLocked() const override { return !sends_.empty(); }
  void onRoleControlLocked(uint64_t pathId, const ControlFrame& frame, Lock& lock) override;

 private:
  struct PendingSend {
    std::shared_ptr<Request> request;
    uint64_t capacity = 0;     // of the matching posted receive
    bool capacityKnown = false;
    bool posted = false;       // chunks queued on the active path this epoch
    uint64_t resumeOffset = 0;
    const MemoryRegistration* registration = nullptr;  // the caller's, or none
    std::shared_ptr<const Placement> placement;        // the receiver's PLACE, if any
    std::vector<std::pair<int, uint64_t>> carried;     // (slot, bytes) of its last posting
    // In flight on the NIC of each entry of `carried` (grey-failure input).
    std::vector<NicBusy> busy;
    // Ends the busy time of the last posting, crediting each NIC its lane's bytes.
    void completeBusy() {
      for (size_t i = 0; i < busy.size() && i < carried.size(); ++i)
        busy[i].complete(carried[i].second);
      busy.clear();
    }
  };

  void onDialed(int index, std::shared_ptr<Path> path, const PathFailure& failure);
  // Queues the unsent part of `send` on the active path; false if it failed the send.
  bool postLocked(uint64_t seq, PendingSend& send);
  void postAllLocked();
  void applyResyncLocked(const ControlFrame& frame);
  // Throws ProtocolError for a receive announced (CTS, PLACE, RESYNC) further
  // ahead of our sends than a receiver can post.
  void requireAnnounceableLocked(uint64_t seq, const char* what) const;
  // Picks the path to use now; fills `frames` with what to send on it, the
  // ACTIVATE last. `drainFirst` gets the paths of the old epoch that stay up
  // (a failback's old path, spreading's other lanes): their direct writes must
  // all have completed before the ACTIVATE goes out (service() waits).
  std::shared_ptr<Path> maybeActivateLocked(std::vector<std::vector<uint8_t>>* frames,
                                            std::vector<std::shared_ptr<Path>>* drainFirst);
  // The lanes of an epoch on `active`: it alone, or while the primary is down
  // and RECCL_SPREAD is on, one up path per other NIC too.
  std::vector<int> chooseLanesLocked(int active) const;
  double laneFactorLocked(int slot) const;
  void startLanesLocked(const std::vector<int>& lanes);
  // Adds paths that came up since the epoch began to a spreading epoch.
  void growLanesLocked();
  bool spreadWantedLocked() const;
  // After the lanes changed: caps each lane at one stream while spreading
  // (core/path.h, limitDataStreams) and lists them in the SpreadTable.
  void lanesChangedLocked();
  // Fails `send` (and, by CANCEL, its receive) when its bytes cannot travel:
  // device memory at one end needs direct placement, i.e. both ends registered.
  bool checkCarriableLocked(uint64_t seq, PendingSend& send);
  void dialLocked();

  std::unique_ptr<Dialer> dialer_;
  const uint64_t chunkBytes_;
  const ChunkPieces pieces_;
  std::map<uint64_t, PendingSend> sends_;
  std::map<uint64_t, uint64_t> earlyCts_;  // receives posted before their send
  std::map<uint64_t, std::shared_ptr<const Placement>> earlyPlacements_;  // likewise, PLACE
  // Oversized sends (seq, bytes) whose receive must be failed too: sent as CANCEL.
  std::vector<std::pair<uint64_t, uint64_t>> cancels_;
  uint64_t nextSeq_ = 0;
  SpreadLanes lanes_;  // the paths carrying data this epoch ({active_} unless spreading)
  std::vector<std::pair<int, Reason>> lostLanes_;  // told to the receiver before the next ACTIVATE
  bool awaitingResync_ = false;
  Clock::time_point resyncDeadline_{};
  bool everActive_ = false;
  // The switch in progress, for its event.
  bool switchPending_ = false;
  bool switchIsFailback_ = false;
  int switchFrom_ = -1;
  Reason switchReason_ = Reason::kNone;
  int64_t switchStartNs_ = 0;
};

}  // namespace reccl
