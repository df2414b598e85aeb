#include "engine/proportional.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <tuple>
#include <utility>

#include "engine/ring.h"

namespace reccl {

namespace {

// Receives in flight at once on one channel, per lane: enough that the link
// into this rank never waits for the round trip of the next grant, and no
// more: all senders at once into one NIC overflowed its queue (docs/design.md,
// "Direct transfers unpaced"). Measured on 4 hosts with one NIC of 4 down: 2
// kept 0.79-0.80 of fault-free, 4 0.82, 6 0.77-0.80.
constexpr size_t kReceivesInFlight = 4;
// Staging slots per peer: part k is being received while the ones before it
// await their reduction.
constexpr size_t kSlotsPerPeer = 4;

// Reduces `chunk` of this rank's share in `buffer` in the fault-free ring's
// order (see proportional.h). `incoming[r]`: where rank r's values of the
// chunk arrived (this rank's own are in `buffer`). The result lands in
// `buffer`; the arrived values are used up.
void reduceInRingOrder(const ChannelJob& job, uint8_t* buffer, const Range& chunk,
                       const std::vector<RingSegment>& order, const std::vector<uint8_t*>& incoming,
                       ReduceOp op) {
  const int n = job.size(), me = job.rank();
  const size_t elem = job.elem, end = chunk.offset + chunk.count;
  auto segment = std::upper_bound(order.begin(), order.end(), chunk.offset,
                                  [](size_t at, const RingSegment& s) {
                                    return at < s.elements.offset + s.elements.count;
                                  });
  for (; segment != order.end() && segment->elements.offset < end; ++segment) {
    const size_t from = std::max(chunk.offset, segment->elements.offset);
    const size_t count = std::min(end, segment->elements.offset + segment->elements.count) - from;
    uint8_t* own = buffer + from * elem;
    auto valueAt = [&](int position) {
      const int rank = job.layout.rankAt(job.mod(position));
      return rank == me ? own : incoming[rank] + (from - chunk.offset) * elem;
    };
    // The ring's chain: position final+1 sends its value, each next position
    // reduces what arrives into its own, position final ends it.
    uint8_t* partial = valueAt(segment->finalPosition + 1);
    for (int step = 2; step <= n; ++step) {
      uint8_t* value = valueAt(segment->finalPosition + step);
      reduceInto(value, partial, count, job.dtype, op);
      partial = value;
    }
    if (partial != own) std::memcpy(own, partial, count * elem);
    if (op == ReduceOp::kAvg) divideBy(own, count, job.dtype, n);
  }
}

}  // namespace

std::vector<RingSegment> ringReductionOrder(size_t count, int channels, int size) {
  std::vector<RingSegment> order;
  for (const Range& range : ChannelPlan(channels).split(count)) {
    const std::vector<Range> segments = ringSegments(range, size);
    for (int j = 0; j < size; ++j) {
      if (segments[j].count > 0) order.push_back({segments[j], j});
    }
  }
  return order;
}

std::vector<Range> sharePieces(const std::vector<Range>& shares, const ChannelPlan& plan,
                               int channel) {
  std::vector<Range> pieces;
  pieces.reserve(shares.size());
  for (const Range& share : shares) {
    Range piece = plan.split(share.count).at(channel);
    piece.offset += share.offset;
    pieces.push_back(piece);
  }
  return pieces;
}

void proportionalAllreduce(ChannelJob& job, uint8_t* buffer, const std::vector<Range>& pieces,
                           const std::vector<RingSegment>& order, ReduceOp op, SendList& sends) {
  const int n = job.size(), me = job.rank();
  if (n == 1) return;
  const size_t elem = job.elem;
  const Range own = pieces.at(me);
  std::vector<int> peers, talkTo;  // from the next rank on
  for (int i = 1; i < n; ++i) {
    const int peer = (me + i) % n;
    peers.push_back(peer);
    if (pieces[peer].count > 0 || own.count > 0) talkTo.push_back(peer);
  }
  if (talkTo.empty()) return;  // no data on this channel
  for (Lane lane : {Lane::kCollective, Lane::kReturn}) {
    job.links.claimForDirect(talkTo, job.channel, lane);
    job.links.dialAhead(talkTo, job.channel, lane);
  }
  auto to = [&](int peer, Lane lane) { return job.links.sender(peer, job.channel, lane); };
  auto from = [&](int peer, Lane lane) {
    return job.links.receiver(peer, job.channel, lane, job.ctx);
  };
  // Every piece is cut into the same number of parts, sized in proportion to
  // the piece: part k of every share is then reduced at about the same time,
  // so the turns below keep each sender serving one receiver at a time.
  size_t parts = 0;
  for (const Range& piece : pieces) parts = std::max(parts, job.chunksOf(piece.count));
  auto partsOf = [&](const Range& piece) { return std::min(parts, piece.count); };
  auto part = [&](const Range& piece, size_t k) {
    const size_t base = piece.count / parts, rest = piece.count % parts;
    return Range{piece.offset + k * base + std::min(k, rest), base + (k < rest ? 1 : 0)};
  };
  // The peer a receiver takes part k from in turn i: rotated by k.
  auto turn = [&](size_t k, int i) { return peers[(i + k) % (n - 1)]; };

  // Reduce-scatter sends: this rank's values of every other rank's piece, all
  // posted at once; each receiver paces them by the receives it posts.
  std::vector<std::vector<std::shared_ptr<Request>>> scattered(n);
  for (int peer : peers) {
    const Range& piece = pieces[peer];
    auto connection = partsOf(piece) > 0 ? to(peer, Lane::kCollective) : nullptr;
    for (size_t k = 0; k < partsOf(piece); ++k) {
      const Range c = part(piece, k);
      auto request = connection->isend(buffer + c.offset * elem, c.count * elem);
      scattered[peer].push_back(request);
      sends.add(std::move(request), peer);
    }
  }

  // The all-gather's receives, on the return lane, straight into `buffer` over
  // this rank's values of the peer's piece: each once the send that read that
  // part has completed, in turns, kReceivesInFlight at once. They run beside
  // this rank's own reduce-scatter receives, so a link carries both at once.
  struct Gathering {
    std::shared_ptr<Request> request;
    int peer;
    size_t bytes;
  };
  std::deque<Gathering> gathering;
  size_t nextGather = 0;  // k * (n - 1) + turn
  const size_t gatherTotal = parts * (n - 1);
  // Posts what may be posted; with `block` it waits for the sends it needs,
  // else it stops at the first that has not completed.
  auto gatherAhead = [&](bool block) {
    while (nextGather < gatherTotal && gathering.size() < kReceivesInFlight) {
      const size_t k = nextGather / (n - 1);
      const int peer = turn(k, static_cast<int>(nextGather % (n - 1)));
      if (k < partsOf(pieces[peer])) {
        const Request& sent = *scattered[peer][k];
        if (block) {
          job.ctx.wait(sent, "send to", peer, job.channel);
        } else if (!job.ctx.test(sent, "send to", peer, job.channel)) {
          return;
        }
        const Range c = part(pieces[peer], k);
        gathering.push_back(
            {from(peer, Lane::kReturn)->irecv(buffer + c.offset * elem, c.count * elem), peer,
             c.count * elem});
      }
      ++nextGather;
    }
  };
  // Retires the arrived receives at the front; with `block`, all of them.
  auto gatherArrived = [&](bool block) {
    while (!gathering.empty()) {
      const Gathering& g = gathering.front();
      if (!block && !job.ctx.test(*g.request, "data from", g.peer, job.channel)) return;
      checkArrived(job, job.ctx.wait(*g.request, "data from", g.peer, job.channel), g.bytes,
                   g.peer);
      gathering.pop_front();
      gatherAhead(block);
    }
  };

  // This rank's share: part k from every peer, taken in turns with
  // kReceivesInFlight at once, reduced once all have arrived, then sent to
  // every peer at once on the return lane.
  const size_t ownParts = partsOf(own);
  if (ownParts > 0) {
    const size_t slotBytes = (own.count + parts - 1) / parts * elem;
    const size_t peerBytes = kSlotsPerPeer * slotBytes;
    if (job.scratch.size() < (n - 1) * peerBytes) job.scratch.resize((n - 1) * peerBytes);
    std::vector<int> indexOf(n, -1);
    for (int i = 0; i < n - 1; ++i) indexOf[peers[i]] = i;
    auto slot = [&](int peer, size_t k) {
      return job.scratch.data() + indexOf[peer] * peerBytes + (k % kSlotsPerPeer) * slotBytes;
    };
    std::deque<std::shared_ptr<Request>> posted;
    size_t next = 0;  // the next receive to post, k * (n - 1) + turn
    const size_t total = ownParts * (n - 1);
    // Posts while fewer than the bound are in flight; never part k + 2 before
    // part k is reduced (its slots are reused).
    auto postAhead = [&](size_t reducedUpTo) {
      while (next < total && posted.size() < kReceivesInFlight &&
             next / (n - 1) < reducedUpTo + kSlotsPerPeer) {
        const size_t k = next / (n - 1);
        const int peer = turn(k, static_cast<int>(next % (n - 1)));
        posted.push_back(
            from(peer, Lane::kCollective)->irecv(slot(peer, k), part(own, k).count * elem));
        ++next;
      }
    };
    postAhead(0);
    gatherAhead(false);
    std::vector<uint8_t*> incoming(n, nullptr);
    for (size_t k = 0; k < ownParts; ++k) {
      const Range c = part(own, k);
      for (int i = 0; i < n - 1; ++i) {
        const int peer = turn(k, i);
        checkArrived(job, job.ctx.wait(*posted.front(), "data from", peer, job.channel),
                     c.count * elem, peer);
        posted.pop_front();
        incoming[peer] = slot(peer, k);
        postAhead(k);
        gatherArrived(false);
        gatherAhead(false);
      }
      reduceInRingOrder(job, buffer, c, order, incoming, op);
      for (int i = 0; i < n - 1; ++i) {
        const int peer = turn(k, i);
        sends.add(to(peer, Lane::kReturn)->isend(buffer + c.offset * elem, c.count * elem), peer);
      }
      postAhead(k + 1);
    }
  }
  gatherAhead(true);
  gatherArrived(true);
}

}  // namespace reccl
