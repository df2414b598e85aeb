#include "transport/job_threads.h"

#include <system_error>
#include <thread>

#include "core/thread_name.h"

namespace reccl {

void JobThreads::run(std::function<void()> job) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  if (state_->stopping) return;
  auto task = std::make_shared<std::function<void()>>(std::move(job));
  try {
    std::thread([state = state_, task] {
      nameThisThread("reccl-dial");
      (*task)();
      std::lock_guard<std::mutex> done(state->mutex);
      if (--state->running == 0) state->ended.notify_all();
    }).detach();
    ++state_->running;
  } catch (const std::system_error&) {
    // The system has no thread to give: run the job here (every job is
    // bounded) rather than lose it and leave its connection waiting.
    lock.unlock();
    (*task)();
  }
}

void JobThreads::stopAndJoin() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->stopping = true;
  state_->ended.wait(lock, [&] { return state_->running == 0; });
}

}  // namespace reccl
