#include "engine/proportional.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <tuple>
#include <utility>

#include "engine/ring.h"

namespace reccl {

namespace {

// Receives in flight at once on one channel: two, so the link into this rank
// never waits for the round trip of the next grant, and no more: all senders
// at once into one NIC overflowed its queue (docs/design.md, "Direct
// transfers unpaced").
constexpr size_t kReceivesInFlight = 2;
// Staging slots per peer: chunk k is being received while k - 1 awaits its
// reduction.
constexpr size_t kSlotsPerPeer = 2;

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
  job.links.dialAhead(talkTo, job.channel, Lane::kCollective);
  auto to = [&](int peer) { return job.links.sender(peer, job.channel, Lane::kCollective); };
  auto from = [&](int peer) {
    return job.links.receiver(peer, job.channel, Lane::kCollective, job.ctx);
  };
  // The peer a receiver takes chunk k from in turn i: rotated by k, so the
  // ranks that send to one receiver take turns and each sender serves one
  // receiver at a time.
  auto turn = [&](size_t k, int i) { return peers[(i + k) % (n - 1)]; };

  // Reduce-scatter sends: this rank's values of every other rank's piece, all
  // posted at once; each receiver paces them by the receives it posts.
  std::vector<std::vector<std::shared_ptr<Request>>> scattered(n);
  for (int peer : peers) {
    const Range& piece = pieces[peer];
    if (piece.count == 0) continue;
    auto connection = to(peer);
    for (size_t k = 0; k < job.chunksOf(piece.count); ++k) {
      const Range c = chunkOf(job, piece, k);
      auto request = connection->isend(buffer + c.offset * elem, c.count * elem);
      scattered[peer].push_back(request);
      sends.add(std::move(request), peer);
    }
  }

  // This rank's share: chunk k from every peer, taken in turns with
  // kReceivesInFlight at once, reduced once all have arrived, then sent to
  // every peer at once.
  if (own.count > 0) {
    const size_t chunks = job.chunksOf(own.count);
    const size_t slotBytes = job.chunkElems * elem, peerBytes = kSlotsPerPeer * slotBytes;
    if (job.scratch.size() < (n - 1) * peerBytes) job.scratch.resize((n - 1) * peerBytes);
    std::vector<int> indexOf(n, -1);
    for (int i = 0; i < n - 1; ++i) indexOf[peers[i]] = i;
    auto slot = [&](int peer, size_t k) {
      return job.scratch.data() + indexOf[peer] * peerBytes + (k % kSlotsPerPeer) * slotBytes;
    };
    std::deque<std::shared_ptr<Request>> posted;
    size_t next = 0;  // the next receive to post, k * (n - 1) + turn
    const size_t total = chunks * (n - 1);
    // Posts while fewer than the bound are in flight; never chunk k + 2 before
    // chunk k is reduced (its slots are reused).
    auto postAhead = [&](size_t reducedUpTo) {
      while (next < total && posted.size() < kReceivesInFlight &&
             next / (n - 1) < reducedUpTo + kSlotsPerPeer) {
        const size_t k = next / (n - 1);
        const int peer = turn(k, static_cast<int>(next % (n - 1)));
        posted.push_back(from(peer)->irecv(slot(peer, k), chunkOf(job, own, k).count * elem));
        ++next;
      }
    };
    postAhead(0);
    std::vector<uint8_t*> incoming(n, nullptr);
    for (size_t k = 0; k < chunks; ++k) {
      const Range c = chunkOf(job, own, k);
      for (int i = 0; i < n - 1; ++i) {
        const int peer = turn(k, i);
        checkArrived(job, job.ctx.wait(*posted.front(), "data from", peer, job.channel),
                     c.count * elem, peer);
        posted.pop_front();
        incoming[peer] = slot(peer, k);
        postAhead(k);
      }
      reduceInRingOrder(job, buffer, c, order, incoming, op);
      for (int i = 0; i < n - 1; ++i) {
        const int peer = turn(k, i);
        sends.add(to(peer)->isend(buffer + c.offset * elem, c.count * elem), peer);
      }
      postAhead(k + 1);
    }
  }

  // All-gather receives, straight into `buffer` over this rank's values of the
  // peer's piece: each once the send that read that chunk has completed, after
  // every receive of this rank's share (a connection matches receives in
  // posting order), and in turns as above.
  size_t chunks = 0;
  for (int peer : peers) chunks = std::max(chunks, job.chunksOf(pieces[peer].count));
  std::deque<std::tuple<std::shared_ptr<Request>, int, size_t>> gathering;
  auto drain = [&](size_t limit) {
    while (gathering.size() > limit) {
      const auto& [request, peer, bytes] = gathering.front();
      checkArrived(job, job.ctx.wait(*request, "data from", peer, job.channel), bytes, peer);
      gathering.pop_front();
    }
  };
  for (size_t k = 0; k < chunks; ++k) {
    for (int i = 0; i < n - 1; ++i) {
      const int peer = turn(k, i);
      if (k >= job.chunksOf(pieces[peer].count)) continue;
      job.ctx.wait(*scattered[peer][k], "send to", peer, job.channel);
      drain(kReceivesInFlight - 1);
      const Range c = chunkOf(job, pieces[peer], k);
      gathering.emplace_back(from(peer)->irecv(buffer + c.offset * elem, c.count * elem), peer,
                             c.count * elem);
    }
  }
  drain(0);
}

}  // namespace reccl
