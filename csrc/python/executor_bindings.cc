// Python bindings for tests of the process-wide executor (torch_reccl._C): op
// queues and worker pools whose jobs are Python callables, and the executor's
// idle retirement period. Called from the module definition in bindings.cc.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/error.h"
#include "engine/executor.h"
#include "engine/op_context.h"
#include "engine/worker_pool.h"
#include "pg/op_queue.h"

namespace py = pybind11;
using namespace reccl;

namespace {

// A Python callable that native threads may copy and drop without the GIL:
// the last owner takes the GIL to release it.
using HeldCallable = std::shared_ptr<py::object>;

HeldCallable hold(py::object callable) {
  return HeldCallable(new py::object(std::move(callable)), [](py::object* held) {
    py::gil_scoped_acquire gil;
    delete held;
  });
}

// For jobs that must not throw: a Python exception is reported as unraisable.
template <typename... Args>
void callReporting(const HeldCallable& callable, const char* what, Args&&... args) {
  py::gil_scoped_acquire gil;
  try {
    (*callable)(std::forward<Args>(args)...);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable(what);
  }
}

// For worker pool jobs: a Python exception becomes an AbortedError when its
// message starts with "aborted", an Error otherwise.
void callRaising(const HeldCallable& callable) {
  py::gil_scoped_acquire gil;
  try {
    (*callable)();
  } catch (py::error_already_set& e) {
    const std::string message = py::str(e.value());
    if (message.rfind("aborted", 0) == 0) throw AbortedError(message);
    throw Error(message);
  }
}

// An OpQueue that Python can destroy on demand, from its own jobs too.
class TestOpQueue {
 public:
  ~TestOpQueue() { close(); }

  void push(py::object run, py::object cancel) {
    OpQueue::Job job;
    job.run = [run = hold(std::move(run))] { callReporting(run, "OpQueue job"); };
    if (!cancel.is_none()) {
      job.cancel = [cancel = hold(std::move(cancel))](const std::string& why) {
        callReporting(cancel, "OpQueue job cancel", why);
      };
    }
    OpQueue& queue = live();
    py::gil_scoped_release nogil;  // as c10d's callers: a push that waits must not hold up the jobs
    queue.push(std::move(job));
  }

  bool drain(double seconds) {
    OpQueue& queue = live();
    py::gil_scoped_release nogil;  // the jobs take the GIL
    return queue.drain(Millis(static_cast<int64_t>(seconds * 1000.0)));
  }

  void stop(const std::string& why) {
    OpQueue& queue = live();
    py::gil_scoped_release nogil;
    queue.stop(why);
  }

  void close() {
    std::unique_ptr<OpQueue> queue = std::move(queue_);
    py::gil_scoped_release nogil;
    queue.reset();
  }

 private:
  OpQueue& live() {
    if (!queue_) throw Error("the queue has been closed");
    return *queue_;
  }

  std::unique_ptr<OpQueue> queue_ = std::make_unique<OpQueue>();
};

}  // namespace

void bindExecutor(py::module_& m) {
  py::class_<TestOpQueue>(m, "OpQueue",
                          "For tests: a process group's op queue running Python callables")
      .def(py::init<>())
      .def("push", &TestOpQueue::push, py::arg("run"), py::arg("cancel") = py::none(),
           "Queues run(); cancel(why) is called instead when the queue drops it")
      .def("drain", &TestOpQueue::drain, py::arg("timeout"),
           "Waits up to `timeout` seconds for the queued jobs; True when idle")
      .def("stop", &TestOpQueue::stop, py::arg("why"),
           "Cancels the jobs not started and waits for the running one (unless called from it)")
      .def("close", &TestOpQueue::close,
           "Destroys the native queue (also from one of its own jobs)");
  m.def(
      "worker_pool_run_all",
      [](const std::vector<py::object>& jobs, py::object onError) {
        std::vector<std::function<void()>> native;
        for (const auto& job : jobs) native.push_back([held = hold(job)] { callRaising(held); });
        const HeldCallable heldOnError = hold(std::move(onError));
        py::gil_scoped_release nogil;
        WorkerPool pool;
        pool.runAll(native, [&] { callReporting(heldOnError, "worker pool on_error"); });
      },
      py::arg("jobs"), py::arg("on_error"),
      "For tests: WorkerPool.runAll over Python callables; an exception whose message starts "
      "with 'aborted' counts as an AbortedError");
  m.def(
      "set_executor_idle_retirement",
      [](double seconds) {
        const Millis previous =
            Executor::instance().setIdleRetirement(Millis(static_cast<int64_t>(seconds * 1000.0)));
        return previous.count() / 1000.0;
      },
      py::arg("seconds"),
      "For tests: how long an idle executor thread waits before it exits; returns the previous "
      "period");
}
