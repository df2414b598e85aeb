// Accepts TCP connections on one NIC and admits only peers that complete a
// valid HELLO with the secret of a live listener, within a bound. Everything
// else is counted, reported as an event and dropped without disturbing other
// peers, and logged at most once per 10 s for each kind of refusal (with a
// count of the rest), so that strangers cannot flood the log.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/frame.h"
#include "core/log.h"
#include "transport/hello_verdict.h"
#include "transport/socket.h"

namespace reccl {

class Acceptor {
 public:
  // What to do with a complete HELLO.
  using Verdict = HelloVerdict;
  using Authenticate = std::function<Verdict(const HelloBody& hello)>;
  // Takes an admitted socket (already answered with HELLO_ACK) and its verdict.
  using Admit = std::function<void(const HelloBody& hello, const Verdict& verdict, Fd socket,
                                   const std::string& peer)>;

  // `transportId` goes back in every HELLO_ACK.
  Acceptor(std::string address, std::string nicName, uint64_t transportId, Millis handshakeTimeout,
           Authenticate authenticate, Admit admit);
  ~Acceptor();
  Acceptor(const Acceptor&) = delete;
  Acceptor& operator=(const Acceptor&) = delete;

  uint16_t port() const { return port_; }

 private:
  struct Pending {
    Fd fd;
    std::string peer;
    std::vector<uint8_t> bytes;
    Clock::time_point deadline;
  };
  void run();
  // Reads what is available; true when the peer is finished (admitted or refused).
  bool advance(Pending& pending);
  // `kind`: one of a few fixed names, the log limiter's key; `why`: the detail.
  void refuse(const Pending& pending, const char* kind, const std::string& why);

  const std::string address_;
  const std::string nicName_;
  const uint64_t transportId_;
  const Millis handshakeTimeout_;
  Authenticate authenticate_;
  Admit admit_;
  Fd listener_;
  Fd wake_;  // signalled by the destructor: the poll waits without a timeout when idle
  LogLimiter refusals_;  // the acceptor thread's; its destructor writes the last counts
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace reccl
