#include "engine/ring.h"

#include <algorithm>
#include <deque>
#include <optional>

namespace reccl {

namespace {

struct Item {
  int step;
  int segment;
  size_t chunk;
  Range elements;  // in the buffer
};

// The receives of a ring phase in order: step s brings segment firstRecv - s.
std::vector<Item> ringItems(const ChannelJob& job, const SegmentFn& seg, int firstRecv) {
  std::vector<Item> items;
  for (int s = 0; s < job.size() - 1; ++s) {
    int j = job.mod(firstRecv - s);
    Range g = seg(j);
    for (size_t k = 0; k < job.chunksOf(g.count); ++k)
      items.push_back({s, j, k, chunkOf(job, g, k)});
  }
  return items;
}

bool anyData(const ChannelJob& job, const SegmentFn& seg) {
  for (int j = 0; j < job.size(); ++j) {
    if (seg(j).count > 0) return true;
  }
  return false;
}

// A ring phase's neighbours on this channel: send to the next rank, receive
// from the previous one.
struct RingNeighbours {
  int next;
  int prev;
  std::shared_ptr<SendConnection> to;
  std::shared_ptr<RecvConnection> from;
};

// Nothing (no connection is even made) when the channel has no data to move.
std::optional<RingNeighbours> ringNeighbours(ChannelJob& job, const SegmentFn& seg) {
  if (job.size() == 1 || !anyData(job, seg)) return std::nullopt;
  RingNeighbours r;
  r.next = job.ringRank(1);
  r.prev = job.ringRank(-1);
  r.to = job.links.sender(r.next, job.channel, Lane::kCollective);
  r.from = job.links.receiver(r.prev, job.channel, Lane::kCollective, job.ctx);
  return r;
}

}  // namespace

std::vector<Range> ringSegments(const Range& range, int parts) {
  std::vector<Range> segs = splitEvenly(range.count, parts);
  for (auto& s : segs) s.offset += range.offset;
  return segs;
}

size_t largestRingSegment(const std::vector<Range>& ranges, int parts) {
  size_t largest = 0;
  for (const auto& r : ranges) largest = std::max(largest, (r.count + parts - 1) / parts);
  return largest;
}

SegmentFn rankBlockSegments(const ChannelJob& job, size_t count, const Range& range) {
  return [&job, count, range](int j) {
    return Range{job.layout.rankAt(j) * count + range.offset, range.count};
  };
}

void ringReduceScatter(ChannelJob& job, uint8_t* work, const SegmentFn& seg, int finalSegment,
                       ReduceOp op, RegionSends& regions, SendList& sends) {
  const std::optional<RingNeighbours> ring = ringNeighbours(job, seg);
  if (!ring) return;
  const int n = job.size(), next = ring->next, prev = ring->prev;
  const size_t elem = job.elem;

  // Step s sends segment final-1-s and receives (and reduces) segment final-2-s.
  std::vector<Item> items = ringItems(job, seg, finalSegment - 2);
  const size_t window = std::min<size_t>(std::max(job.window, 1), items.size());
  const size_t slotBytes = job.chunkElems * elem;
  if (job.scratch.size() < window * slotBytes) job.scratch.resize(window * slotBytes);
  uint8_t* slots = job.scratch.data();
  std::deque<std::shared_ptr<Request>> posted;
  auto post = [&](size_t i) {
    posted.push_back(
        ring->from->irecv(slots + (i % window) * slotBytes, items[i].elements.count * elem));
  };
  for (size_t i = 0; i < window; ++i) post(i);

  const int first = job.mod(finalSegment - 1);
  Range g = seg(first);
  for (size_t k = 0; k < job.chunksOf(g.count); ++k) {
    Range c = chunkOf(job, g, k);
    auto request = ring->to->isend(work + c.offset * elem, c.count * elem);
    regions.put(first, k, request);
    sends.add(std::move(request), next);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const size_t bytes = it.elements.count * elem;
    checkArrived(job, job.ctx.wait(*posted.front(), "data from", prev, job.channel), bytes, prev);
    posted.pop_front();
    uint8_t* region = work + it.elements.offset * elem;
    reduceInto(region, slots + (i % window) * slotBytes, it.elements.count, job.dtype, op);
    if (i + window < items.size()) post(i + window);
    if (it.step < n - 2) {
      auto request = ring->to->isend(region, bytes);
      regions.put(it.segment, it.chunk, request);
      sends.add(std::move(request), next);
    } else if (op == ReduceOp::kAvg) {
      divideBy(region, it.elements.count, job.dtype, n);
    }
  }
}

void ringAllgather(ChannelJob& job, uint8_t* buffer, const SegmentFn& seg, int ownSegment,
                   RegionSends* regions, SendList& sends) {
  const std::optional<RingNeighbours> ring = ringNeighbours(job, seg);
  if (!ring) return;
  const int n = job.size(), next = ring->next, prev = ring->prev;
  const size_t elem = job.elem;

  // Step s sends segment own-s and receives segment own-1-s straight into place.
  std::vector<Item> items = ringItems(job, seg, ownSegment - 1);
  const size_t window = std::min<size_t>(std::max(job.window, 1) * 2, items.size());
  std::deque<std::shared_ptr<Request>> posted;
  auto post = [&](size_t i) {
    const Item& it = items[i];
    if (regions) regions->waitFor(job, it.segment, it.chunk, next);
    posted.push_back(
        ring->from->irecv(buffer + it.elements.offset * elem, it.elements.count * elem));
  };
  for (size_t i = 0; i < window; ++i) post(i);

  Range g = seg(job.mod(ownSegment));
  for (size_t k = 0; k < job.chunksOf(g.count); ++k) {
    Range c = chunkOf(job, g, k);
    sends.add(ring->to->isend(buffer + c.offset * elem, c.count * elem), next);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const size_t bytes = it.elements.count * elem;
    checkArrived(job, job.ctx.wait(*posted.front(), "data from", prev, job.channel), bytes, prev);
    posted.pop_front();
    if (it.step < n - 2)
      sends.add(ring->to->isend(buffer + it.elements.offset * elem, bytes), next);
    if (i + window < items.size()) post(i + window);
  }
}

void chainBroadcast(ChannelJob& job, uint8_t* buffer, const Range& range, int root,
                    SendList& sends) {
  const int n = job.size();
  if (n == 1 || range.count == 0) return;
  const int position = job.mod(job.position() - job.layout.position(root));
  const int next = job.ringRank(1), prev = job.ringRank(-1);
  const size_t elem = job.elem;
  const size_t chunks = job.chunksOf(range.count);
  std::shared_ptr<SendConnection> to;
  if (position < n - 1) to = job.links.sender(next, job.channel, Lane::kCollective);
  if (position == 0) {
    for (size_t k = 0; k < chunks; ++k) {
      Range c = chunkOf(job, range, k);
      sends.add(to->isend(buffer + c.offset * elem, c.count * elem), next);
    }
    return;
  }
  auto from = job.links.receiver(prev, job.channel, Lane::kCollective, job.ctx);
  const size_t window = std::min<size_t>(std::max(job.window, 1) * 2, chunks);
  std::deque<std::shared_ptr<Request>> posted;
  auto post = [&](size_t k) {
    Range c = chunkOf(job, range, k);
    posted.push_back(from->irecv(buffer + c.offset * elem, c.count * elem));
  };
  for (size_t k = 0; k < window; ++k) post(k);
  for (size_t k = 0; k < chunks; ++k) {
    Range c = chunkOf(job, range, k);
    checkArrived(job, job.ctx.wait(*posted.front(), "data from", prev, job.channel), c.count * elem,
                 prev);
    posted.pop_front();
    if (to) sends.add(to->isend(buffer + c.offset * elem, c.count * elem), next);
    if (k + window < chunks) post(k + window);
  }
}

}  // namespace reccl
