#include "transport/tcp/tcp_transport.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/health.h"
#include "core/log.h"
#include "transport/hello_dial.h"
#include "transport/tcp/tcp_path.h"

namespace reccl {

namespace {
constexpr size_t kMaxPartialPaths = 256;
// RECCL_NSOCKS=0 where nothing chose otherwise (the CPU engine: one channel
// per NIC, so a path's sockets are the NIC's only flows).
constexpr int kDefaultDataSockets = 4;

Config withDataSockets(Config config) {
  if (config.socketsPerPath == 0) config.socketsPerPath = kDefaultDataSockets;
  return config;
}
}  // namespace

std::shared_ptr<Path> TcpTransport::dialPath(const ListenHandle& handle, uint64_t connectionId,
                                             int pathIndex, PathCandidate nics,
                                             PathFailure* failure) {
  const NicInfo& local = nics_.at(nics.localNic);
  const HandleEndpoint& remote = handle.nics.at(nics.remoteNic);
  const Millis timeout(config_.connectTimeoutMs);
  HelloBody hello = pathHello(handle, connectionId, pathIndex, nics);
  hello.socketCount = static_cast<uint8_t>(config_.socketsPerPath);
  std::vector<HelloBody> hellos(config_.socketsPerPath + 1, hello);
  hellos[0].socketKind = static_cast<uint8_t>(SocketKind::kControl);
  for (int i = 0; i < config_.socketsPerPath; ++i) {
    hellos[i + 1].socketKind = static_cast<uint8_t>(SocketKind::kData);
    hellos[i + 1].socketIndex = static_cast<uint8_t>(i);
  }
  // The control socket and the first data socket in one round of handshakes:
  // the path carries data on them at once. The other data sockets are dialed
  // when the path first has more to send than one socket takes (setGrow).
  std::vector<HelloBody> later(hellos.begin() + 2, hellos.end());
  hellos.resize(2);
  std::shared_ptr<SameHostWindow> window;
  if (config_.sameHostReads && sameHostKey() != 0) {
    window = std::make_shared<SameHostWindow>();
    hellos[0].hostKey = sameHostKey();
    hellos[0].pid = static_cast<uint32_t>(::getpid());
    hellos[0].refWord = window->tokenAddress();
    hellos[0].refToken = window->token();
  }
  uint64_t peerTransport = 0;
  bool sameHostReads = false;
  std::vector<Fd> sockets = dialWithHellos(local.address, remote, hellos, timeout, failure,
                                           &peerTransport, &sameHostReads);
  if (sockets.empty()) return nullptr;
  Fd control = std::move(sockets.front());
  std::vector<Fd> data(config_.socketsPerPath);
  data[0] = std::move(sockets[1]);
  auto path =
      std::make_shared<TcpPath>(TcpPath::Role::kSender, std::move(control), std::move(data),
                                nics.localNic, nics.remoteNic, healthId(nics.localNic),
                                remote.address,
                                pairs_.join(healthId(nics.localNic), peerTransport, nics.remoteNic),
                                config_, sameHostReads ? window : nullptr);
  if (!later.empty()) {
    std::weak_ptr<TcpPath> weak = path;
    path->setGrow([this, weak, address = local.address, remote, later = std::move(later), timeout] {
      dials_.run([weak, address, remote, later, timeout] {
        PathFailure why;
        std::vector<Fd> extra = dialWithHellos(address, remote, later, timeout, &why);
        std::shared_ptr<TcpPath> grown = weak.lock();
        if (!grown) return;
        if (extra.empty()) {
          // Not a path failure: the path goes on with the sockets it has.
          RECCL_LOG(kInfo,
                    "path to " + remote.address + " keeps its first data socket only: " + why.what);
          return;
        }
        for (size_t i = 0; i < extra.size(); ++i)
          grown->attachData(later[i].socketIndex, std::move(extra[i]));
      });
    });
  }
  return path;
}

TcpTransport::TcpTransport(Config config)
    : BondedTransport(withDataSockets(std::move(config)), "NICs") {
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
  partialSweep_ = std::make_shared<PartialSweep>(this);
  supervisor_->add(partialSweep_);
  for (size_t i = 0; i < nics_.size(); ++i) {
    int nic = static_cast<int>(i);
    acceptors_.push_back(std::make_unique<Acceptor>(
        nics_[i].address, nics_[i].name, transportId_, Millis(config_.connectTimeoutMs),
        [this, nic](const HelloBody& hello) { return authenticate(nic, hello); },
        [this, nic](const HelloBody& hello, const Acceptor::Verdict& verdict, Fd socket,
                    const std::string& peer) {
          admit(nic, hello, verdict, std::move(socket), peer);
        }));
  }
  linkMonitor_ = std::make_unique<LinkMonitor>(std::move(watched));
  healthToken_ = forwardNicHealth(supervisor_.get(), healthIds_);
}

TcpTransport::~TcpTransport() {
  NicHealth::instance().removeListener(healthToken_);
  linkMonitor_.reset();
  acceptors_.clear();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    partial_.clear();
  }
  dials_.stopAndJoin();
  supervisor_.reset();
}

void TcpTransport::dropExpiredPartials() {
  std::vector<PartialPath> expired;  // their sockets close after the lock is let go
  Clock::time_point next = Clock::time_point::max();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const Clock::time_point now = Clock::now();
    for (auto it = partial_.begin(); it != partial_.end();) {
      if (now > it->second.deadline) {
        expired.push_back(std::move(it->second));
        it = partial_.erase(it);
      } else {
        next = std::min(next, it->second.deadline);
        ++it;
      }
    }
  }
  // A round's wakeBy() lasts one round: ask again for the partials still due.
  if (next != Clock::time_point::max()) supervisor_->wakeBy(next + Millis(1));
  for (const auto& partial : expired) {
    RECCL_LOG(kInfo, "dropping a path from " + partial.peer +
                         ": its first sockets did not all arrive within " +
                         std::to_string(config_.connectTimeoutMs) + " ms");
  }
}

std::vector<HandleEndpoint> TcpTransport::listenEndpoints() const {
  std::vector<HandleEndpoint> endpoints;
  for (size_t i = 0; i < nics_.size(); ++i)
    endpoints.push_back({nics_[i].address, acceptors_[i]->port()});
  return endpoints;
}

Acceptor::Verdict TcpTransport::authenticate(int nic, const HelloBody& hello) {
  using Verdict = Acceptor::Verdict;
  Verdict verdict = listeners_.check(hello);
  if (verdict.kind != Verdict::kAdmit) return verdict;
  if (hello.receiverNic != nic) {
    return {Verdict::kReject, "dialed NIC " + std::to_string(nic) + " but names NIC " +
                                  std::to_string(hello.receiverNic)};
  }
  // A NIC that is down (an injected fault included) accepts nothing, as a dead
  // link would; otherwise a peer could fail back onto it.
  NicHealth& health = NicHealth::instance();
  if (!health.usable(healthIds_.at(nic))) return {Verdict::kDecline, "NIC is down"};
  if (health.blackholed(healthIds_.at(nic))) return {Verdict::kDecline, "NIC is blackholed"};
  Verdict admitted;
  admitted.sameHostReads = takeSameHostOffer(hello);
  return admitted;
}

bool TcpTransport::takeSameHostOffer(const HelloBody& hello) {
  if (hello.socketKind != static_cast<uint8_t>(SocketKind::kControl) || hello.hostKey == 0 ||
      !config_.sameHostReads || hello.hostKey != sameHostKey() || sameHostUnreadable_->load()) {
    return false;
  }
  std::string why;
  if (PeerMemory(static_cast<pid_t>(hello.pid), hello.refWord, hello.refToken, nullptr)
          .tokenHolds(&why)) {
    return true;
  }
  if (!sameHostRefusalLogged_.exchange(true)) {
    RECCL_LOG(kInfo, "same-host reads unavailable (" + why +
                         "); paths from this host's processes carry payloads over TCP");
  }
  return false;
}

void TcpTransport::admit(int nic, const HelloBody& hello, const Acceptor::Verdict& verdict,
                         Fd socket, const std::string& peer) {
  PartialPath complete;
  bool ready = false;
  Clock::time_point sweepBy = Clock::time_point::max();  // a new partial's deadline
  std::shared_ptr<TcpPath> joining;  // a path already at work that this socket joins
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    const PathKey key{hello.listenId, hello.connectionId, hello.pathIndex, hello.pathNonce};
    auto it = partial_.find(key);
    if (it == partial_.end()) {
      auto live = growing_.find(key);
      if (live != growing_.end()) {
        joining = live->second.lock();
        if (!joining) growing_.erase(live);
      }
    }
    const bool late =
        hello.socketKind == static_cast<uint8_t>(SocketKind::kData) && hello.socketIndex > 0;
    if (!joining && late) {
      // Only the control socket and the first data socket start a path (dialPath
      // sends them in one round); a later one joins a path at work. Its path is
      // gone (closed, failed or aborted while this socket was dialed): drop it,
      // or it would wait in partial_ for sockets that never come.
      RECCL_LOG(kInfo, "a late data socket from " + peer + " found its path gone; dropped");
      return;
    }
    if (!joining) {
      if (it == partial_.end()) {
        if (partial_.size() >= kMaxPartialPaths) {
          RECCL_LOG(kWarn, "dropping a path from " + peer + ": too many paths being assembled");
          return;
        }
        PartialPath fresh;
        fresh.hello = hello;
        fresh.peer = peer;
        fresh.data.resize(hello.socketCount);
        fresh.deadline = Clock::now() + Millis(config_.connectTimeoutMs);
        sweepBy = fresh.deadline;
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
      ++partial.have;
      if (verdict.sameHostReads) {
        // By value: make_shared forwards references, and a field of the packed
        // HELLO need not be aligned (binding a reference to it is undefined).
        const uint64_t refWord = hello.refWord, refToken = hello.refToken;
        partial.peerMemory =
            std::make_shared<const PeerMemory>(static_cast<pid_t>(hello.pid), refWord, refToken,
                                               sameHostUnreadable_);
      }
      // At work once it has its control socket and first data socket; the
      // others join it as they come (growing_).
      if (partial.control.valid() && partial.data.at(0).valid()) {
        complete = std::move(partial);
        partial_.erase(it);
        ready = true;
      }
    }
  }
  // Past its deadline the partial is dropped, even if no other socket ever arrives.
  if (sweepBy != Clock::time_point::max()) supervisor_->wakeBy(sweepBy + Millis(1));
  if (joining) {
    const bool fits = hello.socketKind == static_cast<uint8_t>(SocketKind::kData) &&
                      hello.socketCount == joining->dataSlots();
    if (!fits || !joining->attachData(hello.socketIndex, std::move(socket))) {
      RECCL_LOG(kWarn, "a late socket in a path from " + peer + " does not fit it; dropped");
    }
    return;
  }
  if (ready) deliver(std::move(complete), nic);
}

void TcpTransport::deliver(PartialPath partial, int nic) {
  std::shared_ptr<Listener> listener = listeners_.find(partial.hello.listenId);
  if (!listener) return;
  const HelloBody hello = partial.hello;
  const bool incomplete = partial.have < partial.data.size() + 1;
  std::string peerHost = partial.peer.substr(0, partial.peer.find(':'));
  auto path = std::make_shared<TcpPath>(TcpPath::Role::kReceiver, std::move(partial.control),
                                        std::move(partial.data), nic, hello.senderNic,
                                        healthIds_.at(nic), peerHost,
                                        pairs_.join(healthIds_.at(nic), hello.dialerTransport,
                                                    hello.senderNic),
                                        config_, nullptr, std::move(partial.peerMemory));
  if (incomplete) {
    // Sockets still to come: they find the path here.
    std::lock_guard<std::mutex> lock(mutex_);
    if (growing_.size() >= growingSweepAt_) {
      // Amortized: a sweep only after the table doubled.
      for (auto it = growing_.begin(); it != growing_.end();) {
        it = it->second.expired() ? growing_.erase(it) : std::next(it);
      }
      growingSweepAt_ = std::max<size_t>(64, 2 * growing_.size());
    }
    growing_[PathKey{hello.listenId, hello.connectionId, hello.pathIndex, hello.pathNonce}] = path;
  }
  PathCandidate nics{nic, hello.senderNic, hello.pathIndex < 2};
  listener->adoptPath(
      hello, nics, std::move(path), [&] { return connectionEnv(peerHost); }, config_.chunkBytes,
      supervisor_.get(), listener);
}

}  // namespace reccl
