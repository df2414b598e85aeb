// The op queue of a process group: runs its collectives one at a time in the
// order they were issued (the same order on every rank), as c10d requires. A
// queue owns no thread: while it has jobs, one task on the process-wide
// Executor runs them in order and ends when the queue is empty.
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
    std::function<void()> run;  // does the op and completes its work; never throws
    std::function<void(const std::string&)> cancel;  // fails its work without running it
  };

  OpQueue() = default;
  ~OpQueue();  // stop("process group destroyed")
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Throws Error once stopped. When no thread can be started to run the
  // queue, cancels its jobs (this one included) with the reason.
  void push(Job job);
  // Waits up to `timeout` for every queued job to finish; true when idle.
  bool drain(Millis timeout);
  // Cancels the jobs not started with `why` and waits for the running one
  // (not when called from that job itself) at most kStopBound: a job the
  // caller has failed (Communicator::abort) ends within it unless a store
  // call holds it, and then finishes on its own (it holds what it uses).
  // Idempotent.
  void stop(const std::string& why);
  static constexpr Millis kStopBound{5000};

 private:
  // What the drain task uses, shared with it: when the queue is destroyed
  // from one of its own jobs (a future callback dropping the last reference to
  // the process group), the task finishes that job after the queue is gone and
  // must not touch freed memory.
  struct State {
    std::mutex mutex;
    std::condition_variable idle;  // `busy` went false
    std::deque<Job> jobs;
    bool busy = false;  // a drain task is scheduled or running: at most one
    std::thread::id runner;  // the thread running the drain task, if any
    bool stopping = false;
  };
  static void drainTask(const std::shared_ptr<State>& state);

  const std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace reccl
