#include "engine/op_context.h"

#include <algorithm>
#include <cstdio>

namespace reccl {

namespace {
constexpr Millis kSlice(50);  // how often a blocked wait looks at the stop flags

std::string seconds(Millis ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}
}  // namespace

OpContext::OpContext(std::string label, Clock::time_point start, Millis timeout,
                     const std::atomic<bool>* communicatorAborted)
    : label_(std::move(label)),
      timeout_(timeout),
      deadline_(start + timeout),
      communicatorAborted_(communicatorAborted) {}

bool OpContext::stopped() const {
  return stopped_.load() || (communicatorAborted_ && communicatorAborted_->load());
}

std::string OpContext::where(const char* what, int peer, int channel) const {
  std::string out = what;
  if (peer >= 0) out += " rank " + std::to_string(peer);
  if (channel >= 0) out += " on channel " + std::to_string(channel);
  return out;
}

void OpContext::check(const std::string& waitingFor) const {
  if (stopped()) throw AbortedError(label_ + " was stopped while waiting for " + waitingFor);
  if (Clock::now() >= deadline_) {
    throw TimeoutError("reccl: " + label_ + " timed out after " + seconds(timeout_) +
                       " waiting for " + waitingFor +
                       " (a rank did not join the collective, or a network path is gone)");
  }
}

bool OpContext::test(const Request& request, const char* what, int peer, int channel) const {
  uint64_t bytes = 0;
  std::string error;
  if (!request.test(&bytes, &error)) return false;
  if (!error.empty()) {
    throw Error("reccl: " + label_ + ": " + where(what, peer, channel) + " failed: " + error);
  }
  return true;
}

uint64_t OpContext::wait(const Request& request, const char* what, int peer, int channel) const {
  uint64_t bytes = 0;
  waitUntil(request, deadline_, what, peer, channel, &bytes);
  return bytes;
}

bool OpContext::waitUntil(const Request& request, Clock::time_point until, const char* what,
                          int peer, int channel, uint64_t* bytes) const {
  for (;;) {
    Clock::time_point now = Clock::now();
    if (until < deadline_ && now >= until) return false;
    Millis left = std::chrono::duration_cast<Millis>(std::min(until, deadline_) - now);
    if (request.wait(std::max(Millis(0), std::min(kSlice, left)))) break;
    check(where(what, peer, channel));
  }
  std::string error;
  request.test(bytes, &error);
  if (!error.empty()) {
    throw Error("reccl: " + label_ + ": " + where(what, peer, channel) + " failed: " + error);
  }
  return true;
}

}  // namespace reccl
