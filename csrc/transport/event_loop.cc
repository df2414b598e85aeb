#include "transport/event_loop.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <thread>

#include "core/error.h"
#include "core/thread_name.h"

namespace reccl {

namespace {
thread_local EventLoop* tCurrentLoop = nullptr;
constexpr uint64_t kWakeId = 0;  // the eventfd's registration
constexpr int kEventsPerWait = 64;
}  // namespace

EventLoop::EventLoop() : timers_(nowNs()) { openDescriptors(); }

void EventLoop::openDescriptors() {
  epoll_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_.valid()) throw Error(std::string("reccl: epoll_create1: ") + std::strerror(errno));
  wake_ = makeWakeFd();
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = kWakeId;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &event);
}

bool EventLoop::onThisLoop() const { return tCurrentLoop == this; }

bool EventLoop::running() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return running_;
}

void EventLoop::add(int fd, uint32_t events, std::shared_ptr<IoHandler> handler, uint64_t& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!running_) {
    try {
      std::thread([this] { run(); }).detach();
    } catch (const std::system_error& e) {
      throw Error(std::string("reccl: cannot start an I/O thread: ") + e.what());
    }
    running_ = true;
  }
  // Under the lock that dispatch() takes before calling the handler.
  const uint64_t added = nextId_++;
  id = added;
  Registration& registration =
      registrations_.emplace(added, Registration{fd, std::move(handler), false}).first->second;
  if (!pollLocked(added, registration, events)) {
    const int error = errno;
    registrations_.erase(added);
    throw Error(std::string("reccl: epoll_ctl: ") + std::strerror(error));
  }
}

void EventLoop::setEvents(uint64_t id, uint32_t events) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = registrations_.find(id);
  if (it != registrations_.end()) pollLocked(id, it->second, events);
}

bool EventLoop::pollLocked(uint64_t id, Registration& registration, uint32_t events) {
  if (events == 0) {
    if (registration.polled) ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, registration.fd, nullptr);
    registration.polled = false;
    return true;
  }
  epoll_event event{};
  event.events = events;
  event.data.u64 = id;
  const int op = registration.polled ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
  if (::epoll_ctl(epoll_.get(), op, registration.fd, &event) != 0) return false;
  registration.polled = true;
  return true;
}

void EventLoop::setDeadline(uint64_t id, Clock::time_point when, bool earlierOnly) {
  const int64_t dueNs =
      std::chrono::duration_cast<std::chrono::nanoseconds>(when.time_since_epoch()).count();
  const bool past = dueNs <= nowNs();
  std::lock_guard<std::mutex> lock(mutex_);
  if (registrations_.count(id) == 0) return;
  if (overdue_.count(id) != 0) {
    if (earlierOnly || past) return;  // nothing is earlier than due now
    overdue_.erase(id);
  } else {
    const int64_t current = timers_.deadlineOf(id);
    if (earlierOnly && current >= 0 && current <= dueNs) return;
  }
  if (past) {
    timers_.cancel(id);
    overdue_.insert(id);
  } else {
    timers_.set(id, dueNs);
  }
  // A loop asleep past the new deadline must recompute its sleep.
  if (!onThisLoop() && sleepUntilNs_ != 0 && (sleepUntilNs_ < 0 || dueNs < sleepUntilNs_)) wake();
}

void EventLoop::wake() { signalWake(wake_.get()); }

void EventLoop::remove(uint64_t id) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = registrations_.find(id);
  if (it == registrations_.end()) return;
  if (it->second.polled) ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, it->second.fd, nullptr);
  timers_.cancel(id);
  overdue_.erase(id);
  std::shared_ptr<IoHandler> handler = std::move(it->second.handler);
  registrations_.erase(it);
  // The last one gone: a loop asleep without deadlines must wake to retire.
  if (registrations_.empty() && !onThisLoop()) wake();
  if (!onThisLoop()) dispatched_.wait(lock, [&] { return dispatching_ != id; });
  lock.unlock();
  handler.reset();  // outside the lock: its destructor may do anything
}

template <typename Call>
void EventLoop::dispatch(uint64_t id, Call call) {
  std::shared_ptr<IoHandler> handler;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = registrations_.find(id);
    if (it == registrations_.end()) return;  // removed after epoll reported it
    handler = it->second.handler;
    dispatching_ = id;
  }
  call(*handler);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dispatching_ = 0;
  }
  dispatched_.notify_all();
}

void EventLoop::run() noexcept {
  nameThisThread("reccl-io");
  tCurrentLoop = this;
  epoll_event events[kEventsPerWait];
  std::vector<uint64_t> due;
  Clock::time_point idleSince = Clock::now();
  for (;;) {
    int timeoutMs;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const int64_t now = nowNs();
      int64_t wakeAt = timers_.nextWakeNs();
      if (registrations_.empty()) {
        // Nothing to serve: retire after a while, unless something registers.
        const Clock::time_point retireAt = idleSince + EventLoops::kIdleRetirement;
        if (Clock::now() >= retireAt) {
          running_ = false;
          return;  // touches nothing of `this` after the lock is released
        }
        const int64_t retireNs =
            now +
            std::chrono::duration_cast<std::chrono::nanoseconds>(retireAt - Clock::now()).count();
        wakeAt = wakeAt < 0 ? retireNs : std::min(wakeAt, retireNs);
      } else {
        idleSince = Clock::now();
      }
      if (!overdue_.empty()) {
        timeoutMs = 0;
      } else if (wakeAt < 0) {
        timeoutMs = -1;
      } else {
        timeoutMs = static_cast<int>(std::max<int64_t>(0, (wakeAt - now + 999999) / 1000000));
      }
      sleepUntilNs_ = wakeAt < 0 ? -1 : wakeAt;
    }
    const int ready = ::epoll_wait(epoll_.get(), events, kEventsPerWait, timeoutMs);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sleepUntilNs_ = 0;
    }
    for (int i = 0; i < ready; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == kWakeId) {
        uint64_t count;
        ssize_t got = ::read(wake_.get(), &count, sizeof(count));
        (void)got;
        continue;
      }
      const uint32_t mask = events[i].events;
      dispatch(id, [mask](IoHandler& handler) { handler.onIo(mask); });
    }
    due.clear();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      timers_.popDue(nowNs(), &due);
      due.insert(due.end(), overdue_.begin(), overdue_.end());
      overdue_.clear();
    }
    for (uint64_t id : due) dispatch(id, [](IoHandler& handler) { handler.onDeadline(); });
  }
}

void EventLoop::resetAfterFork() {
  // The child owns none of the parent's sockets or threads; its epoll
  // instance would still be the parent's (shared across fork), so make new ones.
  registrations_.clear();  // the handlers point at the parent's paths: leak-free, inert
  timers_ = TimerWheel(nowNs());
  overdue_.clear();
  dispatching_ = 0;
  sleepUntilNs_ = 0;
  running_ = false;
  try {
    openDescriptors();
  } catch (const Error&) {
    // Nothing may throw out of a fork handler: without descriptors every
    // add() fails with an Error, which fails that path, not the child.
  }
}

EventLoops& EventLoops::instance() {
  static EventLoops* const loops = new EventLoops();
  return *loops;
}

EventLoops::EventLoops() {
  pthread_atfork(
      [] {
        EventLoops& self = instance();
        self.mutex_.lock();
        for (EventLoop* loop : self.loops_) loop->mutex_.lock();
      },
      [] {
        EventLoops& self = instance();
        for (EventLoop* loop : self.loops_) loop->mutex_.unlock();
        self.mutex_.unlock();
      },
      [] {
        EventLoops& self = instance();
        for (EventLoop* loop : self.loops_) {
          loop->mutex_.unlock();
          loop->resetAfterFork();
        }
        self.mutex_.unlock();
      });
}

int EventLoops::perNic(int requested) {
  if (requested > 0) return requested;
  // Two threads per NIC keep a NIC's sockets busy on a multi-core host; one
  // where cores are few and every rank of the host competes for them.
  const unsigned cores = std::thread::hardware_concurrency();
  return cores >= 8 ? 2 : 1;
}

EventLoop& EventLoops::pick(int nicId, int threadsPerNic) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++socketsPerNic_[nicId];
  const size_t wanted = static_cast<size_t>(std::max(1, threadsPerNic)) * socketsPerNic_.size();
  // Loops past `wanted` (made while more NICs had sockets) get nothing new and
  // retire their threads once their last socket is gone.
  while (loops_.size() < wanted) loops_.push_back(new EventLoop());
  return *loops_[next_++ % wanted];
}

void EventLoops::release(int nicId) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = socketsPerNic_.find(nicId);
  if (it != socketsPerNic_.end() && --it->second == 0) socketsPerNic_.erase(it);
}

size_t EventLoops::runningThreads() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t count = 0;
  for (EventLoop* loop : loops_) count += loop->running() ? 1 : 0;
  return count;
}

}  // namespace reccl
