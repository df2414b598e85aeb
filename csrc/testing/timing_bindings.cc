// Test hooks of the machinery that decides when things run, in the test module
// torch_reccl._testing (never in the library NCCL loads): the timer wheel on
// a clock the test supplies, and a supervisor and an event loop on the real
// clock with recording items and handlers (C++ objects, so their callbacks run
// on the library's threads without the GIL). Every wait here is bounded.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "core/supervisor.h"
#include "core/timer_wheel.h"
#include "transport/event_loop.h"

namespace py = pybind11;
using namespace reccl;

namespace {

// What a recording item or handler saw: (what, steady-clock ns, epoll events).
class Record {
 public:
  void add(std::string what, uint32_t events = 0) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      calls_.push_back({std::move(what), nowNs(), events});
    }
    cv_.notify_all();
  }
  // Waits (GIL released) until `count` calls are recorded; false after `seconds`.
  bool wait(size_t count, double seconds) {
    if (!(seconds >= 0 && seconds <= 3600)) throw ConfigError("timeout must be 0 to 3600 seconds");
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, std::chrono::duration<double>(seconds),
                        [&] { return calls_.size() >= count; });
  }
  py::list list() {
    std::lock_guard<std::mutex> lock(mutex_);
    py::list out;
    for (const auto& call : calls_) out.append(py::make_tuple(call.what, call.ns, call.events));
    return out;
  }

 private:
  struct Call {
    std::string what;
    int64_t ns;
    uint32_t events;
  };
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Call> calls_;
};

// A supervisor item that records its rounds; it can be quiet and fail a round.
class RecordedItem : public Serviced {
 public:
  void service() override {
    record.add("service");
    if (failNext.exchange(false)) throw Error("a round failed on purpose");
  }
  bool quiet() override { return quietFlag.load(); }

  Record record;
  std::atomic<bool> quietFlag{false};
  std::atomic<bool> failNext{false};
};

// A supervisor Python can stop (join) on purpose, with the GIL released.
struct TestSupervisor {
  std::unique_ptr<Supervisor> supervisor;
  Supervisor& get() {
    if (!supervisor) throw Error("the supervisor is closed");
    return *supervisor;
  }
};

// An event-loop handler that records its callbacks. On EPOLLIN it reads up to
// 8 bytes from `drainFd` (so a level-triggered pipe stops reporting), and
// while `holdOpen` the first callback waits for release() (at most 10 s).
class RecordingHandler : public IoHandler {
 public:
  explicit RecordingHandler(int drainFd, bool holdOpen) : drainFd_(drainFd), held_(holdOpen) {}
  void onIo(uint32_t events) override {
    record.add("io-start", events);
    if (drainFd_ >= 0 && (events & EPOLLIN)) {
      char bytes[8];
      ssize_t got = ::read(drainFd_, bytes, sizeof(bytes));
      (void)got;
    }
    holdIfAsked();
    record.add("io", events);
  }
  void onDeadline() override {
    record.add("deadline-start");
    holdIfAsked();
    record.add("deadline");
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      held_ = false;
    }
    cv_.notify_all();
  }

  Record record;

 private:
  void holdIfAsked() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait_for(lock, Millis(10000), [&] { return !held_; });
    held_ = false;
  }
  const int drainFd_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool held_;
};

void bindTimerWheel(py::module_& m) {
  py::class_<TimerWheel>(
      m, "TimerWheel",
      "core/timer_wheel.h on a clock the caller supplies (ns; only differences count)")
      .def(py::init<int64_t>(), py::arg("now_ns"))
      .def("set", &TimerWheel::set, py::arg("id"), py::arg("due_ns"))
      .def("cancel", &TimerWheel::cancel, py::arg("id"))
      .def("deadline_of", &TimerWheel::deadlineOf, py::arg("id"), "-1 when `id` has none")
      .def("next_wake_ns", &TimerWheel::nextWakeNs, "-1 when no deadline is set")
      .def(
          "pop_due",
          [](TimerWheel& wheel, int64_t nowNs) {
            std::vector<uint64_t> due;
            wheel.popDue(nowNs, &due);
            return due;
          },
          py::arg("now_ns"), "The ids due at `now_ns`, removed, in the order the wheel found them");
  m.attr("TIMER_WHEEL_TICK_NS") = TimerWheel::kTickNs;
  m.attr("TIMER_WHEEL_SLOTS") = TimerWheel::kSlots;
}

void bindSupervisor(py::module_& m) {
  py::class_<RecordedItem, std::shared_ptr<RecordedItem>>(
      m, "SupervisedItem", "A supervisor item recording each round that services it")
      .def(py::init<>())
      .def_property(
          "quiet", [](const RecordedItem& item) { return item.quietFlag.load(); },
          [](RecordedItem& item, bool quiet) { item.quietFlag.store(quiet); })
      .def(
          "fail_next_round", [](RecordedItem& item) { item.failNext.store(true); },
          "The next service() throws (the supervisor logs it and goes on)")
      .def(
          "rounds",
          [](RecordedItem& item) {
            py::list out;
            for (const auto& call : item.record.list()) out.append(call.cast<py::tuple>()[1]);
            return out;
          },
          "steady-clock ns of each round")
      .def(
          "wait_rounds",
          [](RecordedItem& item, size_t count, double timeout) {
            return item.record.wait(count, timeout);
          },
          py::arg("count"), py::arg("timeout"), "Whether `count` rounds ran within `timeout` s");
  py::class_<TestSupervisor>(m, "Supervisor", "core/supervisor.h with its own thread")
      .def(py::init([](double tickMs, double quietTickMs) {
             auto made = std::make_unique<TestSupervisor>();
             made->supervisor =
                 std::make_unique<Supervisor>(Millis(static_cast<int64_t>(tickMs)),
                                              Millis(static_cast<int64_t>(quietTickMs)));
             return made;
           }),
           py::arg("tick_ms") = 20, py::arg("quiet_tick_ms") = 1000)
      .def(
          "add",
          [](TestSupervisor& s, const std::shared_ptr<RecordedItem>& item) { s.get().add(item); },
          py::arg("item"), "Held weakly: an item Python drops is dropped by the supervisor")
      .def("poke", [](TestSupervisor& s) { s.get().poke(); })
      .def(
          "wake_by", [](TestSupervisor& s, int64_t whenNs) { s.get().wakeBy(atNs(whenNs)); },
          py::arg("when_ns"), "The next round starts by steady-clock `when_ns` at the latest")
      .def(
          "items",
          [](TestSupervisor& s) {
            size_t count = 0;
            s.get().forEach([&](Serviced&) { ++count; });
            return count;
          },
          "The live items (every supervisor also drives the grey detector's)")
      .def(
          "close",
          [](TestSupervisor& s) {
            py::gil_scoped_release release;
            s.supervisor.reset();
          },
          "Stops and joins the supervisor's thread");
}

void bindEventLoop(py::module_& m) {
  m.def(
      "steady_now_ns", [] { return nowNs(); },
      "The steady clock the loops and supervisors use, in ns");
  py::class_<RecordingHandler, std::shared_ptr<RecordingHandler>>(
      m, "LoopHandler",
      "An event-loop handler recording ('io-start'|'io'|'deadline-start'|'deadline', ns, events)")
      .def(py::init<int, bool>(), py::arg("drain_fd") = -1, py::arg("hold") = false,
           "drain_fd: read on EPOLLIN; hold: the first callback waits for release()")
      .def("release", &RecordingHandler::release)
      .def("calls", [](RecordingHandler& h) { return h.record.list(); })
      .def(
          "wait_calls",
          [](RecordingHandler& h, size_t count, double timeout) {
            return h.record.wait(count, timeout);
          },
          py::arg("count"), py::arg("timeout"));
  // Loops live as long as the process (EventLoop's destructor is deleted): an
  // idle one retires its thread after EventLoops::kIdleRetirement.
  py::class_<EventLoop, std::unique_ptr<EventLoop, py::nodelete>>(
      m, "EventLoop", "transport/event_loop.h, one loop of its own")
      .def(py::init([] { return new EventLoop(); }))
      .def(
          "add",
          [](EventLoop& loop, int fd, uint32_t events, std::shared_ptr<RecordingHandler> handler) {
            uint64_t id = 0;
            loop.add(fd, events, std::move(handler), id);
            return id;
          },
          py::arg("fd"), py::arg("events"), py::arg("handler"))
      .def("set_events", &EventLoop::setEvents, py::arg("id"), py::arg("events"))
      .def(
          "set_deadline",
          [](EventLoop& loop, uint64_t id, int64_t whenNs, bool earlierOnly) {
            loop.setDeadline(id, atNs(whenNs), earlierOnly);
          },
          py::arg("id"), py::arg("when_ns"), py::arg("earlier_only") = false)
      .def("remove", &EventLoop::remove, py::arg("id"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("running", &EventLoop::running);
  m.attr("EVENT_LOOP_IDLE_RETIREMENT_MS") = EventLoops::kIdleRetirement.count();
}

}  // namespace

void bindTiming(py::module_& m) {
  bindTimerWheel(m);
  bindSupervisor(m);
  bindEventLoop(m);
}
