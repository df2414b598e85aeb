#include "engine/worker_pool.h"

#include <exception>

#include "engine/executor.h"
#include "engine/op_context.h"

namespace reccl {

namespace {

bool isAborted(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const AbortedError&) {
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

WorkerPool::~WorkerPool() { awaitRunning(); }

void WorkerPool::awaitRunning() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->done.wait(lock, [&] { return state_->running == 0; });  // each job notifies as it ends
}

void WorkerPool::runAll(const std::vector<std::function<void()>>& jobs,
                        const std::function<void()>& onError) {
  if (jobs.empty()) return;
  std::exception_ptr first, firstReal;  // guarded by state_->mutex
  auto fail = [&](std::exception_ptr error) {
    const bool aborted = isAborted(error);
    bool firstFailure = false;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      firstFailure = !first;
      if (!first) first = error;
      if (!aborted && !firstReal) firstReal = error;
    }
    if (firstFailure && onError) onError();
  };
  auto runGuarded = [&](const std::function<void()>& job) {
    try {
      job();
    } catch (...) {
      fail(std::current_exception());
    }
  };
  for (size_t i = 1; i < jobs.size(); ++i) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      ++state_->running;
    }
    try {
      Executor::instance().submit([&runGuarded, &job = jobs[i], state = state_] {
        runGuarded(job);
        // Touches nothing of this call after counting itself finished.
        std::lock_guard<std::mutex> lock(state->mutex);
        --state->running;
        state->done.notify_all();
      });
    } catch (...) {
      // No thread for this channel: stop the ones started; the rest never start.
      {
        std::lock_guard<std::mutex> lock(state_->mutex);
        --state_->running;
      }
      fail(std::current_exception());
      break;
    }
  }
  runGuarded(jobs[0]);
  awaitRunning();
  if (firstReal) std::rethrow_exception(firstReal);
  if (first) std::rethrow_exception(first);
}

}  // namespace reccl
