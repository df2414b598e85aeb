// The receiving end. It posts buffers (CTS), places arriving chunks, and on
// ACTIVATE fences the old epoch and reports, per buffer still outstanding, the
// first byte it does not have, so the sender resumes exactly there.
#pragma once

#include <condition_variable>
#include <map>

#include "core/connection.h"

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

  void service() override;
  uint8_t* beginData(uint64_t pathId, const DataHeader& header, bool placed) override;
  void endData(uint64_t pathId, const DataHeader& header, bool landed) override;

 protected:
  void failPendingLocked(const std::string& why) override;
  void onActiveLostLocked(int index, Reason reason) override;
  bool roleQuietLocked() const override { return notifyQueue_.empty(); }
  void onRoleControlLocked(uint64_t pathId, const ControlFrame& frame, Lock& lock) override;

 private:
  struct PostedRecv {
    std::shared_ptr<Request> request;
    int64_t messageBytes = -1;     // learned from the first chunk
    std::vector<uint8_t> landed;   // per chunk
    size_t landedCount = 0;
    std::vector<uint8_t> place;    // the PLACE frame of a registered receive; empty if none
    bool hostAccessible = true;    // false: device memory, direct placement only
  };
  void activate(int index, const ActivateBody& body, Lock& lock);
  uint64_t resumeOffsetLocked(const PostedRecv& recv) const;

  const uint64_t chunkBytes_;
  std::map<uint64_t, PostedRecv> recvs_;
  uint64_t nextSeq_ = 0;
  // Payload copies in progress, per path id: ACTIVATE waits for the old epoch's.
  std::map<uint64_t, int> copying_;
  std::condition_variable copiesDone_;
  // Paths that failed while active, to tell the sender about over another path.
  std::vector<std::pair<int, Reason>> notifyQueue_;
  int64_t lostActiveNs_ = 0;
  int lostActiveFrom_ = -1;
  Reason lostActiveReason_ = Reason::kNone;
};

}  // namespace reccl
