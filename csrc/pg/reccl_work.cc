#include "pg/reccl_work.h"

#include <c10/util/Exception.h>

#include "core/error.h"

namespace reccl {

std::exception_ptr backendError(const std::string& message) {
  return std::make_exception_ptr(c10::DistBackendError(
      c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message));
}

std::string timedOutMessage(const char* title, const std::string& group, int rank, int size,
                            std::chrono::milliseconds timeout, const std::string& detail) {
  std::string op = title;
  if (op.rfind("reccl:", 0) == 0) op = op.substr(6);
  return "[reccl] Timed out waiting " + std::to_string(timeout.count()) + "ms for " + op +
         " on process group '" + group + "' (rank " + std::to_string(rank) + " of " +
         std::to_string(size) + "): " + detail;
}

namespace {
std::string waitTimeoutMessage(std::chrono::milliseconds timeout) {
  return "[reccl] Timed out waiting " + std::to_string(timeout.count()) +
         "ms in Work.wait(); the operation is still running (it fails on its own at the "
         "process group timeout)";
}
}  // namespace

// ------------------------------------------------------------------ RecclWork

RecclWork::RecclWork(int rank, c10d::OpType type, const char* profilingTitle,
                     std::vector<at::Tensor> outputs, uint64_t seq)
    : c10d::Work(rank, type, profilingTitle),
      outputs_(std::move(outputs)),
      future_(
          c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
      seq_(seq) {}

bool RecclWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout.count() > 0) {
    if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
      C10_THROW_ERROR(DistBackendError, waitTimeoutMessage(timeout));
    }
  } else {
    cv_.wait(lock, [&] { return completed_; });
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> RecclWork::getFuture() { return future_; }

std::vector<at::Tensor> RecclWork::result() { return outputs_; }

// The Future completes before the work, as in torch's Gloo backend: a caller that
// returns from wait() finds the Future done (torchft chains its callbacks on it
// right after wait() and expects them to run at once).
void RecclWork::succeed() {
  future_->markCompleted(c10::IValue(outputs_));
  finish();
}

void RecclWork::fail(std::exception_ptr error) {
  future_->setError(error);
  finish(error);
}

// ------------------------------------------------------------------ RecclP2pWork

RecclP2pWork::RecclP2pWork(int rank, int size, std::string group, c10d::OpType type,
                           std::shared_ptr<P2pOp> op, std::vector<at::Tensor> keepAlive,
                           std::chrono::milliseconds defaultTimeout,
                           std::function<void()> onSuccess,
                           std::function<void(const std::string&)> onFailure)
    : c10d::Work(rank, type, op->isSend() ? "reccl:send" : "reccl:recv"),
      size_(size),
      group_(std::move(group)),
      op_(std::move(op)),
      keepAlive_(std::move(keepAlive)),
      defaultTimeout_(defaultTimeout),
      onSuccess_(std::move(onSuccess)),
      onFailure_(std::move(onFailure)) {}

void RecclP2pWork::finishOnce(std::exception_ptr error, std::chrono::milliseconds bound) {
  {
    std::lock_guard<std::mutex> lock(finishMutex_);
    if (finished_) return;
    finished_ = true;
  }
  if (!error && onSuccess_) {
    try {
      onSuccess_();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (error && onFailure_) {
    std::string message = "p2p failed";
    bool timedOut = false;
    try {
      std::rethrow_exception(error);
    } catch (const TimeoutError& e) {
      message = e.what();
      timedOut = true;
    } catch (const std::exception& e) {
      message = e.what();
    }
    onFailure_(message);
    error = backendError(timedOut ? timedOutMessage(op_->isSend() ? "send" : "recv", group_, rank_,
                                                    size_, bound, message)
                                  : message);
  }
  finish(error);
}

bool RecclP2pWork::isCompleted() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return true;
  }
  try {
    if (!op_->test()) return false;
    finishOnce(nullptr, defaultTimeout_);
  } catch (...) {
    finishOnce(std::current_exception(), defaultTimeout_);
  }
  return true;
}

bool RecclP2pWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

bool RecclP2pWork::wait(std::chrono::milliseconds timeout) {
  if (!isCompleted()) {
    const std::chrono::milliseconds bound = timeout.count() > 0 ? timeout : defaultTimeout_;
    try {
      op_->wait(bound);
      finishOnce(nullptr, bound);
    } catch (...) {
      finishOnce(std::current_exception(), bound);
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

int RecclP2pWork::sourceRank() const { return op_->peer(); }

}  // namespace reccl
