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
  bool wasUsable = usable(id);
  entries_.at(id).linkUp.store(up);
  notify(id, wasUsable, reason);
}

void NicHealth::setInjectedDown(int id, bool down) {
  bool wasUsable = usable(id);
  entries_.at(id).injectedDown.store(down);
  notify(id, wasUsable, Reason::kInjected);
}

void NicHealth::setBlackhole(int id, bool on) { entries_.at(id).blackhole.store(on); }

bool NicHealth::usable(int id) const {
  const Entry& entry = entries_.at(id);
  return entry.linkUp.load() && !entry.injectedDown.load();
}

bool NicHealth::blackholed(int id) const { return entries_.at(id).blackhole.load(); }

double NicHealth::weight(int id) const {
  (void)entries_.at(id);  // range check, as every accessor
  return 1.0;
}

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
  RECCL_LOG(kInfo, std::string(eventKindName(event.kind)) + " nic=" + event.nic +
                       " peer=" + event.peer + " reason=" + reasonName(event.reason) + " " +
                       event.detail);
  events_.push(std::move(event));
}

void NicHealth::notify(int id, bool wasUsable, Reason reason) {
  bool nowUsable = usable(id);
  if (nowUsable == wasUsable) return;
  std::string name;
  std::vector<Listener> listeners;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    name = entries_.at(id).name;
    for (const auto& [token, listener] : listeners_) listeners.push_back(listener);
  }
  Event event;
  event.kind = nowUsable ? EventKind::kNicUp : EventKind::kNicDown;
  event.reason = reason;
  event.nic = name;
  emit(std::move(event));
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
