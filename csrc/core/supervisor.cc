#include "core/supervisor.h"

#include <algorithm>

#include "core/grey_detector.h"
#include "core/log.h"
#include "core/thread_name.h"

namespace reccl {

namespace {

// The item that drives GreyMonitor on this supervisor's rounds; always quiet.
class GreyTicker : public Serviced {
 public:
  explicit GreyTicker(Supervisor* supervisor) : supervisor_(supervisor) {}
  void service() override {
    const int64_t next = GreyMonitor::instance().tick(nowNs());
    if (next >= 0) supervisor_->wakeBy(atNs(next));
  }
  bool quiet() override { return true; }

 private:
  Supervisor* const supervisor_;
};

}  // namespace

Supervisor::Supervisor(Millis tick, Millis quietTick)
    : tick_(tick), quietTick_(quietTick), thread_([this] { run(); }) {
  // Grey-failure detection rides on every supervisor's rounds (no thread of its own).
  greyTicker_ = std::make_shared<GreyTicker>(this);
  add(greyTicker_);
}

Supervisor::~Supervisor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Supervisor::add(std::weak_ptr<Serviced> item) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    items_.push_back(std::move(item));
    poked_ = true;
  }
  cv_.notify_all();
}

void Supervisor::poke() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    poked_ = true;
  }
  cv_.notify_all();
}

void Supervisor::wakeBy(Clock::time_point when) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (when >= wakeBy_) return;
    wakeBy_ = when;
  }
  cv_.notify_all();  // the round waits for an earlier time now
}

std::vector<std::shared_ptr<Serviced>> Supervisor::live() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<Serviced>> out;
  items_.erase(std::remove_if(items_.begin(), items_.end(),
                              [&](const std::weak_ptr<Serviced>& weak) {
                                auto strong = weak.lock();
                                if (!strong) return true;
                                out.push_back(std::move(strong));
                                return false;
                              }),
               items_.end());
  return out;
}

void Supervisor::forEach(const std::function<void(Serviced&)>& fn) {
  for (auto& item : live()) fn(*item);
}

void Supervisor::run() {
  nameThisThread("reccl-supervise");
  bool quiet = false;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // Healthy connections have no deadlines: an idle process does not tick.
      const Clock::time_point tickEnd = Clock::now() + (quiet ? quietTick_ : tick_);
      while (!poked_ && !stopping_) {
        const Clock::time_point until = std::min(tickEnd, wakeBy_);
        if (Clock::now() >= until) break;
        cv_.wait_until(lock, until);
      }
      if (stopping_) return;
      poked_ = false;
      wakeBy_ = Clock::time_point::max();  // items due later ask again in this round
    }
    quiet = true;
    for (auto& item : live()) {
      try {
        item->service();
        quiet = item->quiet() && quiet;
      } catch (const std::exception& error) {
        quiet = false;
        RECCL_LOG(kWarn, std::string("supervisor: ") + error.what());
      }
    }
  }
}

}  // namespace reccl
