#include "engine/executor.h"

#include <pthread.h>

#include <algorithm>
#include <system_error>
#include <thread>

#include "core/error.h"
#include "core/thread_name.h"

namespace reccl {

Executor& Executor::instance() {
  static Executor* const executor = new Executor();
  return *executor;
}

Executor::Executor() {
  // A forked child (a DataLoader worker, say) has none of the parent's
  // threads: it must not hand jobs to idlers that do not exist in it.
  pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                 [] {
                   Executor& executor = instance();
                   executor.idle_.clear();
                   executor.mutex_.unlock();
                 });
}

void Executor::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!idle_.empty()) {
      Idler* idler = idle_.back();
      idle_.pop_back();
      idler->job = std::move(job);
      // Under the lock: the idler (on its thread's stack) cannot retire and
      // vanish before it is notified.
      idler->wake.notify_one();
      return;
    }
  }
  try {
    std::thread([this, job = std::move(job)]() mutable { work(std::move(job)); }).detach();
  } catch (const std::system_error& e) {
    throw Error(std::string("reccl: cannot start a worker thread: ") + e.what());
  }
}

Millis Executor::setIdleRetirement(Millis period) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Millis previous = idleRetirement_;
  idleRetirement_ = period;
  for (Idler* idler : idle_) idler->wake.notify_one();  // to recompute their deadlines
  return previous;
}

void Executor::work(std::function<void()> job) noexcept {
  nameThisThread("reccl-worker");
  Idler self;
  for (;;) {
    job();
    job = nullptr;  // its captures may own a process group: release them before idling
    if (!awaitJob(self)) return;
    job.swap(self.job);  // leaves self.job empty for the next wait
  }
}

bool Executor::awaitJob(Idler& self) {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.push_back(&self);
  const Clock::time_point idleSince = Clock::now();
  while (!self.job) {
    const Clock::time_point retireAt = idleSince + idleRetirement_;
    if (Clock::now() >= retireAt) {
      // Still listed: `submit` unlists an idler when it hands it a job.
      idle_.erase(std::find(idle_.begin(), idle_.end(), &self));
      return false;
    }
    self.wake.wait_until(lock, retireAt);
  }
  return true;
}

}  // namespace reccl
