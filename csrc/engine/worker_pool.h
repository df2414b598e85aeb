// Runs the channels of one collective in parallel (each channel blocks on its
// own connections): the caller runs the first, the process-wide Executor the
// others, so a communicator owns no threads of its own.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace reccl {

class WorkerPool {
 public:
  // Holds no threads: the shared Executor starts them as jobs need them.
  WorkerPool() = default;
  ~WorkerPool();  // waits for any of its jobs still running
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Runs every job (jobs[0] on the calling thread, the others in parallel) and
  // returns when all have finished. When a job throws, `onError` runs once (to
  // stop the others) and the first error that is not an AbortedError is
  // rethrown. Callers serialize their calls (one collective at a time per
  // communicator); concurrent calls would also wait for each other's jobs.
  void runAll(const std::vector<std::function<void()>>& jobs, const std::function<void()>& onError);

 private:
  void awaitRunning();  // until every job handed to the executor has finished

  // Shared with the jobs, which count themselves finished and notify after the
  // caller may already have returned.
  struct State {
    std::mutex mutex;
    std::condition_variable done;
    size_t running = 0;  // jobs handed to the executor and not finished
  };
  const std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace reccl
