// The threads that run the channels of one collective in parallel (each
// channel blocks on its own connections). Owned by a communicator; joined when
// it is destroyed.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace reccl {

class WorkerPool {
 public:
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Runs every job (jobs[0] on the calling thread) and returns when all have
  // finished. When a job throws, `onError` runs once (to stop the others) and
  // the first error that is not an AbortedError is rethrown.
  void runAll(const std::vector<std::function<void()>>& jobs, const std::function<void()>& onError);

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::function<void()>> queue_;
  size_t running_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace reccl
