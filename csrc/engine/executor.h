// One process-wide, elastic pool of threads shared by every process group: it
// runs their op queues and the channels of their collectives, so the threads of
// a rank follow the work in flight, not the number of groups. In engine/, not
// core/: only collectives and process groups use it, so the plugin library NCCL
// loads (core, transport, gpu, nccl) carries none of it.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "core/clock.h"

namespace reccl {

class Executor {
 public:
  // How long a thread waits for work before it exits. Short enough that a
  // destroyed group's threads are gone within moments; long enough that a
  // training loop's steady stream of collectives never pays for a new thread.
  static constexpr Millis kDefaultIdleRetirement{2000};

  // The process's executor. Never destroyed: its threads, working or idle,
  // may outlive static destruction at exit and must find it intact.
  static Executor& instance();

  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Runs `job` on an idle thread, or on a new thread when none is idle. There
  // is no cap: ops of different groups may wait on each other across ranks,
  // so a job left queued for a free thread could be the one that the busy
  // threads wait for. `job` must not throw (std::terminate, as on a
  // std::thread). Throws Error when the system refuses a new thread.
  void submit(std::function<void()> job);

  // For tests: how long an idle thread waits before it exits; applies to the
  // threads already idle too. Returns the previous period.
  Millis setIdleRetirement(Millis period);

 private:
  // A thread waiting for work, on its own stack: `submit` hands it a job.
  struct Idler {
    std::condition_variable wake;
    std::function<void()> job;
  };

  Executor();
  // A worker thread: runs `job`, then the jobs handed to it until it retires.
  // noexcept: a job that throws ends the process, as it would on a std::thread.
  void work(std::function<void()> job) noexcept;
  // Whether `self` got a job within the idle period; false: it retires.
  bool awaitJob(Idler& self);

  std::mutex mutex_;
  // The most recently idle thread gets the next job, so under light load the
  // same few threads stay busy and the surplus reaches its retirement.
  std::vector<Idler*> idle_;
  Millis idleRetirement_ = kDefaultIdleRetirement;
};

}  // namespace reccl
