#include "engine/links.h"

#include <thread>

#include "core/error.h"
#include "core/health.h"
#include "transport/tcp/handle.h"

namespace reccl {

namespace {
std::string laneName(Lane lane) { return lane == Lane::kP2p ? "p2p" : "collective"; }
}  // namespace

Links::Links(std::shared_ptr<Transport> transport, Rendezvous& rendezvous,
             const std::string& prefix, int rank, int size, int channels, Millis timeout)
    : transport_(std::move(transport)), rank_(rank), size_(size), channels_(channels) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw ConfigError("rank " + std::to_string(rank) + " is not in a group of " +
                      std::to_string(size));
  }
  if (channels < 1) throw ConfigError("a communicator needs at least one channel");
  nics_ = static_cast<int>(transport_->nics().size());
  if (nics_ < 1) throw ConfigError("no NICs: set RECCL_NICS");
  links_.resize(static_cast<size_t>(size) * slotsPerPeer());
  for (auto& l : links_) l = std::make_unique<Link>();
  // My listener handles for each peer, (channels + 1) x kHandleBytes, under
  // "<prefix>h/<me>/<peer>"; I read "<prefix>h/<peer>/<me>" of every peer.
  std::vector<std::string> myKeys, theirKeys;
  std::vector<std::vector<uint8_t>> mine;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    std::vector<uint8_t> blob;
    for (int slot = 0; slot < slotsPerPeer(); ++slot) {
      int nic = slot < channels_ ? nicOf(slot) : nicOf(rank + peer);
      Link& l = *links_[static_cast<size_t>(peer) * slotsPerPeer() + slot];
      l.listener = transport_->listen(nic);
      const auto& handle = l.listener->handle();
      if (handle.size() != kHandleBytes) throw Error("unexpected listen handle size");
      blob.insert(blob.end(), handle.begin(), handle.end());
    }
    myKeys.push_back(prefix + "h/" + std::to_string(rank) + "/" + std::to_string(peer));
    mine.push_back(std::move(blob));
    theirKeys.push_back(prefix + "h/" + std::to_string(peer) + "/" + std::to_string(rank));
  }
  if (size == 1) return;
  rendezvous.setMany(myKeys, mine);
  std::vector<std::vector<uint8_t>> theirs = rendezvous.getMany(theirKeys, timeout);
  size_t index = 0;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    const std::vector<uint8_t>& blob = theirs.at(index++);
    if (blob.size() != static_cast<size_t>(slotsPerPeer()) * kHandleBytes) {
      throw ConfigError("rank " + std::to_string(peer) + " published " + std::to_string(blob.size()) +
                        " bytes of listen handles, expected " +
                        std::to_string(slotsPerPeer() * kHandleBytes) +
                        ": every rank must use the same number of channels");
    }
    for (int slot = 0; slot < slotsPerPeer(); ++slot) {
      links_[static_cast<size_t>(peer) * slotsPerPeer() + slot]->peerHandle.assign(
          blob.begin() + slot * kHandleBytes, blob.begin() + (slot + 1) * kHandleBytes);
    }
  }
}

Links::~Links() { close(); }

Links::Link& Links::link(int peer, int channel, Lane lane) {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw ConfigError("peer rank " + std::to_string(peer) + " is not another rank of this group of " +
                      std::to_string(size_));
  }
  int slot = lane == Lane::kP2p ? channels_ : channel;
  if (lane == Lane::kCollective && (channel < 0 || channel >= channels_)) {
    throw ConfigError("channel " + std::to_string(channel) + " out of range");
  }
  return *links_[static_cast<size_t>(peer) * slotsPerPeer() + slot];
}

void Links::checkOpen() const {
  if (closed_.load()) throw AbortedError("the communicator's connections are closed");
}

std::shared_ptr<SendConnection> Links::sender(int peer, int channel, Lane lane) {
  checkOpen();
  Link& l = link(peer, channel, lane);
  std::lock_guard<std::mutex> lock(l.mutex);
  checkOpen();
  if (!l.send) {
    int nic = lane == Lane::kP2p ? nicOf(rank_ + peer) : nicOf(channel);
    l.send = transport_->connect(nic, l.peerHandle);
  }
  return l.send;
}

std::shared_ptr<RecvConnection> Links::tryReceiver(int peer, int channel, Lane lane) {
  checkOpen();
  Link& l = link(peer, channel, lane);
  std::lock_guard<std::mutex> lock(l.mutex);
  if (!l.recv && l.listener) l.recv = l.listener->accept(Millis(0));
  return l.recv;
}

std::shared_ptr<RecvConnection> Links::receiver(int peer, int channel, Lane lane,
                                                const OpContext& ctx) {
  checkOpen();
  Link& l = link(peer, channel, lane);
  std::lock_guard<std::mutex> lock(l.mutex);
  while (!l.recv) {
    checkOpen();
    ctx.check("rank " + std::to_string(peer) + " to connect (" + laneName(lane) + " channel " +
              std::to_string(lane == Lane::kP2p ? 0 : channel) + ")");
    if (!l.listener) throw AbortedError("listener closed");
    l.recv = l.listener->accept(Millis(50));
  }
  return l.recv;
}

uint64_t Links::nicsDown() const {
  uint64_t mask = 0;
  for (int n = 0; n < nics_ && n < 64; ++n) {
    if (!NicHealth::instance().usable(transport_->healthId(n))) mask |= uint64_t{1} << n;
  }
  return mask;
}

uint64_t Links::channelsOnBackup(uint64_t nicsDown) const {
  uint64_t mask = 0;
  for (int c = 0; c < channels_; ++c) {
    if (nicsDown & (uint64_t{1} << nicOf(c))) mask |= uint64_t{1} << c;
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    for (int c = 0; c < channels_; ++c) {
      Link& l = *links_[static_cast<size_t>(peer) * slotsPerPeer() + c];
      std::unique_lock<std::mutex> lock(l.mutex, std::try_to_lock);
      if (!lock.owns_lock()) continue;  // being accepted: not failed over
      // Path 0 is the primary; -1 (between paths) counts once a backup is chosen.
      if ((l.send && l.send->activePath() > 0) || (l.recv && l.recv->activePath() > 0)) {
        mask |= uint64_t{1} << c;
      }
    }
  }
  return mask;
}

void Links::close() {
  if (closed_.exchange(true)) return;
  std::vector<std::shared_ptr<Connection>> connections;
  std::vector<std::shared_ptr<Listener>> listeners;
  for (auto& l : links_) {
    std::lock_guard<std::mutex> lock(l->mutex);
    if (l->send) connections.push_back(std::move(l->send));
    if (l->recv) connections.push_back(std::move(l->recv));
    if (l->listener) listeners.push_back(std::move(l->listener));
  }
  for (auto& listener : listeners) listener->close();
  // Close in parallel: each close waits (bounded) for the peer's CLOSE.
  constexpr size_t kParallel = 16;
  for (size_t base = 0; base < connections.size(); base += kParallel) {
    std::vector<std::thread> closers;
    for (size_t i = base; i < std::min(connections.size(), base + kParallel); ++i) {
      closers.emplace_back([c = connections[i]] { c->close(); });
    }
    for (auto& t : closers) t.join();
  }
  connections.clear();
  listeners.clear();
}

}  // namespace reccl
