// Short-lived jobs (dials, handshakes), each on its own thread. The owner's
// stopAndJoin() (its destructor at the latest) refuses new jobs and waits until
// every started one has ended; a thread is let go as its job ends, so none
// lingers finished and unjoined (holding its stack) until a later job comes.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>

namespace reccl {

class JobThreads {
 public:
  JobThreads() = default;
  ~JobThreads() { stopAndJoin(); }
  JobThreads(const JobThreads&) = delete;
  JobThreads& operator=(const JobThreads&) = delete;

  // Starts `job` unless stopping.
  void run(std::function<void()> job);
  // Refuses new jobs and waits until every running one has ended.
  void stopAndJoin();

 private:
  // Shared with the job threads: the last thing each does is count itself out
  // here, so nothing of the owner is touched once stopAndJoin() has returned.
  struct State {
    std::mutex mutex;
    std::condition_variable ended;
    size_t running = 0;
    bool stopping = false;
  };
  const std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace reccl
