#include "engine/halving_doubling.h"

#include <algorithm>
#include <deque>
#include <vector>

namespace reccl {

namespace {

// Where a position sits in the power-of-two group that runs the steps, of
// n - extra ranks: positions below 2 * extra fold in pairs (the odd one stays).
struct Virtual {
  int extra;
  // -1 for a rank that folds out.
  int of(int position) const {
    if (position < 2 * extra) return position % 2 == 1 ? position / 2 : -1;
    return position - extra;
  }
  int positionOf(int v) const { return v < extra ? 2 * v + 1 : v + extra; }
};

// Blocks [lo, hi) of the channel's range, as one range of elements (the
// blocks are contiguous, in virtual rank order).
Range blockSpan(const std::vector<Range>& blocks, int lo, int hi) {
  const size_t first = blocks[lo].offset;
  return Range{first, blocks[hi - 1].offset + blocks[hi - 1].count - first};
}

// Queues the chunks of `region` of `buffer` to `peer`; returns their requests.
std::vector<std::shared_ptr<Request>> sendRegion(ChannelJob& job, int peer, const uint8_t* buffer,
                                                 const Range& region, SendList& sends) {
  std::vector<std::shared_ptr<Request>> requests;
  if (region.count == 0) return requests;
  auto to = job.links.sender(peer, job.channel, Lane::kCollective);
  for (size_t k = 0; k < job.chunksOf(region.count); ++k) {
    const Range c = chunkOf(job, region, k);
    requests.push_back(to->isend(buffer + c.offset * job.elem, c.count * job.elem));
    sends.add(requests.back(), peer);
  }
  return requests;
}

// Receives `region` from `peer` chunk by chunk, a window of receives ahead:
// with `op`, into staging slots and reduced into `buffer` (buffer = buffer op
// incoming); without, straight into place.
void receiveRegion(ChannelJob& job, int peer, uint8_t* buffer, const Range& region,
                   const ReduceOp* op) {
  if (region.count == 0) return;
  const size_t elem = job.elem;
  const size_t chunks = job.chunksOf(region.count);
  auto from = job.links.receiver(peer, job.channel, Lane::kCollective, job.ctx);
  const size_t window = std::min<size_t>(std::max(job.window, 1) * (op ? 1 : 2), chunks);
  const size_t slotBytes = job.chunkElems * elem;
  if (op && job.scratch.size() < window * slotBytes) job.scratch.resize(window * slotBytes);
  std::deque<std::shared_ptr<Request>> posted;
  auto post = [&](size_t k) {
    const Range c = chunkOf(job, region, k);
    uint8_t* into = op ? job.scratch.data() + (k % window) * slotBytes : buffer + c.offset * elem;
    posted.push_back(from->irecv(into, c.count * elem));
  };
  for (size_t k = 0; k < window; ++k) post(k);
  for (size_t k = 0; k < chunks; ++k) {
    const Range c = chunkOf(job, region, k);
    checkArrived(job, job.ctx.wait(*posted.front(), "data from", peer, job.channel),
                 c.count * elem, peer);
    posted.pop_front();
    if (op) {
      reduceInto(buffer + c.offset * elem, job.scratch.data() + (k % window) * slotBytes, c.count,
                 job.dtype, *op);
    }
    if (k + window < chunks) post(k + window);
  }
}

void waitAll(ChannelJob& job, std::vector<std::shared_ptr<Request>>& requests, int peer) {
  for (auto& r : requests) job.ctx.wait(*r, "send to", peer, job.channel);
  requests.clear();
}

}  // namespace

void halvingDoublingAllreduce(ChannelJob& job, uint8_t* work, const Range& range, ReduceOp op,
                              SendList& sends) {
  const int n = job.size();
  if (n == 1 || range.count == 0) return;
  int pow2 = 1;
  while (pow2 * 2 <= n) pow2 *= 2;
  const Virtual virt{n - pow2};
  const int position = job.position();
  const int v = virt.of(position);
  auto rankOfVirtual = [&](int u) { return job.layout.rankAt(virt.positionOf(u)); };

  if (v < 0) {  // folds out: gives its data to the next position, takes the result back
    const int partner = job.layout.rankAt(position + 1);
    std::vector<std::shared_ptr<Request>> given = sendRegion(job, partner, work, range, sends);
    waitAll(job, given, partner);  // the result lands in the same memory
    receiveRegion(job, partner, work, range, nullptr);
    return;
  }
  std::vector<int> partners;
  for (int d = pow2 / 2; d >= 1; d /= 2) partners.push_back(rankOfVirtual(v ^ d));
  const bool foldsIn = position < 2 * virt.extra;
  const int folded = foldsIn ? job.layout.rankAt(position - 1) : -1;
  if (foldsIn) partners.push_back(folded);
  job.links.dialAhead(partners, job.channel, Lane::kCollective);

  if (foldsIn) receiveRegion(job, folded, work, range, &op);  // work = mine op the folded one's

  std::vector<Range> blocks = splitEvenly(range.count, pow2);
  for (auto& b : blocks) b.offset += range.offset;

  // Reduce-scatter by recursive halving: the blocks held shrink from [0, P)
  // to [v, v + 1); at distance d, keep the half holding v, give the other.
  // givenAt: each step's sends; the all-gather step at the same distance
  // receives into the region they read, so it waits for them first.
  std::vector<std::vector<std::shared_ptr<Request>>> givenAt;
  int lo = 0, hi = pow2;
  for (int d = pow2 / 2; d >= 1; d /= 2) {
    const int partner = rankOfVirtual(v ^ d);
    const int mid = lo + d;
    const bool upper = (v & d) != 0;
    const Range give = upper ? blockSpan(blocks, lo, mid) : blockSpan(blocks, mid, hi);
    const Range keep = upper ? blockSpan(blocks, mid, hi) : blockSpan(blocks, lo, mid);
    givenAt.push_back(sendRegion(job, partner, work, give, sends));
    receiveRegion(job, partner, work, keep, &op);
    (upper ? lo : hi) = mid;
  }
  if (op == ReduceOp::kAvg) divideBy(work + blocks[v].offset * job.elem, blocks[v].count, job.dtype, n);

  // All-gather by recursive doubling: the blocks held grow back to [0, P).
  for (int d = 1; d < pow2; d *= 2) {
    const int partner = rankOfVirtual(v ^ d);
    const bool upper = (v & d) != 0;
    const int base = upper ? lo - d : lo;
    const Range mine = blockSpan(blocks, lo, lo + d);
    const Range theirs = upper ? blockSpan(blocks, base, lo) : blockSpan(blocks, lo + d, lo + 2 * d);
    sendRegion(job, partner, work, mine, sends);
    waitAll(job, givenAt.back(), partner);  // the region we gave at this distance
    givenAt.pop_back();
    receiveRegion(job, partner, work, theirs, nullptr);
    lo = base;
  }
  if (foldsIn) sendRegion(job, folded, work, range, sends);
}

}  // namespace reccl
