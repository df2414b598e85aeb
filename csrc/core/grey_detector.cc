#include "core/grey_detector.h"

#include <algorithm>
#include <cstdio>

#include "core/clock.h"
#include "core/log.h"

namespace reccl {

namespace {

constexpr double kHistoryWeight = 0.2;  // EWMA weight of a new healthy window
constexpr int kMaxRetryDoublings = 3;   // a failed trial doubles the wait, up to 8x

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2.0;
}

std::string describe(const char* what, double ratio, const char* against, double mbps) {
  char text[160];
  std::snprintf(text, sizeof(text), "%s: goodput %.0f%% of %s (%.1f MB/s while busy)", what,
                ratio * 100.0, against, mbps);
  return text;
}

}  // namespace

GreySettings GreySettings::fromConfig(const Config& config) {
  GreySettings s;
  s.lowRatio = config.greyPct / 100.0;
  s.recoverRatio = config.greyRecoverPct / 100.0;
  s.sustainNs = int64_t{config.greyMs} * 1000000;
  s.minBytes = static_cast<uint64_t>(config.greyMinBytes);
  s.retryNs = int64_t{config.greyRetryMs} * 1000000;
  return s;
}

GreyState GreyDetector::state(int nic) const {
  return nic >= 0 && nic < static_cast<int>(tracks_.size()) ? tracks_[nic].state
                                                            : GreyState::kHealthy;
}

double GreyDetector::ratio(int nic) const {
  return nic >= 0 && nic < static_cast<int>(tracks_.size()) ? tracks_[nic].ratio : 1.0;
}

std::vector<GreyChange> GreyDetector::sample(int64_t nowNs, const std::vector<GreySample>& nics) {
  if (tracks_.size() < nics.size()) tracks_.resize(nics.size());
  // This window's goodput while busy (bytes/ns), for each NIC that was loaded.
  const size_t n = nics.size();
  std::vector<double> rate(n, -1.0);
  std::vector<int64_t> busy(n, 0);
  loaded_ = false;
  const int64_t windowNs = lastSampleNs_ != 0 ? nowNs - lastSampleNs_ : 0;
  lastSampleNs_ = nowNs;
  for (size_t i = 0; i < n; ++i) {
    Track& track = tracks_[i];
    const GreySample& now = nics[i];
    if (track.seen && now.linkUp) {
      const uint64_t bytes = now.bytes - track.last.bytes;
      busy[i] = std::min(now.busyNs - track.last.busyNs, windowNs);
      if (bytes >= settings_.minBytes && busy[i] > 0) {
        rate[i] = static_cast<double>(bytes) / static_cast<double>(busy[i]);
        track.recentRate = rate[i];
        track.recentNs = nowNs;
        loaded_ = true;
      }
    }
    track.last = now;
    track.seen = true;
  }

  std::vector<GreyChange> changes;
  const bool lastResort = lastResort_;
  lastResort_ = false;
  for (size_t i = 0; i < n; ++i) {
    Track& track = tracks_[i];
    if (lastResort && track.state == GreyState::kDegraded && nics[i].linkUp) {
      track.retryAtNs = nowNs;
    }
    if (track.peerFoundSlow) {
      track.peerFoundSlow = false;
      if (track.state == GreyState::kHealthy && track.lowNs >= settings_.sustainNs / 2 &&
          anotherUsable(i)) {
        degrade(i, nowNs,
                describe("degraded", track.ratio, track.against, track.mbps) +
                    "; the peer found the path slow too",
                changes);
        continue;
      }
    }
    if (track.state == GreyState::kDegraded) {
      if (nowNs >= track.retryAtNs) {
        // It carries nothing while degraded: let traffic back to measure it.
        track.state = GreyState::kProbation;
        track.lowNs = track.goodNs = 0;
        changes.push_back({static_cast<int>(i), GreyState::kProbation, track.ratio, false,
                           "on trial: traffic returns to measure it"});
      }
      continue;
    }
    if (rate[i] < 0) continue;  // no load: nothing learnt, nothing forgotten
    // The reference: the median of the peers that are not under suspicion, each
    // at its goodput while busy in its latest loaded window, if no older than
    // RECCL_GREY_MS. Goodput while busy belongs to the NIC, not to the load it
    // got, so it stands for windows the peer carried too little in. Those are
    // common: in a lockstep collective the fast NICs finish their share early
    // and idle while the slow one, always loaded, is judged. Compared with its
    // own history in such windows instead, a NIC slow from its first loaded
    // window (that history) read healthy and restarted its count every time.
    std::vector<double> peers;
    for (size_t j = 0; j < n; ++j) {
      const Track& peer = tracks_[j];
      if (j == i || peer.state != GreyState::kHealthy || !peer.last.linkUp) continue;
      if (rate[j] >= 0) {
        peers.push_back(rate[j]);
      } else if (peer.recentRate >= 0 && nowNs - peer.recentNs <= settings_.sustainNs) {
        peers.push_back(peer.recentRate);
      }
    }
    const char* against = "its peer NICs' median";
    double reference = 0.0;
    if (!peers.empty()) {
      reference = median(peers);
    } else if (track.history > 0.0) {
      reference = track.history;
      against = "its own history";
    } else {
      if (track.state == GreyState::kHealthy) track.history = rate[i];
      continue;  // nothing to compare with yet
    }
    track.ratio = rate[i] / reference;
    track.against = against;
    track.mbps = rate[i] * 1e3;  // bytes/ns -> MB/s
    const double mbps = track.mbps;
    if (track.state == GreyState::kHealthy) {
      if (track.ratio < settings_.lowRatio) {
        track.lowNs += busy[i];
        // The last usable NIC stays: its traffic would have nowhere to go, and a
        // NIC alone at full load reads low against a history of short bursts.
        if (!anotherUsable(i)) track.lowNs = 0;
        if (track.lowNs >= settings_.sustainNs) {
          degrade(i, nowNs, describe("degraded", track.ratio, against, mbps), changes);
        }
      } else {
        track.lowNs = 0;
        if (track.ratio >= settings_.recoverRatio) {
          track.history = track.history > 0.0
                              ? (1.0 - kHistoryWeight) * track.history + kHistoryWeight * rate[i]
                              : rate[i];
        }
      }
      continue;
    }
    // On trial: recovered once at or above the recover ratio for long enough;
    // degraded again (silently, with a longer wait) once below it for as long.
    if (track.ratio >= settings_.recoverRatio) {
      track.goodNs += busy[i];
      track.lowNs = 0;
      if (track.goodNs >= settings_.sustainNs) {
        track.state = GreyState::kHealthy;
        track.goodNs = 0;
        changes.push_back({static_cast<int>(i), GreyState::kHealthy, track.ratio, true,
                           describe("recovered", track.ratio, against, mbps)});
      }
    } else {
      track.lowNs += busy[i];
      track.goodNs = 0;
      if (track.lowNs >= settings_.sustainNs) {
        track.state = GreyState::kDegraded;
        track.retryNs = std::min(track.retryNs * 2, settings_.retryNs << kMaxRetryDoublings);
        track.retryAtNs = nowNs + track.retryNs;
        track.lowNs = 0;
        changes.push_back({static_cast<int>(i), GreyState::kDegraded, track.ratio, false,
                           describe("trial failed", track.ratio, against, mbps)});
      }
    }
  }
  return changes;
}

void GreyDetector::peerFoundSlow(int nic) {
  if (nic >= 0 && nic < static_cast<int>(tracks_.size())) tracks_[nic].peerFoundSlow = true;
}

bool GreyDetector::anotherUsable(size_t nic) const {
  for (size_t j = 0; j < tracks_.size(); ++j) {
    if (j != nic && tracks_[j].state == GreyState::kHealthy && tracks_[j].last.linkUp) return true;
  }
  return false;
}

void GreyDetector::degrade(size_t nic, int64_t nowNs, std::string detail,
                           std::vector<GreyChange>& changes) {
  Track& track = tracks_[nic];
  track.state = GreyState::kDegraded;
  track.retryNs = settings_.retryNs;
  track.retryAtNs = nowNs + track.retryNs;
  track.lowNs = 0;
  changes.push_back(
      {static_cast<int>(nic), GreyState::kDegraded, track.ratio, true, std::move(detail)});
}

GreyMonitor& GreyMonitor::instance() {
  // Leaked on purpose, like NicHealth: supervisors may tick during static destruction.
  static GreyMonitor* monitor = new GreyMonitor();
  return *monitor;
}

GreyMonitor::GreyMonitor() : GreyMonitor(Config::fromProcessEnv()) {}

GreyMonitor::GreyMonitor(const Config& config)
    : enabled_(config.grey), detector_(GreySettings::fromConfig(config)) {}

int64_t GreyMonitor::tick(int64_t nowNs) {
  if (!enabled_) return -1;
  std::vector<GreyChange> changes;
  int64_t next = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Several supervisors drive it; a window is sampled once, whoever comes first.
    if (lastNs_ != 0 && nowNs - lastNs_ < kWindowNs * 9 / 10) {
      return detector_.loaded() ? lastNs_ + kWindowNs : -1;
    }
    NicHealth& health = NicHealth::instance();
    const size_t count = health.names().size();
    std::vector<GreySample> samples(count);
    for (size_t i = 0; i < count; ++i) {
      const int id = static_cast<int>(i);
      NicCounters& counters = health.counters(id);
      samples[i].bytes = counters.busyBytes.load();
      samples[i].busyNs = counters.busyNs.load();
      samples[i].linkUp = health.linkUsable(id);
    }
    changes = detector_.sample(nowNs, samples);
    lastNs_ = nowNs;
    if (detector_.loaded()) next = nowNs + kWindowNs;
  }
  NicHealth& health = NicHealth::instance();
  for (const GreyChange& change : changes) {
    RECCL_LOG(kInfo, "grey: " + health.names().at(change.nic) + " " + change.detail);
    health.setGrey(change.nic, change.state, change.ratio, change.announce, change.detail);
  }
  return next;
}

void GreyMonitor::peerFoundSlow(int nic) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  detector_.peerFoundSlow(nic);
}

void GreyMonitor::lastResort() {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  detector_.lastResort();
}

}  // namespace reccl
