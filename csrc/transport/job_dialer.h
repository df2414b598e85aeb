// The Dialer both transports use: each path of one connection is opened as a
// short-lived job of its transport. The transports differ only in how a path
// is opened (`Open`) and where the job runs (`Run`).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "core/send_connection.h"
#include "transport/handle.h"

namespace reccl {

class JobDialer : public Dialer {
 public:
  using Run = std::function<void(std::function<void()> job)>;
  // nullptr and `failure` filled on failure.
  using Open =
      std::function<std::shared_ptr<Path>(const ListenHandle& handle, uint64_t connectionId,
                                          int pathIndex, PathCandidate nics, PathFailure* failure)>;

  // `run` and `open` may be called after this dialer is gone, never after the
  // transport that gave them (it joins its jobs before it goes).
  JobDialer(Run run, Open open, ListenHandle handle, uint64_t connectionId)
      : run_(std::move(run)),
        open_(std::move(open)),
        handle_(std::make_shared<const ListenHandle>(std::move(handle))),
        connectionId_(connectionId) {}

  void dial(int pathIndex, PathCandidate nics, Done done) override {
    // The job captures copies, not `this`: it may outlive the dialer.
    run_([open = open_, handle = handle_, connectionId = connectionId_, pathIndex, nics,
          done = std::move(done)] {
      PathFailure failure;
      std::shared_ptr<Path> path = open(*handle, connectionId, pathIndex, nics, &failure);
      done(std::move(path), failure);
    });
  }

 private:
  const Run run_;
  const Open open_;
  const std::shared_ptr<const ListenHandle> handle_;
  const uint64_t connectionId_;
};

}  // namespace reccl
