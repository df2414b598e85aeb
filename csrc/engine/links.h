// The connections of one communicator: for every peer, one one-way connection
// each way per channel (channel c pinned to NIC c % nics) plus one per way for
// point-to-point traffic (on NIC (rank + peer) % nics), so p2p messages never
// interleave with collective ones.
//
// At construction each rank opens one listener per (peer, lane, channel) and
// publishes the handles through the rendezvous; connections are made lazily,
// the first time an operation needs them (the sender connects, the receiver
// accepts on the listener it opened for that peer, so it knows who dialed).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/clock.h"
#include "engine/op_context.h"
#include "engine/rendezvous.h"
#include "transport/transport.h"

namespace reccl {

enum class Lane : int { kCollective = 0, kP2p = 1 };

class Links {
 public:
  // Publishes this rank's handles under `prefix` and reads every peer's
  // (bounded by `timeout`).
  Links(std::shared_ptr<Transport> transport, Rendezvous& rendezvous,
        const std::string& prefix, int rank, int size, int channels, Millis timeout);
  ~Links();
  Links(const Links&) = delete;
  Links& operator=(const Links&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int channels() const { return channels_; }
  int nicOf(int channel) const { return channel % nics_; }

  // The connection to `peer`; dials it on first use (does not block).
  std::shared_ptr<SendConnection> sender(int peer, int channel, Lane lane);
  // The connection from `peer`; accepts it on first use (blocks, bounded by ctx).
  std::shared_ptr<RecvConnection> receiver(int peer, int channel, Lane lane, const OpContext& ctx);
  // Non-blocking: the connection from `peer` if it has been (or can now be) accepted.
  std::shared_ptr<RecvConnection> tryReceiver(int peer, int channel, Lane lane);

  // Bit c: a collective connection of channel c runs over a backup path, or
  // channel c's local NIC is in `nicsDown` (as nicsDown() returns it). Never
  // blocks on a link being connected.
  uint64_t channelsOnBackup(uint64_t nicsDown) const;
  // Bit n: local NIC n is down.
  uint64_t nicsDown() const;

  // Closes every connection and listener (in parallel; each bounded by the
  // transport's close handshake). Pending requests fail and no buffer is
  // written afterwards. Idempotent; later sender()/receiver() calls throw.
  void close();

 private:
  struct Link {
    std::mutex mutex;
    std::shared_ptr<Listener> listener;  // mine: the peer dials it to send to me
    std::vector<uint8_t> peerHandle;     // the peer's listener for my sends
    std::shared_ptr<SendConnection> send;
    std::shared_ptr<RecvConnection> recv;
  };
  Link& link(int peer, int channel, Lane lane);
  int slotsPerPeer() const { return channels_ + 1; }
  void checkOpen() const;

  std::shared_ptr<Transport> transport_;
  const int rank_;
  const int size_;
  const int channels_;
  int nics_ = 1;
  std::vector<std::unique_ptr<Link>> links_;  // [peer][slot]
  std::atomic<bool> closed_{false};
};

}  // namespace reccl
