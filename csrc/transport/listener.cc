#include "transport/listener.h"

#include <algorithm>
#include <cstring>

#include "transport/random_bytes.h"

namespace reccl {

std::shared_ptr<RecvConnection> Listener::accept(Millis timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return !ready_.empty() || closed_; })) return nullptr;
  if (ready_.empty()) return nullptr;
  auto connection = ready_.front();
  ready_.pop_front();
  return connection;
}

std::shared_ptr<RecvConnection> Listener::acceptTagged(uint64_t tag, Millis timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto found = [&] { return readyTagged_.count(tag) > 0 || closed_; };
  if (!cv_.wait_for(lock, timeout, found)) return nullptr;
  auto it = readyTagged_.find(tag);
  if (it == readyTagged_.end()) return nullptr;
  auto connection = std::move(it->second);
  readyTagged_.erase(it);
  return connection;
}

void Listener::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  closed_ = true;
  ready_.clear();
  readyTagged_.clear();
  cv_.notify_all();
}

bool Listener::secretMatches(const uint8_t* secret) const {
  uint8_t diff = 0;  // constant time: no early exit on the first mismatch
  for (size_t i = 0; i < kSecretBytes; ++i) diff |= secret_[i] ^ secret[i];
  return diff == 0;
}

bool Listener::adoptPath(const HelloBody& hello, PathCandidate nics, std::shared_ptr<Path> path,
                         const std::function<ConnectionEnv()>& makeEnv, uint64_t chunkBytes,
                         Supervisor* supervisor, const std::shared_ptr<Listener>& self) {
  std::shared_ptr<RecvConnection> connection;
  bool fresh = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = connections_.find(hello.connectionId);
    if (it != connections_.end()) {
      connection = it->second.lock();
      // A late path of a connection this end has closed and let go: never a new
      // connection, which would be accepted in place of the dialer's next one.
      if (!connection) return false;
    }
    if (!connection) {
      if (closed_) return false;
      // A second connection under a tag still waiting to be accepted: a member
      // dialing twice for one slot. The first one stands.
      if (hello.dialerTag != 0 && readyTagged_.count(hello.dialerTag) > 0) return false;
      std::vector<PathCandidate> slots(kMaxPaths, PathCandidate{nics.localNic, 0, false});
      connection =
          std::make_shared<RecvConnection>(makeEnv(), hello.connectionId, slots, chunkBytes);
      connection->keepAlive(self);
      connections_[hello.connectionId] = connection;
      fresh = true;
    }
  }
  if (fresh) supervisor->add(connection);
  if (!connection->attachPath(hello.pathIndex, nics, std::move(path))) return false;
  if (fresh) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) {
      // Closed while the path was attached: nobody accepts from here any more,
      // and a queued connection would keep this listener (keepAlive) and itself
      // alive for good. It goes (closing its path) when `connection` does.
      connections_.erase(hello.connectionId);
      return false;
    }
    if (hello.dialerTag == 0) {
      ready_.push_back(connection);
    } else {
      readyTagged_.emplace(hello.dialerTag, connection);
    }
    cv_.notify_all();
  }
  return true;
}

std::shared_ptr<Listener> ListenerTable::create(int nic, int backupNic, uint32_t chunkBytes,
                                                std::vector<HandleEndpoint> endpoints,
                                                uint64_t listenId) {
  auto listener = std::make_shared<Listener>();
  listener->nic_ = nic;
  listener->listenId_ = listenId;
  randomBytes(listener->secret_, kSecretBytes);
  ListenHandle handle;
  handle.listenId = listenId;
  std::memcpy(handle.secret, listener->secret_, kSecretBytes);
  handle.chunkBytes = chunkBytes;
  handle.listenerNic = nic;
  handle.listenerBackup = backupNic;
  handle.nics = std::move(endpoints);
  listener->handle_ = encodeHandle(handle);
  std::lock_guard<std::mutex> lock(mutex_);
  if (listeners_.size() >= sweepAt_) {
    // Amortized: a sweep only after the table doubled, so making L listeners costs O(L).
    for (auto it = listeners_.begin(); it != listeners_.end();) {
      it = it->second.expired() ? listeners_.erase(it) : std::next(it);
    }
    sweepAt_ = std::max<size_t>(64, 2 * listeners_.size());
  }
  listeners_[listenId] = listener;
  return listener;
}

std::shared_ptr<Listener> ListenerTable::find(uint64_t listenId) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = listeners_.find(listenId);
  return it == listeners_.end() ? nullptr : it->second.lock();
}

HelloVerdict ListenerTable::check(const HelloBody& hello) {
  using Verdict = HelloVerdict;
  std::shared_ptr<Listener> listener = find(hello.listenId);
  if (!listener) return {Verdict::kReject, "unknown or closed listener"};
  if (!listener->secretMatches(hello.secret)) return {Verdict::kReject, "wrong handshake secret"};
  if (hello.pathIndex >= kMaxPaths) {
    return {Verdict::kReject, "path index " + std::to_string(hello.pathIndex) + " out of range"};
  }
  return {};
}

}  // namespace reccl
