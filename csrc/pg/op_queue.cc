#include "pg/op_queue.h"

#include "core/error.h"
#include "engine/executor.h"

namespace reccl {

OpQueue::~OpQueue() { stop("process group destroyed"); }

void OpQueue::push(Job job) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->stopping) throw Error("reccl: the process group has been shut down");
    state_->jobs.push_back(std::move(job));
    if (state_->busy) return;  // the running task takes it in turn
    state_->busy = true;
  }
  try {
    Executor::instance().submit([state = state_] { drainTask(state); });
  } catch (const Error& e) {
    // Nothing will run the queued jobs: fail their works now rather than leave
    // them waiting for good.
    std::deque<Job> failed;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      failed.swap(state_->jobs);
      state_->busy = false;
    }
    state_->idle.notify_all();
    for (auto& queued : failed) {
      if (queued.cancel) queued.cancel(e.what());
    }
  }
}

bool OpQueue::drain(Millis timeout) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  return state_->idle.wait_for(lock, timeout, [&] { return !state_->busy; });
}

void OpQueue::stop(const std::string& why) {
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
    dropped.swap(state_->jobs);
  }
  for (auto& job : dropped) {
    if (job.cancel) job.cancel(why);
  }
  std::unique_lock<std::mutex> lock(state_->mutex);
  // Stopped from one of its own jobs (a future callback): the task ends after
  // that job, holding its own reference to the state.
  if (state_->runner == std::this_thread::get_id()) return;
  state_->idle.wait_for(lock, kStopBound, [&] { return !state_->busy; });  // notified as it ends
}

void OpQueue::drainTask(const std::shared_ptr<State>& state) {
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->runner = std::this_thread::get_id();
  }
  for (;;) {
    Job job;
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      if (state->jobs.empty()) {
        state->busy = false;
        state->runner = std::thread::id();
        state->idle.notify_all();
        return;
      }
      job = std::move(state->jobs.front());
      state->jobs.pop_front();
    }
    job.run();
    // `job` goes here, before the lock: its captures may hold the last
    // reference to the process group, whose destruction stops this queue.
  }
}

}  // namespace reccl
