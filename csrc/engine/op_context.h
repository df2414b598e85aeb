// One collective or point-to-point operation in flight: its name for errors,
// its deadline, and the flags that stop it early (the operation failed on
// another channel, or the communicator was aborted). Every blocking wait in the
// engine goes through here, so every wait is bounded and abortable.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "core/request.h"

namespace reccl {

// The operation stopped because something else failed first; the first error
// is the one reported.
class AbortedError : public Error {
 public:
  using Error::Error;
};

// The operation failed because the process of one or more members is gone
// (a connection's verdict, on this rank or reported by another): the group can
// run no more operations, the survivors can go on in a group without them.
class PeerGoneError : public Error {
 public:
  PeerGoneError(const std::string& what, std::vector<int> ranks)
      : Error(what), ranks_(std::move(ranks)) {}
  // The members gone, by group rank, ascending.
  const std::vector<int>& ranks() const { return ranks_; }

 private:
  std::vector<int> ranks_;
};

class OpContext {
 public:
  // `label` names the op in errors, e.g. "all_reduce #12 in process group '0'".
  OpContext(std::string label, Clock::time_point start, Millis timeout,
            const std::atomic<bool>* communicatorAborted);

  const std::string& label() const { return label_; }
  Clock::time_point deadline() const { return deadline_; }
  Millis timeout() const { return timeout_; }

  // Waits for `request`; returns the bytes it moved. Throws TimeoutError past
  // the deadline, AbortedError when stopped, Error when the request failed.
  // `what` / `peer` / `channel` name what was awaited ("data from", 3, 1).
  uint64_t wait(const Request& request, const char* what, int peer, int channel) const;
  // As wait(), but gives up (returns false) at `until` if that comes before
  // the op's deadline; `bytes` receives what the request moved.
  bool waitUntil(const Request& request, Clock::time_point until, const char* what, int peer,
                 int channel, uint64_t* bytes) const;
  // Non-blocking: true when done (throws as wait does when it failed).
  bool test(const Request& request, const char* what, int peer, int channel) const;
  // Throws when stopped or past the deadline, naming `waitingFor`.
  void check(const std::string& waitingFor) const;

  // Stops every other wait of this operation (a sibling channel failed).
  void stop() const { stopped_.store(true); }
  bool stopped() const;

 private:
  std::string where(const char* what, int peer, int channel) const;

  const std::string label_;
  const Millis timeout_;
  const Clock::time_point deadline_;
  const std::atomic<bool>* communicatorAborted_;
  mutable std::atomic<bool> stopped_{false};
};

}  // namespace reccl
