// Work objects of the reccl process group.
//
// RecclWork: a collective run on the group's worker thread. It completes (its
// Future first, whose value is the list of output tensors, so DDP communication
// hooks work; then wait() returns) when the worker finishes the op, with the
// op's error if it failed.
//
// RecclP2pWork: a send or recv. Posted at once on the caller's thread;
// completion is observed by isCompleted()/wait(), which drive the p2p engine.
#pragma once

#include <functional>
#include <memory>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "engine/p2p.h"

namespace reccl {

class Communicator;

class RecclWork : public c10d::Work {
 public:
  RecclWork(int rank, c10d::OpType type, const char* profilingTitle,
            std::vector<at::Tensor> outputs, uint64_t seq);

  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  uint64_t getSequencenumber() const override { return seq_; }

  // Called once by the worker.
  void succeed();
  void fail(std::exception_ptr error);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  const uint64_t seq_;
};

class RecclP2pWork : public c10d::Work {
 public:
  // `onSuccess` runs once when the op completed (e.g. copies a staging buffer
  // back); `onFailure` once when it failed (aborts the communicator, whose
  // connections may still hold the buffer).
  // `rank`, `size`, `group`: the process group, for the timeout message.
  RecclP2pWork(int rank, int size, std::string group, c10d::OpType type, std::shared_ptr<P2pOp> op,
               std::vector<at::Tensor> keepAlive, std::chrono::milliseconds defaultTimeout,
               std::function<void()> onSuccess, std::function<void(const std::string&)> onFailure);

  bool isCompleted() override;
  bool isSuccess() const override;
  bool wait(std::chrono::milliseconds timeout) override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override { return keepAlive_; }

 private:
  // `bound`: the wait that ran out, when `error` is a timeout.
  void finishOnce(std::exception_ptr error, std::chrono::milliseconds bound);

  const int size_;
  const std::string group_;
  std::shared_ptr<P2pOp> op_;
  std::vector<at::Tensor> keepAlive_;
  const std::chrono::milliseconds defaultTimeout_;
  std::function<void()> onSuccess_;
  std::function<void(const std::string&)> onFailure_;
  std::mutex finishMutex_;
  bool finished_ = false;
};

// The c10::DistBackendError for a failed op (Python: torch.distributed.DistBackendError).
std::exception_ptr backendError(const std::string& message);

// A timed-out op's message, worded like torch's backends ("Timed out waiting
// <bound>ms for ..." as ProcessGroupGloo), naming the op, the group and this
// rank; `detail`: the engine's account of what it waited for.
std::string timedOutMessage(const char* title, const std::string& group, int rank, int size,
                            std::chrono::milliseconds timeout, const std::string& detail);

}  // namespace reccl
