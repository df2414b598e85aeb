#include "pg/op_queue.h"

#include "core/error.h"

namespace reccl {

OpQueue::OpQueue() : thread_([this] { loop(); }) {}

OpQueue::~OpQueue() { stop("process group destroyed"); }

void OpQueue::push(Job job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw Error("reccl: the process group has been shut down");
    jobs_.push_back(std::move(job));
  }
  wake_.notify_one();
}

bool OpQueue::drain(Millis timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  return idle_.wait_for(lock, timeout, [&] { return jobs_.empty() && !running_; });
}

void OpQueue::stop(const std::string& why) {
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    dropped.swap(jobs_);
  }
  wake_.notify_all();
  for (auto& job : dropped) {
    if (job.cancel) job.cancel(why);
  }
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();  // stopped from one of its own jobs (a future callback): it exits after it
  } else {
    thread_.join();
  }
}

void OpQueue::loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) {
        idle_.notify_all();
        return;
      }
      job = std::move(jobs_.front());
      jobs_.pop_front();
      running_ = true;
    }
    job.run();  // completes its work, with an error if it failed; never throws
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = false;
    }
    idle_.notify_all();
  }
}

}  // namespace reccl
