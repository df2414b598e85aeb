// The connections of one communicator: to and from each peer, one one-way
// connection per channel (channel c pinned to NIC c % nics) plus one per way
// for point-to-point traffic (on NIC (rank + peer) % nics), so p2p messages
// never interleave with collective ones.
//
// Rendezvous in O(1) keys per rank: each rank opens one listener per NIC and
// publishes their handles under one key, "<prefix>h/<rank>". Nothing is read
// up front: a rank reads a peer's key the first time it sends to that peer,
// and every connection is made on first use, so a rank connects only to the
// peers its algorithms use (O(log N) for the agreement, ring neighbours, roots).
// Each dial carries a tag naming the sender's rank, lane and channel; the
// receiver accepts by tag on its listener of that NIC. A peer reads the key
// once and keeps the handles for the communicator's life (re-dials after a
// fault use them), so the key is spent once every other rank has connected
// to this one (releaseSpentKey() deletes it then); otherwise it is deleted
// when the communicator closes in order.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/clock.h"
#include "engine/op_context.h"
#include "engine/rendezvous.h"
#include "transport/transport.h"

namespace reccl {

// A channel's connections to a peer: kCollective carries every collective;
// kReturn, the results that a direct all_reduce sends back while the same peer
// is still sending on kCollective (proportional.h), so each flows on its own
// connection and neither waits behind the other; kP2p, point-to-point ops (one
// per pair, not per channel).
enum class Lane : int { kCollective = 0, kP2p = 1, kReturn = 2 };

class Links {
 public:
  // Opens the listeners and publishes their handles (one store write).
  Links(std::shared_ptr<Transport> transport, std::shared_ptr<Rendezvous> rendezvous,
        const std::string& prefix, int rank, int size, int channels, Millis timeout);
  ~Links();
  Links(const Links&) = delete;
  Links& operator=(const Links&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int channels() const { return channels_; }
  int nicOf(int channel) const { return channel % nics_; }
  int nics() const { return nics_; }

  // The connection to `peer`; on first use reads the peer's handles (bounded
  // by the rendezvous timeout) and dials (does not wait for it).
  std::shared_ptr<SendConnection> sender(int peer, int channel, Lane lane);
  // Starts the connections to `peers` at once: their handles in one store
  // read, the dials in parallel (an algorithm's first op then waits for one
  // round of dials, not one per step).
  void dialAhead(const std::vector<int>& peers, int channel, Lane lane);
  // The connection from `peer`; accepts it on first use (blocks, bounded by ctx).
  std::shared_ptr<RecvConnection> receiver(int peer, int channel, Lane lane, const OpContext& ctx);
  // As receiver(), but nullptr when `until` passes first.
  std::shared_ptr<RecvConnection> receiverUntil(int peer, int channel, Lane lane,
                                                const OpContext& ctx, Clock::time_point until);
  // Non-blocking: the connection from `peer` if it has been (or can now be) accepted.
  std::shared_ptr<RecvConnection> tryReceiver(int peer, int channel, Lane lane);

  // Bit c: a collective connection of channel c runs over a backup path, or
  // channel c's local NIC is in `nicsDown` (as nicsDown() returns it). Never
  // blocks on a link being connected.
  uint64_t channelsOnBackup(uint64_t nicsDown) const;
  // Bit n: local NIC n is down.
  uint64_t nicsDown() const;
  // Connections made so far (both directions), for stats and tests.
  size_t connections() const;
  // The peers this rank has a collective connection to on `channel`, in rank
  // order (which peers the algorithms talk to, for tests and tools).
  std::vector<int> sendPeers(int channel) const;

  // Deletes this rank's key once every other rank has connected to it (each
  // read it before dialing and never reads it again); otherwise does nothing.
  // One store request, bounded; never throws. Meant for after an operation,
  // off its latency.
  void releaseSpentKey();

  // What a failed operation asks, on the failure path only (never while the
  // group is healthy). The peers with a connection that failed on the verdict
  // that their process is gone (Connection::peerGone), in rank order.
  std::vector<int> peersGone() const;
  // Records in the rendezvous that this rank found `peers` gone, for the ranks
  // whose operations fail only as a consequence (a neighbour's abort closing
  // their connections): keys "<prefix>gone/n" (a count) and "<prefix>gone/<i>".
  // Bounded by kGoneStoreBound; never throws.
  void reportGone(const std::vector<int>& peers);
  struct GoneReport {
    int peer = -1;      // the member found gone
    int reporter = -1;  // the member that found it
  };
  // What the group's ranks have recorded so far; empty when nothing was, or
  // the store did not answer within kGoneStoreBound. Never throws.
  std::vector<GoneReport> goneReports();

  // Marks the connections on (channel, lane) to and from `peers` that are not
  // made yet as the direct all_reduce's own (proportional.h). A connection of
  // one end exists exactly when the other end's does, so both ends mark the
  // same ones.
  void claimForDirect(const std::vector<int>& peers, int channel, Lane lane);
  // Closes the connections claimForDirect() marked, in parallel, each bounded
  // by its close handshake: a healed fault leaves only the ring's behind. Every
  // rank calls it at the op whose agreement ends the direct form, when every
  // rank has finished the ops before it, so both ends close together (an
  // orderly close, never a fault); the next use dials anew. Never throws.
  void releaseDirect();

  // Closes every connection and listener (in parallel; each bounded by the
  // transport's close handshake). Pending requests fail and no buffer is
  // written afterwards. `orderly`: also deletes this rank's key (bounded).
  // Idempotent; later sender()/receiver() calls throw.
  void close(bool orderly = false);

 private:
  struct Link {
    std::mutex mutex;
    std::shared_ptr<SendConnection> send;
    std::shared_ptr<RecvConnection> recv;
    bool sendDirect = false;  // claimForDirect() marked send / recv
    bool recvDirect = false;
  };
  struct Peer {
    std::mutex mutex;
    std::vector<uint8_t> handles;  // the peer's listener handles, one per its NIC
  };
  Link& link(int peer, int channel, Lane lane);
  int slotOf(int channel, Lane lane) const;
  int nicFor(int peer, int channel, Lane lane) const;
  // The dial tag a sender of rank `from` uses for (lane, channel).
  static uint64_t tagOf(int from, int channel, Lane lane);
  const std::vector<uint8_t>& peerHandles(int peer);
  Peer& peerEntry(int peer);
  static void checkHandles(int peer, const std::vector<uint8_t>& blob);
  void checkOpen() const;
  // Records that `peer` connected to this rank (it has read our key).
  void noteAccepted(int peer);
  // Moves every connection out of its link (directOnly: those claimForDirect()
  // marked) and clears the marks; the links then dial or accept anew on use.
  std::vector<std::shared_ptr<Connection>> takeConnections(bool directOnly);
  // Closes `connections` in parallel, each bounded by its close handshake.
  static void closeAll(std::vector<std::shared_ptr<Connection>> connections);
  // Deletes our key (once), waiting at most kForgetBound for the store.
  void eraseKeyBounded();

  std::shared_ptr<Transport> transport_;
  std::shared_ptr<Rendezvous> rendezvous_;
  const std::string key_;
  const std::string prefix_;
  const int rank_;
  const int size_;
  const int channels_;
  const Millis timeout_;
  int nics_ = 1;
  std::vector<std::shared_ptr<Listener>> listeners_;  // by NIC; fixed after construction
  mutable std::mutex mapMutex_;                      // guards the two maps (not their entries)
  std::map<int, std::unique_ptr<Peer>> peers_;
  std::map<std::pair<int, int>, std::unique_ptr<Link>> links_;  // (peer, slot)
  std::atomic<bool> closed_{false};
  std::mutex keyMutex_;        // guards the two below
  std::set<int> connectedFrom_;  // peers that connected to us, until all have
  bool keySpent_ = false;        // every other rank has connected
  bool keyErased_ = false;
};

}  // namespace reccl
