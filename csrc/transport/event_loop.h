// A small fixed pool of I/O threads, RECCL_IO_THREADS per NIC, each an epoll
// loop with a timer wheel. Transports register their sockets and deadlines
// here instead of starting threads, so a process's I/O threads depend on its
// NICs and that setting, never on how many connections it holds.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/clock.h"
#include "core/timer_wheel.h"
#include "transport/socket.h"

namespace reccl {

// What a loop calls for one registered socket: always on that loop's thread,
// so a handler's callbacks never overlap. Callbacks must not block for long:
// every other socket of the loop waits meanwhile.
class IoHandler {
 public:
  virtual ~IoHandler() = default;
  virtual void onIo(uint32_t events) = 0;  // epoll events of its socket
  virtual void onDeadline() = 0;           // the deadline last set has passed
};

class EventLoop {
 public:
  EventLoop();
  ~EventLoop() = delete;  // loops live as long as the process (see EventLoops)
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Registers `fd` (non-blocking, owned by the caller, open until remove())
  // for `events` (EPOLLIN/EPOLLOUT, level-triggered). Starts the loop's thread
  // if it is not running; throws Error when the system refuses it. Sets `id`
  // to the registration's id (never 0) before the loop can report the fd: the
  // handler may be called, and use it, before add() returns.
  void add(int fd, uint32_t events, std::shared_ptr<IoHandler> handler, uint64_t& id);
  // Any thread. Unknown or removed ids are ignored. 0 takes the socket out of
  // the epoll set altogether: epoll reports a hung-up socket even with no
  // events asked, and level-triggered that would spin until remove().
  void setEvents(uint64_t id, uint32_t events);
  // Any thread: replaces the deadline; `earlierOnly` keeps an earlier one. A
  // deadline already past is due at the loop's next turn, not at the end of
  // the wheel's current 1 ms tick: setDeadline(id, Clock::now(), true) is how
  // another thread hands a registration work to do on its loop.
  void setDeadline(uint64_t id, Clock::time_point when, bool earlierOnly = false);
  // Unregisters. Once it returns no callback of `id` runs or will run, except
  // the one that called it when called from inside that callback.
  void remove(uint64_t id);

  bool running() const;

 private:
  struct Registration {
    int fd;
    std::shared_ptr<IoHandler> handler;
    bool polled;  // in the epoll set
  };
  bool pollLocked(uint64_t id, Registration& registration, uint32_t events);
  // Opens the epoll instance and the wake-up eventfd, registered in it.
  void openDescriptors();
  bool onThisLoop() const;
  void run() noexcept;
  // Calls `call` on the handler of `id` unless it was removed meanwhile.
  template <typename Call>
  void dispatch(uint64_t id, Call call);
  void wake();
  // Called in a forked child: the parent's loop threads and sockets are not
  // its own, and the epoll instance it inherited is still the parent's.
  void resetAfterFork();
  friend class EventLoops;

  Fd epoll_;
  Fd wake_;  // eventfd: an earlier deadline than the loop sleeps until
  mutable std::mutex mutex_;
  std::condition_variable dispatched_;
  std::unordered_map<uint64_t, Registration> registrations_;
  TimerWheel timers_;
  std::unordered_set<uint64_t> overdue_;  // deadlines set already past: due now, not in the wheel
  uint64_t nextId_ = 1;
  uint64_t dispatching_ = 0;  // the id whose callback runs now, 0 = none
  int64_t sleepUntilNs_ = 0;  // when the loop wakes by itself; 0 = not sleeping
  bool running_ = false;
};

// The next multiple of `interval` on the steady clock after `now`: every path
// with the same heartbeat beats at the same instants, so a loop serving many
// idle paths wakes once per interval for all of them, not once per path.
inline Clock::time_point nextBeatAfter(Clock::time_point now, Millis interval) {
  const auto step = std::chrono::duration_cast<Clock::duration>(interval);
  return Clock::time_point((now.time_since_epoch() / step + 1) * step);
}

// The process's loops: one pool of `threads per NIC × NICs in use` loops shared
// by every NIC, so when a NIC dies and its traffic moves to the backup NIC, the
// backup's sockets (spread over the whole pool when their paths were made) keep
// every thread busy instead of half of them. Never destroyed: loop threads may
// outlive static destruction at exit.
class EventLoops {
 public:
  static EventLoops& instance();
  // How long a loop with no registration keeps its thread: a path that is
  // replaced (failover, failback) finds it still running.
  static constexpr Millis kIdleRetirement{1000};

  // Threads per NIC for `requested` (RECCL_IO_THREADS; 0 = by cores).
  static int perNic(int requested);
  // The next loop, round robin over the pool, for a socket on NIC `nicId` (a
  // NicHealth id). The pool is `threadsPerNic` × the NICs that have sockets on
  // it now, so a process's history (transports long closed) does not spread
  // today's sockets over more threads. Every pick is matched by one release.
  EventLoop& pick(int nicId, int threadsPerNic);
  // The socket picked for `nicId` left its loop (after EventLoop::remove).
  void release(int nicId);
  // Loop threads running now.
  size_t runningThreads() const;

 private:
  EventLoops();
  mutable std::mutex mutex_;
  std::vector<EventLoop*> loops_;
  std::map<int, size_t> socketsPerNic_;  // NICs with sockets on the pool now
  size_t next_ = 0;
};

}  // namespace reccl
