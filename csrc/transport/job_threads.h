// Short-lived jobs (dials, handshakes), each on its own thread, joined when
// they finish (at the next run()) or when the owner stops.
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <thread>

namespace reccl {

class JobThreads {
 public:
  JobThreads() = default;
  ~JobThreads() { stopAndJoin(); }
  JobThreads(const JobThreads&) = delete;
  JobThreads& operator=(const JobThreads&) = delete;

  // Starts `job` unless stopping; joins the jobs that have finished.
  void run(std::function<void()> job);
  // Refuses new jobs and joins every running one.
  void stopAndJoin();

 private:
  std::mutex mutex_;
  std::list<std::pair<std::thread, std::shared_ptr<std::atomic<bool>>>> jobs_;
  bool stopping_ = false;
};

}  // namespace reccl
