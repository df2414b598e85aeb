// The sending end. It dials the paths, picks the active one, and after any
// switch probes the receiver (ACTIVATE) and resumes every unfinished message
// from the first byte the receiver does not have (RESYNC). A send completes
// only when the receiver acknowledges it, so nothing is lost with a path.
#pragma once

#include <map>

#include "core/connection.h"
#include "core/health.h"

namespace reccl {

// Opens a path asynchronously; `done` runs on another thread with the path or
// an error.
class Dialer {
 public:
  using Done = std::function<void(std::shared_ptr<Path> path, const std::string& error)>;
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

  ~SendConnection() override;

  void service() override;
  uint8_t* beginData(uint64_t pathId, const DataHeader& header, bool placed) override;
  void endData(uint64_t pathId, const DataHeader& header, bool landed) override;

 protected:
  void failPendingLocked(const std::string& why) override;
  void onActiveLostLocked(int index, Reason reason) override;
  bool roleQuietLocked() const override;
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
    NicBusy busy;  // in flight on the NIC it was last posted from (grey-failure input)
  };

  void onDialed(int index, std::shared_ptr<Path> path, const std::string& error);
  // Queues the unsent part of `send` on the active path; false if it failed the send.
  bool postLocked(uint64_t seq, PendingSend& send);
  void postAllLocked();
  void applyResyncLocked(const ControlFrame& frame);
  // Throws ProtocolError for a receive announced (CTS, PLACE, RESYNC) further
  // ahead of our sends than a receiver can post.
  void requireAnnounceableLocked(uint64_t seq, const char* what) const;
  // Picks the path to use now; fills `frame` with the ACTIVATE to send on it.
  // On a failback, `drainFirst` is the path being left: its direct writes
  // must all have completed before the ACTIVATE goes out (service() waits).
  std::shared_ptr<Path> maybeActivateLocked(std::vector<uint8_t>* frame,
                                            std::shared_ptr<Path>* drainFirst);
  // Fails `send` (and, by CANCEL, its receive) when its bytes cannot travel:
  // device memory at one end needs direct placement, i.e. both ends registered.
  bool checkCarriableLocked(uint64_t seq, PendingSend& send);
  void dialLocked();

  std::unique_ptr<Dialer> dialer_;
  const uint64_t chunkBytes_;
  std::map<uint64_t, PendingSend> sends_;
  std::map<uint64_t, uint64_t> earlyCts_;  // receives posted before their send
  std::map<uint64_t, std::shared_ptr<const Placement>> earlyPlacements_;  // likewise, PLACE
  // Oversized sends (seq, bytes) whose receive must be failed too: sent as CANCEL.
  std::vector<std::pair<uint64_t, uint64_t>> cancels_;
  uint64_t nextSeq_ = 0;
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
