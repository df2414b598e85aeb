#include "engine/links.h"

#include <cstdio>
#include <functional>
#include <future>
#include <system_error>
#include <thread>

#include "core/error.h"
#include "core/health.h"
#include "transport/handle.h"

namespace reccl {

namespace {
std::string laneName(Lane lane) {
  switch (lane) {
    case Lane::kP2p: return "p2p";
    case Lane::kReturn: return "return";
    default: return "collective";
  }
}
constexpr Millis kAcceptSlice(50);
constexpr Millis kForgetBound(2000);  // deleting our key: never longer than this
// Recording or reading gone peers, on the failure path: never longer than this.
constexpr Millis kGoneStoreBound(2000);

// Runs `call` (which must not throw) on a thread of its own and waits at most
// `bound`: a store that stopped answering keeps only that detached call. True
// when it finished in time; false also when no thread could be had (then
// nothing ran).
bool callBounded(std::function<void()> call, Millis bound) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  try {
    std::thread([call = std::move(call), done] {
      call();
      done->set_value();
    }).detach();
  } catch (const std::system_error&) {
    return false;
  }
  return finished.wait_for(bound) == std::future_status::ready;
}
}  // namespace

Links::Links(std::shared_ptr<Transport> transport, std::shared_ptr<Rendezvous> rendezvous,
             const std::string& prefix, int rank, int size, int channels, Millis timeout)
    : transport_(std::move(transport)),
      rendezvous_(std::move(rendezvous)),
      key_(prefix + "h/" + std::to_string(rank)),
      prefix_(prefix),
      rank_(rank),
      size_(size),
      channels_(channels),
      timeout_(timeout) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw ConfigError("rank " + std::to_string(rank) + " is not in a group of " +
                      std::to_string(size));
  }
  if (channels < 1) throw ConfigError("a communicator needs at least one channel");
  nics_ = static_cast<int>(transport_->nics().size());
  if (nics_ < 1) throw ConfigError("no NICs: set RECCL_NICS");
  if (size == 1) return;
  std::vector<uint8_t> blob;
  for (int nic = 0; nic < nics_; ++nic) {
    listeners_.push_back(transport_->listen(nic));
    const auto& handle = listeners_.back()->handle();
    if (handle.size() != kHandleBytes) throw Error("unexpected listen handle size");
    blob.insert(blob.end(), handle.begin(), handle.end());
  }
  rendezvous_->set(key_, blob);
}

Links::~Links() { close(); }

int Links::slotOf(int channel, Lane lane) const {
  if (lane == Lane::kP2p) return channels_;
  if (channel < 0 || channel >= channels_) {
    throw ConfigError("channel " + std::to_string(channel) + " out of range");
  }
  return lane == Lane::kReturn ? channels_ + 1 + channel : channel;
}

Links::Link& Links::link(int peer, int channel, Lane lane) {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw ConfigError("peer rank " + std::to_string(peer) +
                      " is not another rank of this group of " + std::to_string(size_));
  }
  const int slot = slotOf(channel, lane);
  std::lock_guard<std::mutex> lock(mapMutex_);
  std::unique_ptr<Link>& l = links_[{peer, slot}];
  if (!l) l = std::make_unique<Link>();
  return *l;
}

// Both ends pick the NIC from what they share: the channel, or the pair.
int Links::nicFor(int peer, int channel, Lane lane) const {
  return lane == Lane::kP2p ? (rank_ + peer) % nics_ : channel % nics_;
}

uint64_t Links::tagOf(int from, int channel, Lane lane) {
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(from) << 16) |
         (static_cast<uint64_t>(lane) << 8) | static_cast<uint64_t>(channel & 0xff);
}

void Links::checkOpen() const {
  if (closed_.load()) throw AbortedError("the communicator's connections are closed");
}

Links::Peer& Links::peerEntry(int peer) {
  std::lock_guard<std::mutex> lock(mapMutex_);
  std::unique_ptr<Peer>& slot = peers_[peer];
  if (!slot) slot = std::make_unique<Peer>();
  return *slot;
}

void Links::checkHandles(int peer, const std::vector<uint8_t>& blob) {
  if (blob.empty() || blob.size() % kHandleBytes != 0 ||
      blob.size() / kHandleBytes > kMaxHandleNics) {
    throw ProtocolError("rank " + std::to_string(peer) + " published " +
                        std::to_string(blob.size()) + " bytes of listen handles, expected " +
                        std::to_string(kHandleBytes) + " per NIC (1.." +
                        std::to_string(kMaxHandleNics) + " NICs)");
  }
}

const std::vector<uint8_t>& Links::peerHandles(int peer) {
  Peer& p = peerEntry(peer);
  std::lock_guard<std::mutex> lock(p.mutex);
  if (p.handles.empty()) {
    std::vector<uint8_t> blob = rendezvous_->get(prefix_ + "h/" + std::to_string(peer), timeout_);
    checkHandles(peer, blob);
    p.handles = std::move(blob);
  }
  return p.handles;
}

void Links::dialAhead(const std::vector<int>& peers, int channel, Lane lane) {
  checkOpen();
  std::vector<int> missing;
  std::vector<std::string> keys;
  for (int peer : peers) {
    if (peer < 0 || peer >= size_ || peer == rank_) continue;
    Peer& p = peerEntry(peer);
    std::lock_guard<std::mutex> lock(p.mutex);
    if (p.handles.empty()) {
      missing.push_back(peer);
      keys.push_back(prefix_ + "h/" + std::to_string(peer));
    }
  }
  if (!keys.empty()) {
    std::vector<std::vector<uint8_t>> blobs = rendezvous_->getMany(keys, timeout_);
    for (size_t i = 0; i < missing.size(); ++i) {
      checkHandles(missing[i], blobs.at(i));
      Peer& p = peerEntry(missing[i]);
      std::lock_guard<std::mutex> lock(p.mutex);
      if (p.handles.empty()) p.handles = std::move(blobs[i]);
    }
  }
  for (int peer : peers) {
    if (peer >= 0 && peer < size_ && peer != rank_) sender(peer, channel, lane);
  }
}

std::shared_ptr<SendConnection> Links::sender(int peer, int channel, Lane lane) {
  checkOpen();
  Link& l = link(peer, channel, lane);
  std::lock_guard<std::mutex> lock(l.mutex);
  checkOpen();
  if (!l.send) {
    const std::vector<uint8_t>& handles = peerHandles(peer);
    const int peerNics = static_cast<int>(handles.size() / kHandleBytes);
    // The peer listens on the NIC it computes for us: the same formula over its NICs.
    const int theirNic = lane == Lane::kP2p ? (rank_ + peer) % peerNics : channel % peerNics;
    std::vector<uint8_t> handle(handles.begin() + theirNic * kHandleBytes,
                                handles.begin() + (theirNic + 1) * kHandleBytes);
    l.send = transport_->connect(nicFor(peer, channel, lane), handle, tagOf(rank_, channel, lane));
  }
  return l.send;
}

std::shared_ptr<RecvConnection> Links::tryReceiver(int peer, int channel, Lane lane) {
  checkOpen();
  Link& l = link(peer, channel, lane);
  std::lock_guard<std::mutex> lock(l.mutex);
  if (!l.recv && !listeners_.empty()) {
    l.recv = listeners_[nicFor(peer, channel, lane)]->acceptTagged(tagOf(peer, channel, lane),
                                                                   Millis(0));
    if (l.recv) noteAccepted(peer);
  }
  return l.recv;
}

void Links::noteAccepted(int peer) {
  std::lock_guard<std::mutex> lock(keyMutex_);
  if (keySpent_) return;
  connectedFrom_.insert(peer);
  if (static_cast<int>(connectedFrom_.size()) == size_ - 1) {
    keySpent_ = true;
    connectedFrom_.clear();
  }
}

void Links::releaseSpentKey() {
  {
    std::lock_guard<std::mutex> lock(keyMutex_);
    if (!keySpent_ || keyErased_ || closed_.load()) return;
  }
  eraseKeyBounded();
}

void Links::eraseKeyBounded() {
  {
    std::lock_guard<std::mutex> lock(keyMutex_);
    if (keyErased_) return;
    keyErased_ = true;
  }
  // Without a thread to run it the key stays (the job's store is torn down with the job).
  callBounded(
      [rendezvous = rendezvous_, key = key_] {
        try {
          rendezvous->erase(key);
        } catch (const std::exception&) {
          // The store is gone: nothing left to clean.
        }
      },
      kForgetBound);
}

std::vector<int> Links::peersGone() const {
  std::vector<int> gone;
  std::lock_guard<std::mutex> lock(mapMutex_);
  for (const auto& [key, l] : links_) {  // ordered by (peer, slot)
    std::unique_lock<std::mutex> linkLock(l->mutex, std::try_to_lock);
    if (!linkLock.owns_lock()) continue;  // being accepted: no connection yet
    const bool found = (l->send && l->send->peerGone()) || (l->recv && l->recv->peerGone());
    if (found && (gone.empty() || gone.back() != key.first)) gone.push_back(key.first);
  }
  return gone;
}

void Links::reportGone(const std::vector<int>& peers) {
  callBounded(
      [rendezvous = rendezvous_, prefix = prefix_, rank = rank_, peers] {
        try {
          for (int peer : peers) {
            const int64_t index = rendezvous->add(prefix + "gone/n", 1);
            const std::string entry = std::to_string(peer) + " " + std::to_string(rank);
            rendezvous->set(prefix + "gone/" + std::to_string(index),
                            std::vector<uint8_t>(entry.begin(), entry.end()));
          }
        } catch (const std::exception&) {
          // The store is gone: the other ranks report what they saw themselves.
        }
      },
      kGoneStoreBound);
}

std::vector<Links::GoneReport> Links::goneReports() {
  auto reports = std::make_shared<std::vector<GoneReport>>();
  const bool finished = callBounded(
      [rendezvous = rendezvous_, prefix = prefix_, reports] {
        try {
          const int64_t count = rendezvous->add(prefix + "gone/n", 0);
          std::vector<std::string> keys;
          for (int64_t i = 1; i <= count; ++i) keys.push_back(prefix + "gone/" + std::to_string(i));
          // A reporter adds to the count before it writes its entry: wait for it briefly.
          for (const auto& value : rendezvous->getMany(keys, kGoneStoreBound / 2)) {
            GoneReport report;
            const std::string entry(value.begin(), value.end());
            if (std::sscanf(entry.c_str(), "%d %d", &report.peer, &report.reporter) == 2) {
              reports->push_back(report);
            }
          }
        } catch (const std::exception&) {
          // Nothing recorded in time, or the store is gone: nothing to report.
        }
      },
      kGoneStoreBound);
  return finished ? *reports : std::vector<GoneReport>{};
}

std::shared_ptr<RecvConnection> Links::receiverUntil(int peer, int channel, Lane lane,
                                                     const OpContext& ctx,
                                                     Clock::time_point until) {
  checkOpen();
  Link& l = link(peer, channel, lane);
  std::lock_guard<std::mutex> lock(l.mutex);
  const uint64_t tag = tagOf(peer, channel, lane);
  while (!l.recv) {
    checkOpen();
    ctx.check("rank " + std::to_string(peer) + " to connect (" + laneName(lane) + " channel " +
              std::to_string(lane == Lane::kP2p ? 0 : channel) + ")");
    const Clock::time_point now = Clock::now();
    if (now >= until) return nullptr;
    const Millis slice =
        std::min(kAcceptSlice, std::chrono::duration_cast<Millis>(until - now) + Millis(1));
    l.recv = listeners_[nicFor(peer, channel, lane)]->acceptTagged(tag, slice);
    if (l.recv) noteAccepted(peer);
  }
  return l.recv;
}

std::shared_ptr<RecvConnection> Links::receiver(int peer, int channel, Lane lane,
                                                const OpContext& ctx) {
  return receiverUntil(peer, channel, lane, ctx, Clock::time_point::max());
}

uint64_t Links::nicsDown() const {
  uint64_t mask = 0;
  for (int n = 0; n < nics_ && n < 64; ++n) {
    if (!NicHealth::instance().usable(transport_->healthId(n))) mask |= uint64_t{1} << n;
  }
  return mask;
}

size_t Links::connections() const {
  size_t count = 0;
  std::lock_guard<std::mutex> lock(mapMutex_);
  for (const auto& [key, l] : links_) {
    std::unique_lock<std::mutex> linkLock(l->mutex, std::try_to_lock);
    if (!linkLock.owns_lock()) continue;
    count += (l->send ? 1 : 0) + (l->recv ? 1 : 0);
  }
  return count;
}

std::vector<int> Links::sendPeers(int channel) const {
  std::vector<int> peers;
  std::lock_guard<std::mutex> lock(mapMutex_);
  for (const auto& [key, l] : links_) {  // ordered by (peer, slot)
    if (key.second != channel) continue;
    std::unique_lock<std::mutex> linkLock(l->mutex, std::try_to_lock);
    if (linkLock.owns_lock() && l->send) peers.push_back(key.first);
  }
  return peers;
}

uint64_t Links::channelsOnBackup(uint64_t nicsDown) const {
  uint64_t mask = 0;
  for (int c = 0; c < channels_; ++c) {
    if (nicsDown & (uint64_t{1} << nicOf(c))) mask |= uint64_t{1} << c;
  }
  std::lock_guard<std::mutex> lock(mapMutex_);
  for (const auto& [key, l] : links_) {
    const int slot = key.second;
    if (slot >= channels_) continue;  // the p2p and return lanes: not channels of the ring
    std::unique_lock<std::mutex> linkLock(l->mutex, std::try_to_lock);
    if (!linkLock.owns_lock()) continue;  // being accepted: not failed over
    // Path 0 is the primary; -1 (between paths) counts once a backup is chosen.
    if ((l->send && l->send->activePath() > 0) || (l->recv && l->recv->activePath() > 0)) {
      mask |= uint64_t{1} << slot;
    }
  }
  return mask;
}

void Links::close(bool orderly) {
  if (closed_.exchange(true)) return;
  // A sender() that gets its link's mutex after this finds the links closed.
  std::vector<std::shared_ptr<Connection>> connections = takeConnections(false);
  // Closed, not released: accepts racing with this return nothing from now on.
  for (auto& listener : listeners_) listener->close();
  if (orderly && size_ > 1) eraseKeyBounded();
  closeAll(std::move(connections));
}

std::vector<std::shared_ptr<Connection>> Links::takeConnections(bool directOnly) {
  // Each link's mutex is taken after the map's is released: a sender() holds its
  // link's mutex while it looks up the peer's handles under the map's (the other
  // order would deadlock). Entries are never erased, so the pointers stay valid.
  std::vector<Link*> links;
  {
    std::lock_guard<std::mutex> lock(mapMutex_);
    for (auto& [key, l] : links_) links.push_back(l.get());
  }
  std::vector<std::shared_ptr<Connection>> connections;
  for (Link* l : links) {
    std::lock_guard<std::mutex> linkLock(l->mutex);
    if (l->send && (!directOnly || l->sendDirect)) connections.push_back(std::move(l->send));
    if (l->recv && (!directOnly || l->recvDirect)) connections.push_back(std::move(l->recv));
    l->sendDirect = l->recvDirect = false;
  }
  return connections;
}

void Links::claimForDirect(const std::vector<int>& peers, int channel, Lane lane) {
  for (int peer : peers) {
    Link& l = link(peer, channel, lane);
    std::lock_guard<std::mutex> lock(l.mutex);
    if (!l.send) l.sendDirect = true;
    if (!l.recv) l.recvDirect = true;
  }
}

void Links::releaseDirect() { closeAll(takeConnections(true)); }

void Links::closeAll(std::vector<std::shared_ptr<Connection>> connections) {
  // Close in parallel: each close waits (bounded) for the peer's CLOSE.
  constexpr size_t kParallel = 16;
  for (size_t base = 0; base < connections.size(); base += kParallel) {
    std::vector<std::thread> closers;
    for (size_t i = base; i < std::min(connections.size(), base + kParallel); ++i) {
      try {
        closers.emplace_back([c = connections[i]] { c->close(); });
      } catch (const std::system_error&) {
        connections[i]->close();  // no thread to be had: close it here, bounded all the same
      }
    }
    for (auto& t : closers) t.join();
  }
}

}  // namespace reccl
