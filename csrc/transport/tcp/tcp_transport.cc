#include "transport/tcp/tcp_transport.h"

#include <sys/random.h>

#include <cstring>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"
#include "transport/tcp/tcp_path.h"

namespace reccl {

namespace {

constexpr int kMaxPaths = 2 + static_cast<int>(kMaxHandleNics);
constexpr size_t kMaxPartialPaths = 256;

void randomBytes(uint8_t* out, size_t length) {
  size_t filled = 0;
  while (filled < length) {
    ssize_t got = ::getrandom(out + filled, length - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw Error(std::string("getrandom failed: ") + std::strerror(errno));
    }
    filled += static_cast<size_t>(got);
  }
}

bool secretsEqual(const uint8_t* a, const uint8_t* b) {
  uint8_t diff = 0;  // constant time: no early exit on the first mismatch
  for (size_t i = 0; i < kSecretBytes; ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

}  // namespace

// Dials the paths of one connection, each on a short-lived thread of the transport.
class TcpDialer : public Dialer {
 public:
  TcpDialer(TcpTransport* transport, ListenHandle handle, uint64_t connectionId)
      : transport_(transport),
        handle_(std::make_shared<const ListenHandle>(std::move(handle))),
        connectionId_(connectionId) {}

  void dial(int pathIndex, PathCandidate nics, Done done) override {
    // The job outlives neither the transport (which joins it) nor its copies;
    // it may outlive this dialer, so it captures no `this`.
    TcpTransport* transport = transport_;
    auto handle = handle_;
    uint64_t connectionId = connectionId_;
    transport_->runDial([=, done = std::move(done)] {
      std::string error;
      std::shared_ptr<Path> path = open(transport, *handle, connectionId, pathIndex, nics, &error);
      done(std::move(path), error);
    });
  }

 private:
  static Fd openSocket(TcpTransport* transport, const HelloBody& hello, const NicInfo& local,
                       const HandleEndpoint& remote, std::string* error) {
    const Millis timeout(transport->config().connectTimeoutMs);
    Fd fd = connectFrom(local.address, remote.address, remote.port, timeout, error);
    if (!fd.valid()) return fd;
    IoWatch watch;
    watch.stallLimit = timeout;
    std::vector<uint8_t> frame = encodeHello(hello);
    IoResult result = sendAll(fd.get(), frame.data(), frame.size(), watch);
    uint8_t reply[sizeof(FrameHeader) + sizeof(HelloAckBody)];
    if (result.ok()) result = recvAll(fd.get(), reply, sizeof(reply), watch, timeout);
    if (!result.ok()) {
      *error = "handshake with " + remote.address + ": " +
               (result.code == IoCode::kEof ? "refused by the listener (wrong secret, closed "
                                              "listener or unknown connection)"
                                            : result.describe());
      return Fd();
    }
    try {
      FrameHeader header = parseFrameHeader(reply, sizeof(reply));
      ControlFrame ack = decodeControl(header, reply + sizeof(FrameHeader), sizeof(HelloAckBody));
      if (ack.type != FrameType::kHelloAck || !ack.helloAccepted) {
        throw ProtocolError("handshake not accepted");
      }
    } catch (const ProtocolError& e) {
      *error = "handshake with " + remote.address + ": " + e.what();
      return Fd();
    }
    return fd;
  }

  static std::shared_ptr<Path> open(TcpTransport* transport, const ListenHandle& handle,
                                    uint64_t connectionId, int pathIndex, PathCandidate nics,
                                    std::string* error) {
    const NicInfo& local = transport->nics().at(nics.localNic);
    const HandleEndpoint& remote = handle.nics.at(nics.remoteNic);
    HelloBody hello{};
    hello.version = kProtocolVersion;
    hello.socketCount = static_cast<uint8_t>(transport->config().socketsPerPath);
    hello.pathIndex = static_cast<uint8_t>(pathIndex);
    hello.senderNic = static_cast<uint8_t>(nics.localNic);
    hello.receiverNic = static_cast<uint8_t>(nics.remoteNic);
    hello.listenId = handle.listenId;
    hello.connectionId = connectionId;
    hello.pathNonce = transport->randomId();
    std::memcpy(hello.secret, handle.secret, kSecretBytes);
    std::strncpy(hello.senderNicName, local.name.c_str(), kNicNameBytes - 1);
    hello.socketKind = static_cast<uint8_t>(SocketKind::kControl);
    Fd control = openSocket(transport, hello, local, remote, error);
    if (!control.valid()) return nullptr;
    std::vector<Fd> data;
    for (int i = 0; i < transport->config().socketsPerPath; ++i) {
      hello.socketKind = static_cast<uint8_t>(SocketKind::kData);
      hello.socketIndex = static_cast<uint8_t>(i);
      Fd fd = openSocket(transport, hello, local, remote, error);
      if (!fd.valid()) return nullptr;
      data.push_back(std::move(fd));
    }
    return std::make_shared<TcpPath>(TcpPath::Role::kSender, std::move(control), std::move(data),
                                     nics.localNic, nics.remoteNic,
                                     transport->healthId(nics.localNic), remote.address,
                                     transport->config());
  }

  TcpTransport* transport_;
  std::shared_ptr<const ListenHandle> handle_;
  const uint64_t connectionId_;
};

std::shared_ptr<RecvConnection> Listener::accept(Millis timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_for(lock, timeout, [&] { return !ready_.empty() || closed_; })) return nullptr;
  if (ready_.empty()) return nullptr;
  auto connection = ready_.front();
  ready_.pop_front();
  return connection;
}

void Listener::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  closed_ = true;
  ready_.clear();
  cv_.notify_all();
}

TcpTransport::TcpTransport(Config config) : config_(std::move(config)) {
  uint64_t seed;
  randomBytes(reinterpret_cast<uint8_t*>(&seed), sizeof(seed));
  random_.seed(seed);
  nics_ = discoverNics(config_.nics);
  if (nics_.size() > kMaxHandleNics) {
    throw ConfigError("reccl supports at most " + std::to_string(kMaxHandleNics) +
                      " NICs per process; RECCL_NICS selects " + std::to_string(nics_.size()));
  }
  NicHealth& health = NicHealth::instance();
  std::map<int, int> watched;
  for (const auto& nic : nics_) {
    int id = health.registerNic(nic.name, nic.linkUp);
    healthIds_.push_back(id);
    if (nic.interface != "lo") watched[nic.ifindex] = id;
  }
  supervisor_ = std::make_unique<Supervisor>();
  for (size_t i = 0; i < nics_.size(); ++i) {
    int nic = static_cast<int>(i);
    acceptors_.push_back(std::make_unique<Acceptor>(
        nics_[i].address, nics_[i].name, Millis(config_.connectTimeoutMs),
        [this, nic](const HelloBody& hello) { return authenticate(nic, hello); },
        [this, nic](const HelloBody& hello, Fd socket, const std::string& peer) {
          admit(nic, hello, std::move(socket), peer);
        }));
  }
  linkMonitor_ = std::make_unique<LinkMonitor>(std::move(watched));
  std::vector<int> ids = healthIds_;
  Supervisor* supervisor = supervisor_.get();
  healthToken_ = health.addListener([ids, supervisor](const std::string& name, bool up, Reason reason) {
    int id = NicHealth::instance().idOf(name);
    bool ours = false;
    for (int mine : ids) ours = ours || mine == id;
    if (!ours) return;
    supervisor->forEach([&](Serviced& item) {
      if (auto* connection = dynamic_cast<Connection*>(&item)) connection->onNicHealth(id, up, reason);
    });
  });
}

TcpTransport::~TcpTransport() {
  NicHealth::instance().removeListener(healthToken_);
  linkMonitor_.reset();
  acceptors_.clear();
  std::list<std::pair<std::thread, std::shared_ptr<std::atomic<bool>>>> dials;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    dials.swap(dials_);
    partial_.clear();
  }
  for (auto& [thread, done] : dials) thread.join();
  supervisor_.reset();
}

void TcpTransport::checkNic(int nic) const {
  if (nic < 0 || nic >= static_cast<int>(nics_.size())) {
    throw ConfigError("NIC index " + std::to_string(nic) + " out of range; this process has " +
                      std::to_string(nics_.size()) + " NICs (0.." +
                      std::to_string(nics_.size() - 1) + ")");
  }
}

uint64_t TcpTransport::randomId() {
  std::lock_guard<std::mutex> lock(mutex_);
  return random_();
}

ConnectionEnv TcpTransport::connectionEnv(const std::string& peer) {
  ConnectionEnv env;
  env.config = config_;
  env.supervisor = supervisor_.get();
  for (const auto& nic : nics_) env.localNicNames.push_back(nic.name);
  env.localHealthIds = healthIds_;
  env.peerName = peer;
  return env;
}

std::shared_ptr<Listener> TcpTransport::listen(int nic) {
  checkNic(nic);
  auto listener = std::make_shared<Listener>();
  listener->nic_ = nic;
  randomBytes(listener->secret_, kSecretBytes);
  ListenHandle handle;
  handle.listenId = randomId();
  listener->listenId_ = handle.listenId;
  std::memcpy(handle.secret, listener->secret_, kSecretBytes);
  handle.chunkBytes = static_cast<uint32_t>(config_.chunkBytes);
  handle.listenerNic = nic;
  handle.listenerBackup = config_.backup ? nics_[nic].backup : -1;
  for (size_t i = 0; i < nics_.size(); ++i) {
    handle.nics.push_back({nics_[i].address, acceptors_[i]->port()});
  }
  listener->handle_ = encodeHandle(handle);
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = listeners_.begin(); it != listeners_.end();) {
    it = it->second.expired() ? listeners_.erase(it) : std::next(it);
  }
  listeners_[handle.listenId] = listener;
  return listener;
}

std::shared_ptr<SendConnection> TcpTransport::connect(int nic, const std::vector<uint8_t>& bytes) {
  checkNic(nic);
  ListenHandle handle = decodeHandle(bytes.data(), bytes.size());
  std::vector<PathCandidate> candidates;
  auto add = [&](int local, int remote, bool upFront) {
    if (local < 0 || remote < 0 || local >= static_cast<int>(nics_.size()) ||
        remote >= static_cast<int>(handle.nics.size())) {
      return;
    }
    for (const auto& c : candidates) {
      if (c.localNic == local && c.remoteNic == remote) return;
    }
    candidates.push_back({local, remote, upFront});
  };
  // NIC i of every host sits on rail i, so the primary pairs the same rail on
  // both ends (never a cross-rail hop, even when the caller listened elsewhere)
  // and the backup pairs our backup NIC with the peer's NIC of that rail, which
  // is its backup too on identically wired hosts. The listener's own NIC and
  // backup stand in where the peer lacks the rail.
  const int remoteNics = static_cast<int>(handle.nics.size());
  const int backupNic = nics_[nic].backup;
  add(nic, nic < remoteNics ? nic : handle.listenerNic, true);
  if (config_.backup) {
    add(backupNic, backupNic >= 0 && backupNic < remoteNics ? backupNic : handle.listenerBackup,
        true);
    // Same-rail pairs on the remaining rails: a last resort when both are gone.
    for (int rail = 0; rail < static_cast<int>(std::min(nics_.size(), handle.nics.size())); ++rail) {
      add(rail, rail, false);
    }
  }
  uint64_t id = randomId();
  ConnectionEnv env = connectionEnv(handle.nics[handle.listenerNic].address);
  for (const auto& endpoint : handle.nics) env.remoteNicAddresses.push_back(endpoint.address);
  auto connection = std::make_shared<SendConnection>(
      std::move(env), id, candidates, std::make_unique<TcpDialer>(this, handle, id),
      handle.chunkBytes);
  supervisor_->add(connection);
  return connection;
}

Acceptor::Verdict TcpTransport::authenticate(int nic, const HelloBody& hello) {
  using Verdict = Acceptor::Verdict;
  std::shared_ptr<Listener> listener;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = listeners_.find(hello.listenId);
    if (it != listeners_.end()) listener = it->second.lock();
  }
  if (!listener) return {Verdict::kReject, "unknown or closed listener"};
  if (!secretsEqual(listener->secret_, hello.secret)) return {Verdict::kReject, "wrong handshake secret"};
  if (hello.receiverNic != nic) {
    return {Verdict::kReject, "dialed NIC " + std::to_string(nic) + " but names NIC " +
                                  std::to_string(hello.receiverNic)};
  }
  if (hello.pathIndex >= kMaxPaths) {
    return {Verdict::kReject, "path index " + std::to_string(hello.pathIndex) + " out of range"};
  }
  // A NIC that is down (an injected fault included) accepts nothing, as a dead
  // link would; otherwise a peer could fail back onto it.
  NicHealth& health = NicHealth::instance();
  if (!health.usable(healthIds_.at(nic))) return {Verdict::kDecline, "NIC is down"};
  if (health.blackholed(healthIds_.at(nic))) return {Verdict::kDecline, "NIC is blackholed"};
  return {};
}

void TcpTransport::admit(int nic, const HelloBody& hello, Fd socket, const std::string& peer) {
  PartialPath complete;
  bool ready = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    Clock::time_point now = Clock::now();
    for (auto it = partial_.begin(); it != partial_.end();) {
      it = now > it->second.deadline ? partial_.erase(it) : std::next(it);
    }
    auto key = std::make_tuple(hello.listenId, hello.connectionId, hello.pathIndex, hello.pathNonce);
    auto it = partial_.find(key);
    if (it == partial_.end()) {
      if (partial_.size() >= kMaxPartialPaths) {
        RECCL_LOG(kWarn, "dropping a path from " + peer + ": too many paths being assembled");
        return;
      }
      PartialPath fresh;
      fresh.hello = hello;
      fresh.peer = peer;
      fresh.data.resize(hello.socketCount);
      fresh.deadline = now + Millis(config_.connectTimeoutMs);
      it = partial_.emplace(key, std::move(fresh)).first;
    }
    PartialPath& partial = it->second;
    if (hello.socketCount != partial.hello.socketCount) {
      RECCL_LOG(kWarn, "path from " + peer + " changed its socket count mid-handshake; dropped");
      partial_.erase(it);
      return;
    }
    Fd* slot = hello.socketKind == static_cast<uint8_t>(SocketKind::kControl)
                   ? &partial.control
                   : &partial.data.at(hello.socketIndex);
    if (slot->valid()) {
      RECCL_LOG(kWarn, "duplicate socket in a path from " + peer + "; dropped");
      return;
    }
    *slot = std::move(socket);
    if (++partial.have == partial.data.size() + 1) {
      complete = std::move(partial);
      partial_.erase(it);
      ready = true;
    }
  }
  if (ready) deliver(std::move(complete), nic);
}

void TcpTransport::deliver(PartialPath partial, int nic) {
  std::shared_ptr<Listener> listener;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = listeners_.find(partial.hello.listenId);
    if (it != listeners_.end()) listener = it->second.lock();
  }
  if (!listener) return;
  const HelloBody hello = partial.hello;
  std::string peerHost = partial.peer.substr(0, partial.peer.find(':'));
  auto path = std::make_shared<TcpPath>(TcpPath::Role::kReceiver, std::move(partial.control),
                                        std::move(partial.data), nic, hello.senderNic,
                                        healthIds_.at(nic), peerHost, config_);
  PathCandidate nics{nic, hello.senderNic, hello.pathIndex < 2};
  std::shared_ptr<RecvConnection> connection;
  bool fresh = false;
  {
    std::lock_guard<std::mutex> lock(listener->mutex_);
    auto it = listener->connections_.find(hello.connectionId);
    if (it != listener->connections_.end()) connection = it->second.lock();
    if (!connection) {
      if (listener->closed_) return;
      std::vector<PathCandidate> slots(kMaxPaths, PathCandidate{nic, 0, false});
      connection = std::make_shared<RecvConnection>(connectionEnv(peerHost), hello.connectionId,
                                                    slots, config_.chunkBytes);
      connection->keepAlive(listener);
      listener->connections_[hello.connectionId] = connection;
      fresh = true;
    }
  }
  if (fresh) supervisor_->add(connection);
  if (!connection->attachPath(hello.pathIndex, nics, path)) return;
  if (fresh) {
    std::lock_guard<std::mutex> lock(listener->mutex_);
    listener->ready_.push_back(connection);
    listener->cv_.notify_all();
  }
}

void TcpTransport::runDial(std::function<void()> job) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopping_) return;
  for (auto it = dials_.begin(); it != dials_.end();) {
    if (it->second->load()) {
      it->first.join();
      it = dials_.erase(it);
    } else {
      ++it;
    }
  }
  auto done = std::make_shared<std::atomic<bool>>(false);
  dials_.emplace_back(std::thread([job = std::move(job), done] {
                        job();
                        done->store(true);
                      }),
                      done);
}

}  // namespace reccl
