// The control plane of one process group: a background thread that shares each
// rank's fault state (channels on a backup NIC, local NICs down, ops done) over a
// side channel (the group's store, on its own connection) every period, so that
//  - every rank has the job-wide fault picture (which ranks run degraded), and
//  - DCR gets its decisions: rank 0 (the coordinator) sees every rank's state and
//    publishes the plan the group should run (rebalance.h) and when it starts.
//
// Cost per period: one small write per rank, one small read per rank, and one
// read of every rank's state by the coordinator. No collective ever waits for
// the control plane: descriptors carry its decisions in-band (rebalance.h).
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "engine/rebalance.h"
#include "engine/rendezvous.h"

namespace reccl {

// What one rank reports each period.
struct RankState {
  uint64_t opsDone = 0;
  uint64_t backupChannels = 0;  // bit c: a path of channel c runs over a backup NIC
  uint64_t nicsDown = 0;        // bit n: local NIC n is down
  uint64_t deviceOps = 0;       // collectives issued by the group's GPU backend (NCCL)
};

// A rank whose state is not clean, in the job-wide picture.
struct DegradedRank {
  int rank = 0;
  RankState state;
};

// What the coordinator publishes each period.
struct GroupView {
  PlanProposal plan;                  // the plan the group should run
  uint64_t maxOpsDone = 0;            // of the most advanced rank
  std::vector<DegradedRank> degraded; // ranks running on backups or with NICs down
  uint64_t round = 0;                 // coordinator's period counter (0: none yet)
};

struct ControlSettings {
  bool enabled = true;   // false: no thread, no store traffic, no DCR
  bool rebalance = true; // RECCL_DCR
  Millis period{100};    // RECCL_DCR_PERIOD_MS
  uint64_t offset = 4;   // RECCL_DCR_OFFSET
};

class ControlPlane {
 public:
  using Sampler = std::function<RankState()>;

  // Publishes this rank's first state (and, on rank 0, the first view) at once,
  // so every key exists before any rank's thread reads it; start() after the
  // group's rendezvous has completed.
  // Keys go under `prefix` (the group's rendezvous prefix).
  ControlPlane(std::unique_ptr<Rendezvous> side, const std::string& prefix, int rank, int size,
               int channels, ControlSettings settings, Sampler sampler);
  ~ControlPlane();  // stop()
  ControlPlane(const ControlPlane&) = delete;
  ControlPlane& operator=(const ControlPlane&) = delete;

  void start();
  // Stops the thread; bounded (a side-channel call stuck on a dead store is left
  // to finish on its own, holding only its own state).
  void stop();

  // The newest view this rank has read (rank 0: made).
  GroupView view() const;

 private:
  struct Shared;  // what the thread touches; outlives the object if stop() gives up on it
  static void loop(std::shared_ptr<Shared> shared);
  static void round(Shared& s);

  std::shared_ptr<Shared> shared_;
  std::thread thread_;
};

// Store encodings (validated on decode; exposed for tests).
std::vector<uint8_t> encodeRankState(const RankState& state);
RankState decodeRankState(const std::vector<uint8_t>& bytes);
std::vector<uint8_t> encodeGroupView(const GroupView& view);
GroupView decodeGroupView(const std::vector<uint8_t>& bytes, int groupSize);

}  // namespace reccl
