#include "core/health.h"

#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"

namespace reccl {

NicHealth& NicHealth::instance() {
  // Leaked on purpose: library threads may still report during static destruction.
  static NicHealth* table = new NicHealth();
  return *table;
}

int NicHealth::registerNic(const std::string& name, bool linkUp) {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t count = count_.load();
  for (size_t i = 0; i < count; ++i) {
    if (entries_[i].name == name) return static_cast<int>(i);
  }
  if (count == kMaxNics) {
    throw Error("too many NICs: the health table holds at most " + std::to_string(kMaxNics));
  }
  entries_[count].name = name;
  entries_[count].linkUp.store(linkUp);
  count_.store(count + 1);
  return static_cast<int>(count);
}

int NicHealth::idOf(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < count_.load(); ++i) {
    if (entries_[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

std::vector<std::string> NicHealth::names() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> out;
  for (size_t i = 0; i < count_.load(); ++i) out.push_back(entries_[i].name);
  return out;
}

void NicHealth::setLinkUp(int id, bool up, Reason reason) {
  const bool wasUp = linkUsable(id), wasUsable = usable(id);
  entries_.at(id).linkUp.store(up);
  notify(id, wasUp, wasUsable, reason);
}

void NicHealth::setInjectedDown(int id, bool down) {
  const bool wasUp = linkUsable(id), wasUsable = usable(id);
  entries_.at(id).injectedDown.store(down);
  notify(id, wasUp, wasUsable, Reason::kInjected);
}

bool NicHealth::linkUsable(int id) const {
  const Entry& entry = entries_.at(id);
  return entry.linkUp.load() && !entry.injectedDown.load();
}

void NicHealth::setBlackhole(int id, bool on) { entries_.at(id).blackhole.store(on); }

bool NicHealth::usable(int id) const {
  return linkUsable(id) && entries_.at(id).grey.load() != GreyState::kDegraded;
}

const char* greyStateName(GreyState state) {
  switch (state) {
    case GreyState::kHealthy: return "healthy";
    case GreyState::kDegraded: return "degraded";
    case GreyState::kProbation: return "probation";
  }
  return "unknown";
}

void NicHealth::setGrey(int id, GreyState state, double ratio, bool announce,
                        const std::string& detail) {
  Entry& entry = entries_.at(id);
  const bool linkWasUp = linkUsable(id), wasUsable = usable(id);
  entry.greyRatio.store(state == GreyState::kHealthy ? 1.0 : ratio);
  entry.grey.store(state);
  if (announce) {
    Event event;
    event.kind = state == GreyState::kHealthy ? EventKind::kRecovered : EventKind::kDegraded;
    event.reason = state == GreyState::kHealthy ? Reason::kHealed : Reason::kSlow;
    event.nic = entry.name;
    event.detail = detail;
    emit(std::move(event));
  }
  // Connections move off (or back) as on a link change, but the event said it.
  notify(id, linkWasUp, wasUsable, state == GreyState::kHealthy ? Reason::kHealed : Reason::kSlow);
}

GreyState NicHealth::grey(int id) const { return entries_.at(id).grey.load(); }

double NicHealth::weight(int id) const {
  const Entry& entry = entries_.at(id);
  return entry.grey.load() == GreyState::kHealthy ? 1.0 : entry.greyRatio.load();
}

void NicHealth::beginBusy(int id) {
  Entry& entry = entries_.at(id);
  std::lock_guard<std::mutex> lock(entry.busyMutex);
  if (entry.inFlight++ == 0) entry.busyMarkNs = nowNs();
}

void NicHealth::endBusy(int id, uint64_t bytes) {
  Entry& entry = entries_.at(id);
  std::lock_guard<std::mutex> lock(entry.busyMutex);
  const int64_t now = nowNs();
  entry.counters.busyNs.fetch_add(now - entry.busyMarkNs);
  entry.busyMarkNs = now;
  --entry.inFlight;
  entry.counters.busyBytes.fetch_add(bytes);
}

NicBusy::NicBusy(int healthId) : id_(healthId) { NicHealth::instance().beginBusy(id_); }

NicBusy& NicBusy::operator=(NicBusy&& other) noexcept {
  if (this != &other) {
    end(0);
    id_ = other.id_;
    other.id_ = -1;
  }
  return *this;
}

void NicBusy::end(uint64_t bytes) {
  if (id_ < 0) return;
  NicHealth::instance().endBusy(id_, bytes);
  id_ = -1;
}

bool NicHealth::blackholed(int id) const { return entries_.at(id).blackhole.load(); }

NicCounters& NicHealth::counters(int id) { return entries_.at(id).counters; }

uint64_t NicHealth::addListener(Listener listener) {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t token = nextToken_++;
  listeners_[token] = std::move(listener);
  return token;
}

void NicHealth::removeListener(uint64_t token) {
  std::lock_guard<std::mutex> lock(mutex_);
  listeners_.erase(token);
}

void NicHealth::emit(Event event) {
  if (event.wallNs == 0) event.wallNs = wallNs();
  RECCL_LOG(kInfo, std::string(eventKindName(event.kind)) + " nic=" + event.nic + " peer=" +
                       event.peer + " reason=" + reasonName(event.reason) + " " + event.detail);
  events_.push(std::move(event));
}

void NicHealth::notify(int id, bool linkWasUp, bool wasUsable, Reason reason) {
  const bool linkUp = linkUsable(id), nowUsable = usable(id);
  if (nowUsable == wasUsable && linkUp == linkWasUp) return;
  std::string name;
  std::vector<Listener> listeners;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    name = entries_.at(id).name;
    for (const auto& [token, listener] : listeners_) listeners.push_back(listener);
  }
  if (linkUp != linkWasUp) {
    Event change;
    change.kind = linkUp ? EventKind::kNicUp : EventKind::kNicDown;
    change.reason = reason;
    change.nic = name;
    emit(std::move(change));
  }
  if (nowUsable == wasUsable) return;
  // Listeners only queue work for their own threads; they never block here.
  for (const auto& listener : listeners) listener(name, nowUsable, reason);
}

void NicHealth::addTransitBytes(int64_t delta) {
  int64_t now = transitBytes_.fetch_add(delta) + delta;
  int64_t peak = transitPeakBytes_.load();
  while (now > peak && !transitPeakBytes_.compare_exchange_weak(peak, now)) {
  }
}

}  // namespace reccl
