#include "pg/op_queue.h"

#include "core/error.h"

namespace reccl {

OpQueue::OpQueue() : thread_([state = state_] { loop(state); }) {}

OpQueue::~OpQueue() { stop("process group destroyed"); }

void OpQueue::push(Job job) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->stopping) throw Error("reccl: the process group has been shut down");
    state_->jobs.push_back(std::move(job));
  }
  state_->wake.notify_one();
}

bool OpQueue::drain(Millis timeout) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  return state_->idle.wait_for(lock, timeout,
                               [&] { return state_->jobs.empty() && !state_->running; });
}

void OpQueue::stop(const std::string& why) {
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
    dropped.swap(state_->jobs);
  }
  state_->wake.notify_all();
  for (auto& job : dropped) {
    if (job.cancel) job.cancel(why);
  }
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    // Stopped from one of its own jobs (a future callback): the thread exits
    // after it, holding its own reference to the state.
    thread_.detach();
  } else {
    thread_.join();
  }
}

void OpQueue::loop(const std::shared_ptr<State>& state) {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(state->mutex);
      state->wake.wait(lock, [&] { return state->stopping || !state->jobs.empty(); });
      if (state->jobs.empty()) {
        state->idle.notify_all();
        return;
      }
      job = std::move(state->jobs.front());
      state->jobs.pop_front();
      state->running = true;
    }
    job.run();  // completes its work, with an error if it failed; never throws
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      state->running = false;
    }
    state->idle.notify_all();
  }
}

}  // namespace reccl
