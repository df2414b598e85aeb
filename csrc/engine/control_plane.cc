#include "engine/control_plane.h"

#include <cstring>

#include "core/error.h"
#include "core/log.h"

namespace reccl {

namespace {

constexpr uint32_t kStateMagic = 0x32534352;  // "RCS2"
constexpr uint32_t kViewMagic = 0x32564352;   // "RCV2"
// A side-channel call that outlasts this is a dead store, not a slow one.
constexpr Millis kSideChannelTimeout{10000};
// stop() waits this long past one period for the thread to notice.
constexpr Millis kStopGrace{5000};

class Writer {
 public:
  template <typename T>
  void put(T value) {
    const auto* p = reinterpret_cast<const uint8_t*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  std::vector<uint8_t> take() { return std::move(bytes_); }

 private:
  std::vector<uint8_t> bytes_;
};

class Reader {
 public:
  Reader(const std::vector<uint8_t>& bytes, const char* what) : bytes_(bytes), what_(what) {}
  template <typename T>
  T get() {
    if (offset_ + sizeof(T) > bytes_.size()) {
      throw ProtocolError(std::string("reccl control plane: truncated ") + what_ + " (" +
                          std::to_string(bytes_.size()) + " bytes)");
    }
    T value;
    std::memcpy(&value, bytes_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }
  void expectMagic(uint32_t magic) {
    if (get<uint32_t>() != magic) {
      throw ProtocolError(std::string("reccl control plane: not a ") + what_ +
                          " (bad magic); another program uses this store's keys?");
    }
  }
  void expectEnd() const {
    if (offset_ != bytes_.size()) {
      throw ProtocolError(std::string("reccl control plane: ") + what_ + " has " +
                          std::to_string(bytes_.size() - offset_) + " trailing bytes");
    }
  }

 private:
  const std::vector<uint8_t>& bytes_;
  const char* what_;
  size_t offset_ = 0;
};

void putState(Writer& w, const RankState& s) {
  w.put(s.opsDone);
  w.put(s.backupChannels);
  w.put(s.nicsDown);
  w.put(s.deviceOps);
}

RankState getState(Reader& r) {
  RankState s;
  s.opsDone = r.get<uint64_t>();
  s.backupChannels = r.get<uint64_t>();
  s.nicsDown = r.get<uint64_t>();
  s.deviceOps = r.get<uint64_t>();
  return s;
}

std::string stateKey(const std::string& prefix, int rank) {
  return prefix + "ctl/state/" + std::to_string(rank);
}
std::string viewKey(const std::string& prefix) { return prefix + "ctl/view"; }

}  // namespace

std::vector<uint8_t> encodeRankState(const RankState& state) {
  Writer w;
  w.put(kStateMagic);
  putState(w, state);
  return w.take();
}

RankState decodeRankState(const std::vector<uint8_t>& bytes) {
  Reader r(bytes, "rank state");
  r.expectMagic(kStateMagic);
  RankState s = getState(r);
  r.expectEnd();
  return s;
}

std::vector<uint8_t> encodeGroupView(const GroupView& view) {
  Writer w;
  w.put(kViewMagic);
  w.put(view.round);
  w.put(view.plan.id);
  w.put(view.plan.startOp);
  w.put(view.plan.avoidMask);
  w.put(view.maxOpsDone);
  w.put(static_cast<uint32_t>(view.degraded.size()));
  for (const DegradedRank& d : view.degraded) {
    w.put(static_cast<int32_t>(d.rank));
    putState(w, d.state);
  }
  return w.take();
}

GroupView decodeGroupView(const std::vector<uint8_t>& bytes, int groupSize) {
  Reader r(bytes, "group view");
  r.expectMagic(kViewMagic);
  GroupView view;
  view.round = r.get<uint64_t>();
  view.plan.id = r.get<uint64_t>();
  view.plan.startOp = r.get<uint64_t>();
  view.plan.avoidMask = r.get<uint64_t>();
  view.maxOpsDone = r.get<uint64_t>();
  uint32_t count = r.get<uint32_t>();
  if (count > static_cast<uint32_t>(groupSize)) {
    throw ProtocolError("reccl control plane: group view lists " + std::to_string(count) +
                        " degraded ranks in a group of " + std::to_string(groupSize));
  }
  for (uint32_t i = 0; i < count; ++i) {
    DegradedRank d;
    d.rank = r.get<int32_t>();
    if (d.rank < 0 || d.rank >= groupSize) {
      throw ProtocolError("reccl control plane: group view names rank " +
                          std::to_string(d.rank) + " of a group of " + std::to_string(groupSize));
    }
    d.state = getState(r);
    view.degraded.push_back(d);
  }
  r.expectEnd();
  return view;
}

struct ControlPlane::Shared {
  std::unique_ptr<Rendezvous> side;
  std::string prefix;
  int rank = 0;
  int size = 0;
  int channels = 0;
  ControlSettings settings;
  Sampler sampler;

  std::mutex mutex;
  std::condition_variable cv;
  bool stopping = false;
  bool finished = false;
  GroupView view;
  std::string lastError;
};

ControlPlane::ControlPlane(std::unique_ptr<Rendezvous> side, const std::string& prefix, int rank,
                           int size, int channels, ControlSettings settings, Sampler sampler)
    : shared_(std::make_shared<Shared>()) {
  Shared& s = *shared_;
  s.side = std::move(side);
  s.prefix = prefix;
  s.rank = rank;
  s.size = size;
  s.channels = channels;
  s.settings = settings;
  s.sampler = std::move(sampler);
  if (!settings.enabled) return;
  s.side->set(stateKey(s.prefix, rank), encodeRankState(RankState{}));
  if (rank == 0) s.side->set(viewKey(s.prefix), encodeGroupView(GroupView{}));
}

ControlPlane::~ControlPlane() { stop(); }

void ControlPlane::start() {
  if (!shared_->settings.enabled || thread_.joinable()) return;
  thread_ = std::thread(&ControlPlane::loop, shared_);
}

void ControlPlane::stop() {
  if (!thread_.joinable()) return;
  std::unique_lock<std::mutex> lock(shared_->mutex);
  shared_->stopping = true;
  shared_->cv.notify_all();
  bool finished = shared_->cv.wait_for(lock, shared_->settings.period + kStopGrace,
                                       [&] { return shared_->finished; });
  lock.unlock();
  if (finished) {
    thread_.join();
  } else {
    // Stuck in a store call (the store's host died): the thread owns everything
    // it touches (shared_) and never calls the sampler again, so let it go.
    RECCL_LOG(kWarn, "reccl control plane: side channel unresponsive at shutdown; not waiting");
    thread_.detach();
  }
}

GroupView ControlPlane::view() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->view;
}

void ControlPlane::loop(std::shared_ptr<Shared> shared) {
  Shared& s = *shared;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(s.mutex);
      if (s.cv.wait_for(lock, s.settings.period, [&] { return s.stopping; })) break;
    }
    try {
      round(s);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (!s.stopping && s.lastError != e.what()) {
        s.lastError = e.what();
        RECCL_LOG(kWarn, std::string("reccl control plane (rank ") + std::to_string(s.rank) +
                             "): " + e.what());
      }
    }
  }
  std::lock_guard<std::mutex> lock(s.mutex);
  s.finished = true;
  s.cv.notify_all();
}

void ControlPlane::round(Shared& s) {
  RankState mine;
  {
    // Under the lock so that once stop() has returned the sampler (which reads
    // the communicator) is never called again.
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.stopping) return;
    mine = s.sampler();
  }
  s.side->set(stateKey(s.prefix, s.rank), encodeRankState(mine));
  if (s.rank != 0) {
    GroupView view = decodeGroupView(s.side->get(viewKey(s.prefix), kSideChannelTimeout), s.size);
    std::lock_guard<std::mutex> lock(s.mutex);
    if (view.round >= s.view.round) s.view = std::move(view);
    return;
  }
  std::vector<std::string> keys;
  for (int r = 0; r < s.size; ++r) keys.push_back(stateKey(s.prefix, r));
  std::vector<std::vector<uint8_t>> raw = s.side->getMany(keys, kSideChannelTimeout);
  GroupView view;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    view.plan = s.view.plan;
    view.round = s.view.round + 1;
  }
  uint64_t onBackup = 0;
  for (int r = 0; r < s.size; ++r) {
    RankState state = r == 0 ? mine : decodeRankState(raw.at(r));
    view.maxOpsDone = std::max(view.maxOpsDone, state.opsDone);
    onBackup |= state.backupChannels;
    if (state.backupChannels != 0 || state.nicsDown != 0) view.degraded.push_back({r, state});
  }
  uint64_t avoid = s.settings.rebalance ? onBackup & allChannelsMask(s.channels) : 0;
  if (avoid == allChannelsMask(s.channels)) avoid = 0;  // nothing healthy to move to
  if (avoid != view.plan.avoidMask) {
    view.plan = PlanProposal{view.plan.id + 1, view.maxOpsDone + s.settings.offset, avoid};
    RECCL_LOG(kInfo, "reccl control plane: plan " + std::to_string(view.plan.id) + " from op " +
                         std::to_string(view.plan.startOp) + ": " + describeChannels(avoid) +
                         " carry no data");
  }
  s.side->set(viewKey(s.prefix), encodeGroupView(view));
  std::lock_guard<std::mutex> lock(s.mutex);
  s.view = std::move(view);
}

}  // namespace reccl
