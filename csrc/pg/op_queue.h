// The worker thread of a process group: runs its collectives one at a time in
// the order they were issued (the same order on every rank), as c10d requires.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/clock.h"

namespace reccl {

class OpQueue {
 public:
  struct Job {
    std::function<void()> run;                         // does the op and completes its work
    std::function<void(const std::string&)> cancel;   // fails its work without running it
  };

  OpQueue();
  ~OpQueue();  // stop("process group destroyed")
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Throws Error once stopped.
  void push(Job job);
  // Waits up to `timeout` for every queued job to finish; true when idle.
  bool drain(Millis timeout);
  // Cancels the jobs not started with `why`, waits for the running one, and
  // joins the thread. Idempotent.
  void stop(const std::string& why);

 private:
  // What the worker thread uses, shared with it: when the queue is destroyed
  // from one of its own jobs (a future callback dropping the last reference to
  // the process group), the thread is detached and must not touch freed memory
  // on its way out.
  struct State {
    std::mutex mutex;
    std::condition_variable wake;
    std::condition_variable idle;
    std::deque<Job> jobs;
    bool running = false;
    bool stopping = false;
  };
  static void loop(const std::shared_ptr<State>& state);

  const std::shared_ptr<State> state_ = std::make_shared<State>();
  std::thread thread_;
};

}  // namespace reccl
