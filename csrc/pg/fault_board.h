// The job-wide fault picture by process, for groups that run no CPU
// collective (CUDA-only groups have no per-op agreement to carry it): each
// process publishes its NIC state to the job's store when it changes, and
// while a NIC is down once every RECCL_DCR_PERIOD_MS (with the count of NCCL
// collectives its groups issued); nothing at all while it is healthy.
//
// Keys (on the job's store, below every group prefix):
//   reccl/board/<global rank>   the process's latest record
//   reccl/board/log             appended "<global rank>," at each healthy <->
//                               degraded transition
// A reader gets the log (one request, as long as the transitions so far) and
// the records of the ranks in it (one request): cost in proportion to faults,
// never to the number of ranks.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "pg/fault_record.h"

namespace reccl {

class FaultBoard {
 public:
  // The board of this process, made by the first group that joins and gone
  // with the last one (its thread stopped, bounded).
  static std::shared_ptr<FaultBoard> join(const c10::intrusive_ptr<c10d::Store>& store,
                                          int globalRank, int periodMs);
  ~FaultBoard();
  FaultBoard(const FaultBoard&) = delete;
  FaultBoard& operator=(const FaultBoard&) = delete;

  int globalRank() const { return globalRank_; }
  // Counters of NCCL collectives, summed into this process's record.
  uint64_t addDeviceOps(std::function<uint64_t()> counter);
  void removeDeviceOps(uint64_t token);
  // The processes degraded now (bounded by the store's timeout; throws on a
  // store error).
  std::vector<BoardRecord> degraded();
  // Store requests the process's fault boards have made (publishing and reading).
  static uint64_t storeRequests();

 private:
  struct Shared;  // what the thread touches; may outlive the board (a stuck store call)
  FaultBoard(c10::intrusive_ptr<c10d::Store> store, int globalRank, int periodMs);
  static void loop(std::shared_ptr<Shared> shared);

  const int globalRank_;
  std::shared_ptr<Shared> shared_;
  uint64_t healthToken_ = 0;
};

}  // namespace reccl
