// The receiving side's listener, shared by the transports: it owns the handle
// (with its secret) a sender dials, routes every path a sender opens to that
// sender's connection, and queues each new connection for accept().
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/recv_connection.h"
#include "core/supervisor.h"
#include "transport/handle.h"
#include "transport/hello_verdict.h"

namespace reccl {

// Path slots per connection: primary, backup, then one last-resort rail per NIC.
constexpr int kMaxPaths = 2 + static_cast<int>(kMaxHandleNics);

class Listener {
 public:
  const std::vector<uint8_t>& handle() const { return handle_; }
  int nic() const { return nic_; }
  // The next untagged connection a peer opened, or nullptr after `timeout`.
  std::shared_ptr<RecvConnection> accept(Millis timeout);
  // The connection a peer opened with `tag` (nonzero), or nullptr after
  // `timeout`. One listener then serves every peer and channel of a group:
  // the tag says which (engine/links.h), the secret that it is a member.
  std::shared_ptr<RecvConnection> acceptTagged(uint64_t tag, Millis timeout);
  // Stops taking new connections; accepted ones keep working (and re-dialing),
  // since each keeps its listener alive.
  void close();

  // For transports. Constant-time comparison with the handle's secret.
  bool secretMatches(const uint8_t* secret) const;
  // Hands `path`, which the sender described in `hello`, to its connection; the
  // first path of a connection creates it (with makeEnv()) and queues it for
  // accept(). False when the listener or the connection no longer takes paths.
  bool adoptPath(const HelloBody& hello, PathCandidate nics, std::shared_ptr<Path> path,
                 const std::function<ConnectionEnv()>& makeEnv, uint64_t chunkBytes,
                 Supervisor* supervisor, const std::shared_ptr<Listener>& self);

 private:
  friend class ListenerTable;
  uint64_t listenId_ = 0;
  uint8_t secret_[kSecretBytes] = {};
  int nic_ = 0;
  std::vector<uint8_t> handle_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<RecvConnection>> ready_;             // untagged, in arrival order
  std::map<uint64_t, std::shared_ptr<RecvConnection>> readyTagged_; // by dialer tag
  std::map<uint64_t, std::weak_ptr<RecvConnection>> connections_;
  bool closed_ = false;
};

// The live listeners of one transport, by listen id.
class ListenerTable {
 public:
  // A new listener on `nic` with a fresh secret; its handle carries `listenId`,
  // `endpoints` (by the listener's NIC index), `backupNic` (-1: none) and the
  // chunk size.
  std::shared_ptr<Listener> create(int nic, int backupNic, uint32_t chunkBytes,
                                   std::vector<HandleEndpoint> endpoints, uint64_t listenId);
  // nullptr for an unknown or closed-and-released listener.
  std::shared_ptr<Listener> find(uint64_t listenId);
  // The checks every transport makes on a HELLO: a live listener, its secret,
  // a path index in range. Admit means "so far so good".
  HelloVerdict check(const HelloBody& hello);

 private:
  std::mutex mutex_;
  std::map<uint64_t, std::weak_ptr<Listener>> listeners_;
  size_t sweepAt_ = 64;  // drop closed listeners when the table grows past this
};

}  // namespace reccl
