#include "transport/job_threads.h"

namespace reccl {

void JobThreads::run(std::function<void()> job) {
  std::lock_guard<std::mutex> lock(mutex_);
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
  jobs_.emplace_back(std::thread([job = std::move(job), done] {
                       job();
                       done->store(true);
                     }),
                     done);
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
