#include "transport/job_threads.h"

#include <system_error>

#include "core/thread_name.h"

namespace reccl {

void JobThreads::run(std::function<void()> job) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopping_) return;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (it->second->load()) {
      it->first.join();
      it = jobs_.erase(it);
    } else {
      ++it;
    }
  }
  auto done = std::make_shared<std::atomic<bool>>(false);
  auto task = std::make_shared<std::function<void()>>(std::move(job));
  try {
    jobs_.emplace_back(std::thread([task, done] {
                         nameThisThread("reccl-dial");
                         (*task)();
                         done->store(true);
                       }),
                       done);
  } catch (const std::system_error&) {
    // The system has no thread to give: run the job here (every job is
    // bounded) rather than lose it and leave its connection waiting.
    lock.unlock();
    (*task)();
  }
}

void JobThreads::stopAndJoin() {
  std::list<std::pair<std::thread, std::shared_ptr<std::atomic<bool>>>> jobs;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    jobs.swap(jobs_);
  }
  for (auto& [thread, done] : jobs) thread.join();
}

}  // namespace reccl
