#include "engine/halving_doubling.h"

#include <algorithm>
#include <deque>
#include <vector>

namespace reccl {

HalvingCore::HalvingCore(int n) {
  while (pow2 * 2 <= n) pow2 *= 2;
  extra = n - pow2;
}

int HalvingCore::virtualOf(int position) const {
  if (position < 2 * extra) return position % 2 == 1 ? position / 2 : -1;
  return position - extra;
}

int HalvingCore::positionOf(int v) const { return v < extra ? 2 * v + 1 : v + extra; }

std::vector<int> HalvingCore::positionsOf(int v) const {
  if (v < extra) return {2 * v, 2 * v + 1};
  return {v + extra};
}

int HalvingCore::slotOf(int v) const {
  int slot = 0;
  for (int bit = 1; bit < pow2; bit *= 2) slot = slot * 2 + ((v & bit) != 0 ? 1 : 0);
  return slot;
}

namespace {

using Requests = std::vector<std::shared_ptr<Request>>;

// Appends `r` to `to`, merged into the last range where they touch (so an
// all_reduce's blocks stay one range, cut into chunks across block edges).
void append(Regions& to, const Range& r) {
  if (r.count == 0) return;
  if (!to.empty() && to.back().offset + to.back().count == r.offset) {
    to.back().count += r.count;
  } else {
    to.push_back(r);
  }
}

// Blocks [lo, hi) as one stream of regions.
Regions blockSpan(const std::vector<Regions>& blocks, int lo, int hi) {
  Regions span;
  for (int b = lo; b < hi; ++b) {
    for (const Range& r : blocks[b]) append(span, r);
  }
  return span;
}

bool anyData(const Regions& regions) {
  return std::any_of(regions.begin(), regions.end(), [](const Range& r) { return r.count > 0; });
}

bool anyData(const HalvingBlocks& plan) {
  return anyData(plan.folded) || anyData(plan.returned) ||
         std::any_of(plan.blocks.begin(), plan.blocks.end(),
                     [](const Regions& b) { return anyData(b); });
}

// The chunks of `regions`, each region cut on its own (both ends cut the same way).
std::vector<Range> chunksOf(const ChannelJob& job, const Regions& regions) {
  std::vector<Range> chunks;
  for (const Range& r : regions) {
    for (size_t k = 0; k < job.chunksOf(r.count); ++k) chunks.push_back(chunkOf(job, r, k));
  }
  return chunks;
}

// Queues the chunks of `regions` of `buffer` to `peer`; returns their requests.
Requests sendRegions(ChannelJob& job, int peer, const uint8_t* buffer, const Regions& regions,
                     SendList& sends) {
  Requests requests;
  if (!anyData(regions)) return requests;
  auto to = job.links.sender(peer, job.channel, Lane::kCollective);
  for (const Range& c : chunksOf(job, regions)) {
    requests.push_back(to->isend(buffer + c.offset * job.elem, c.count * job.elem));
    sends.add(requests.back(), peer);
  }
  return requests;
}

// Receives `regions` from `peer` chunk by chunk, a window of receives ahead:
// with `op`, into staging slots and reduced into `buffer` (buffer = buffer op
// incoming); without, straight into place.
void receiveRegions(ChannelJob& job, int peer, uint8_t* buffer, const Regions& regions,
                    const ReduceOp* op) {
  const std::vector<Range> chunks = chunksOf(job, regions);
  if (chunks.empty()) return;
  const size_t elem = job.elem;
  auto from = job.links.receiver(peer, job.channel, Lane::kCollective, job.ctx);
  const size_t window = std::min<size_t>(std::max(job.window, 1) * (op ? 1 : 2), chunks.size());
  const size_t slotBytes = job.chunkElems * elem;
  if (op && job.scratch.size() < window * slotBytes) job.scratch.resize(window * slotBytes);
  std::deque<std::shared_ptr<Request>> posted;
  auto post = [&](size_t k) {
    const Range& c = chunks[k];
    uint8_t* into = op ? job.scratch.data() + (k % window) * slotBytes : buffer + c.offset * elem;
    posted.push_back(from->irecv(into, c.count * elem));
  };
  for (size_t k = 0; k < window; ++k) post(k);
  for (size_t k = 0; k < chunks.size(); ++k) {
    const Range& c = chunks[k];
    checkArrived(job, job.ctx.wait(*posted.front(), "data from", peer, job.channel), c.count * elem,
                 peer);
    posted.pop_front();
    if (op) {
      reduceInto(buffer + c.offset * elem, job.scratch.data() + (k % window) * slotBytes, c.count,
                 job.dtype, *op);
    }
    if (k + window < chunks.size()) post(k + window);
  }
}

void waitAll(ChannelJob& job, Requests& requests, int peer) {
  for (auto& r : requests) job.ctx.wait(*r, "send to", peer, job.channel);
  requests.clear();
}

// `range` cut into `parts` near-equal blocks of one region each.
std::vector<Regions> evenBlocks(const Range& range, int parts) {
  std::vector<Regions> blocks;
  for (Range b : splitEvenly(range.count, parts)) {
    b.offset += range.offset;
    blocks.push_back({b});
  }
  return blocks;
}

// `range` of the block of the rank at `position` (blocks of `count`, in rank order).
Range rankBlock(const ChannelJob& job, size_t count, const Range& range, int position) {
  return Range{job.layout.rankAt(position) * count + range.offset, range.count};
}

// Per-rank blocks grouped by virtual rank, in slot order.
std::vector<Regions> rankBlocksBySlot(const ChannelJob& job, size_t count, const Range& range) {
  const HalvingCore core(job.size());
  std::vector<Regions> blocks(core.pow2);
  for (int v = 0; v < core.pow2; ++v) {
    for (int p : core.positionsOf(v))
      append(blocks[core.slotOf(v)], rankBlock(job, count, range, p));
  }
  return blocks;
}

// The even position of this rank's fold pair; -1 when it is in none.
int foldPairEven(const ChannelJob& job) {
  const int position = job.position();
  return position < 2 * HalvingCore(job.size()).extra ? position - position % 2 : -1;
}

// Every position's block but `except`'s, in position order.
Regions blocksBut(const ChannelJob& job, size_t count, const Range& range, int except) {
  Regions regions;
  for (int p = 0; p < job.size(); ++p) {
    if (p != except) append(regions, rankBlock(job, count, range, p));
  }
  return regions;
}

}  // namespace

void halvingDoubling(ChannelJob& job, uint8_t* work, const HalvingBlocks& plan,
                     const ReduceOp* reduce, bool gather, SendList& sends) {
  const int n = job.size();
  if (n == 1 || !anyData(plan)) return;
  const HalvingCore core(n);
  const int position = job.position();
  const int v = core.virtualOf(position);
  auto rankOfSlot = [&](int s) { return job.layout.rankAt(core.positionOf(core.slotOf(s))); };

  if (v < 0) {  // folds out: gives its part to the next position, takes its share back
    const int partner = job.layout.rankAt(position + 1);
    Requests given = sendRegions(job, partner, work, plan.folded, sends);
    waitAll(job, given, partner);  // the share may land in the same memory
    receiveRegions(job, partner, work, plan.returned, nullptr);
    return;
  }
  const int slot = core.slotOf(v);
  std::vector<int> partners;
  for (int d = core.pow2 / 2; d >= 1; d /= 2) partners.push_back(rankOfSlot(slot ^ d));
  const bool foldsIn = position < 2 * core.extra;
  const int folded = foldsIn ? job.layout.rankAt(position - 1) : -1;
  if (foldsIn) partners.push_back(folded);
  job.links.dialAhead(partners, job.channel, Lane::kCollective);

  if (foldsIn) receiveRegions(job, folded, work, plan.folded, reduce);  // mine op the folded one's

  // Reduce-scatter by recursive halving over slots: the blocks held shrink
  // from [0, P) to [slot, slot + 1); at slot distance d, keep the half holding
  // our slot, give the other. givenAt: each step's sends; the all-gather step
  // at the same distance receives into the region they read, so it waits for
  // them first.
  std::vector<Requests> givenAt;
  int lo = slot;
  if (reduce) {
    lo = 0;
    int hi = core.pow2;
    for (int d = core.pow2 / 2; d >= 1; d /= 2) {
      const int partner = rankOfSlot(slot ^ d);
      const int mid = lo + d;
      const bool upper = (slot & d) != 0;
      const Regions give =
          upper ? blockSpan(plan.blocks, lo, mid) : blockSpan(plan.blocks, mid, hi);
      const Regions keep =
          upper ? blockSpan(plan.blocks, mid, hi) : blockSpan(plan.blocks, lo, mid);
      givenAt.push_back(sendRegions(job, partner, work, give, sends));
      receiveRegions(job, partner, work, keep, reduce);
      (upper ? lo : hi) = mid;
    }
    if (*reduce == ReduceOp::kAvg) {
      for (const Range& r : plan.blocks[slot])
        divideBy(work + r.offset * job.elem, r.count, job.dtype, n);
    }
  }

  // All-gather by recursive doubling: the blocks held grow back to [0, P).
  for (int d = 1; gather && d < core.pow2; d *= 2) {
    const int partner = rankOfSlot(slot ^ d);
    const bool upper = (slot & d) != 0;
    const int base = upper ? lo - d : lo;
    const Regions mine = blockSpan(plan.blocks, lo, lo + d);
    const Regions theirs =
        upper ? blockSpan(plan.blocks, base, lo) : blockSpan(plan.blocks, lo + d, lo + 2 * d);
    sendRegions(job, partner, work, mine, sends);
    if (!givenAt.empty()) {  // the region we gave at this distance
      waitAll(job, givenAt.back(), partner);
      givenAt.pop_back();
    }
    receiveRegions(job, partner, work, theirs, nullptr);
    lo = base;
  }
  if (foldsIn) sendRegions(job, folded, work, plan.returned, sends);
}

HalvingBlocks allreduceBlocks(const ChannelJob& job, const Range& range) {
  HalvingBlocks plan;
  plan.blocks = evenBlocks(range, HalvingCore(job.size()).pow2);
  if (foldPairEven(job) >= 0) plan.folded = plan.returned = {range};
  return plan;
}

HalvingBlocks perRankBlocks(const ChannelJob& job, size_t count, const Range& range,
                            bool reducing) {
  HalvingBlocks plan;
  plan.blocks = rankBlocksBySlot(job, count, range);
  const int even = foldPairEven(job);
  if (even >= 0) {
    Regions own;
    append(own, rankBlock(job, count, range, even));
    // Reducing: every block is given, to be reduced; gathering: the rest come back.
    Regions many = blocksBut(job, count, range, reducing ? -1 : even);
    plan.folded = reducing ? many : own;
    plan.returned = reducing ? own : many;
  }
  return plan;
}

}  // namespace reccl
