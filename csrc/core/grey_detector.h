// Grey failures: a NIC whose link is up but that delivers a fraction of its
// speed (bad optics, a congested or mis-set port). No heartbeat ever times
// out on it; only its goodput shows it. The detector compares each NIC's
// goodput while busy (bytes acknowledged / time with a message in flight,
// NicCounters::busyBytes and busyNs) with the median of its loaded peer NICs,
// or with its own history when no peer was loaded lately, and never flaps on noise:
// a window counts only with enough bytes in it (load), a verdict needs the
// NIC busy for RECCL_GREY_MS on the same side of the threshold (sustained),
// and recovering needs a higher ratio than degrading did (hysteresis).
//
// Both ends of a path see its slowness, and whichever end condemns its NIC
// first moves the path (NOTIFY, reason slow), leaving the other end's NIC
// without load to judge. So the peer's verdict counts as evidence: a NIC already
// below the threshold for half of RECCL_GREY_MS when it arrives is degraded too.
//
// A degraded NIC carries no traffic, so it cannot be measured: after
// RECCL_GREY_RETRY_MS it goes on trial (probation), traffic returns to it and
// it is measured again; a failed trial doubles the wait (up to 8x). A slow NIC
// beats none: when a connection has had no usable path for a second, every
// degraded NIC with its link up goes on trial at once (lastResort()).
//
// A window counts at most its own wall time as busy. A message held up by an
// outage is acknowledged only after it, and the busy time it reports then spans
// the outage: that is a path without a peer, which heartbeats judge, not a
// slow NIC.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/health.h"

namespace reccl {

struct GreySettings {
  double lowRatio = 0.25;      // RECCL_GREY_PCT / 100
  double recoverRatio = 0.5;   // RECCL_GREY_RECOVER_PCT / 100
  int64_t sustainNs = 2000000000;
  uint64_t minBytes = 1 << 20; // per window, for the window to count as load
  int64_t retryNs = 30000000000;

  static GreySettings fromConfig(const Config& config);
};

// Cumulative counters of one NIC at one instant.
struct GreySample {
  uint64_t bytes = 0;  // busyBytes
  int64_t busyNs = 0;
  bool linkUp = true;  // a NIC without link carries nothing and is no peer
};

// A verdict that changed: NicHealth::setGrey(nic, state, ratio, announce, detail).
struct GreyChange {
  int nic = -1;
  GreyState state = GreyState::kHealthy;
  double ratio = 1.0;
  bool announce = false;  // degraded / recovered events; a trial starting or failing is silent
  std::string detail;
};

// The decision logic alone, fed with counters: unit-testable with synthetic ones.
class GreyDetector {
 public:
  explicit GreyDetector(GreySettings settings) : settings_(settings) {}

  // `nics[i]`: NIC i's cumulative counters at `nowNs` (the same NIC at the same
  // index every call; the list may grow). Returns what changed.
  std::vector<GreyChange> sample(int64_t nowNs, const std::vector<GreySample>& nics);
  // A peer condemned the far end of a path on NIC `nic` as slow; weighed at the
  // next sample.
  void peerFoundSlow(int nic);
  // A connection has no usable path: the next sample puts every degraded NIC
  // with its link up on trial.
  void lastResort() { lastResort_ = true; }

  GreyState state(int nic) const;
  // The last measured goodput / reference of a NIC (1.0 before any).
  double ratio(int nic) const;
  // Whether the last window carried enough bytes on any NIC to be load.
  bool loaded() const { return loaded_; }

 private:
  struct Track {
    GreySample last;
    bool seen = false;
    GreyState state = GreyState::kHealthy;
    int64_t lowNs = 0;     // busy time spent below the threshold, in a row
    int64_t goodNs = 0;    // on trial: busy time spent at or above the recover ratio
    int64_t retryAtNs = 0; // degraded: when the trial starts
    int64_t retryNs = 0;   // degraded: the wait before that trial
    double ratio = 1.0;
    double history = 0.0;  // bytes/ns while healthy (EWMA); 0 before any
    double recentRate = -1.0;  // its last loaded window's goodput (bytes/ns), and when
    int64_t recentNs = 0;
    const char* against = "";  // what `ratio` was measured against, and the goodput
    double mbps = 0.0;         // then (MB/s), for the verdict's detail
    bool peerFoundSlow = false;
  };
  // Whether a NIC other than `nic` is healthy with its link up.
  bool anotherUsable(size_t nic) const;
  void degrade(size_t nic, int64_t nowNs, std::string detail, std::vector<GreyChange>& changes);

  const GreySettings settings_;
  std::vector<Track> tracks_;
  bool loaded_ = false;
  bool lastResort_ = false;
  int64_t lastSampleNs_ = 0;  // 0 before the first sample
};

// The process's detector, fed from NicHealth's counters and applying its
// verdicts there. Driven by every Supervisor (core/supervisor.cc; no thread of its own): a round
// samples when a window is due and, while bytes are moving, asks to be woken
// for the next window; an idle process is never woken for it.
class GreyMonitor {
 public:
  static constexpr int64_t kWindowNs = 250000000;  // 250 ms between samples under load

  static GreyMonitor& instance();
  // Samples if a window is due. Returns when the next sample is due while
  // traffic moves, or -1 when idle (or disabled): then the supervisor's own
  // quiet round (1 s) samples next, which also starts a degraded NIC's trial.
  int64_t tick(int64_t nowNs);
  // A peer sent NOTIFY (reason slow) for a path on NicHealth id `nic`.
  void peerFoundSlow(int nic);
  // A connection has had no usable path for a second (GreyDetector::lastResort).
  void lastResort();

 private:
  GreyMonitor();
  explicit GreyMonitor(const Config& config);
  std::mutex mutex_;
  const bool enabled_;
  GreyDetector detector_;
  int64_t lastNs_ = 0;
};

}  // namespace reccl
