#include "engine/worker_pool.h"

#include "engine/op_context.h"

namespace reccl {

WorkerPool::WorkerPool(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkerPool::loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      job = std::move(queue_.back());
      queue_.pop_back();
    }
    job();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --running_;
    }
    done_.notify_all();
  }
}

void WorkerPool::runAll(const std::vector<std::function<void()>>& jobs,
                        const std::function<void()>& onError) {
  std::mutex errorMutex;
  std::exception_ptr first, firstReal;
  auto wrap = [&](const std::function<void()>& job) {
    return [&, job] {
      try {
        job();
      } catch (...) {
        std::exception_ptr e = std::current_exception();
        bool aborted = false;
        try {
          std::rethrow_exception(e);
        } catch (const AbortedError&) {
          aborted = true;
        } catch (...) {
        }
        bool call = false;
        {
          std::lock_guard<std::mutex> lock(errorMutex);
          call = !first;
          if (!first) first = e;
          if (!aborted && !firstReal) firstReal = e;
        }
        if (call && onError) onError();
      }
    };
  };
  if (jobs.empty()) return;
  if (jobs.size() > 1 && threads_.size() + 1 < jobs.size()) {
    // More jobs than threads: run the extra ones on the caller afterwards
    // would serialize channels that must run together; refuse instead.
    throw Error("worker pool too small for " + std::to_string(jobs.size()) + " channels");
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 1; i < jobs.size(); ++i) {
      queue_.push_back(wrap(jobs[i]));
      ++running_;
    }
  }
  wake_.notify_all();
  wrap(jobs[0])();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return running_ == 0; });
  }
  if (firstReal) std::rethrow_exception(firstReal);
  if (first) std::rethrow_exception(first);
}

}  // namespace reccl
