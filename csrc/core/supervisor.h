// The thread that drives connections through failover: it reaps failed paths,
// starts dials, activates paths and enforces the no-path bound. Path threads and
// health listeners only mark state and poke it, so they never block on a join.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/clock.h"

namespace reccl {

class Serviced {
 public:
  virtual ~Serviced() = default;
  virtual void service() = 0;
  // True when no deadline is pending: service() has nothing to do until
  // something pokes the supervisor (a path fails, a dial ends, a NIC changes).
  virtual bool quiet() { return false; }
};

class Supervisor {
 public:
  // `tick` bounds how long a deadline can be overlooked when nobody pokes.
  // While every item is quiet the supervisor sleeps `quietTick` between
  // rounds instead, a safety net for a change that forgot to poke.
  explicit Supervisor(Millis tick = Millis(20), Millis quietTick = Millis(1000));
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  void add(std::weak_ptr<Serviced> item);
  void poke();
  // Any thread: the next round starts at `when` at the latest, however long
  // the items are quiet. For an item's own deadline (e.g. a resync fence).
  void wakeBy(Clock::time_point when);
  // Runs `fn` on every live item (from the caller's thread).
  void forEach(const std::function<void(Serviced&)>& fn);

 private:
  void run();
  std::vector<std::shared_ptr<Serviced>> live();

  const Millis tick_;
  const Millis quietTick_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::weak_ptr<Serviced>> items_;
  bool poked_ = false;
  Clock::time_point wakeBy_ = Clock::time_point::max();  // the earliest wakeBy() pending
  bool stopping_ = false;
  std::thread thread_;
  std::shared_ptr<Serviced> greyTicker_;  // GreyMonitor's driver (core/grey_detector.h)
};

}  // namespace reccl
