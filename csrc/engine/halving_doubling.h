// Recursive halving and doubling for one channel: a reduce-scatter by
// recursive halving, an all-gather by recursive doubling, or both in turn
// (Rabenseifner's all_reduce). Bandwidth-optimal like the ring (an all_reduce
// sends 2(P-1)/P of the channel's data per rank) but in log2 P dependent steps
// per phase instead of the ring's N-1, so it wins where per-step latency
// dominates a ring step (many ranks, messages of a few MiB). Each step is
// chunked and pipelined like the ring: its sends go out at once, its receives
// are posted a window ahead and reduced as they arrive.
//
// Positions (layout.h) stand in for ranks, so partners at distance 1 share a
// host where the layout groups hosts. With N = P + r ranks (P the largest
// power of two <= N), the first 2r positions fold in pairs (HalvingCore): the
// even one gives the odd one its part first (reduced into the odd one's when
// reducing), the odd one runs the steps for both and returns the even one's
// part at the end.
//
// Nearest partner first: the halving meets the virtual ranks at distance 1,
// 2, ..., P/2 in turn (the doubling the reverse), so its largest messages go to
// the nearest positions. In a host-grouped layout those are on the host, and
// only the small late steps cross the network: about one buffer per host each
// way, as the ring sends; farthest first would send ranks-per-host times that.
// The steps run on the virtual rank's slot (HalvingCore::slotOf), in which
// these distances are P/2, ..., 1, so blocks split into contiguous halves.
//
// Reduction order (floats): every element is reduced on exactly one rank, the
// one whose block holds it at the end of the halving, along a tree fixed by
// the positions alone: the fold pairs first (odd position's value op even
// one's), then the virtual partners at distance 1, 2, ..., P/2 of the
// power-of-two core, the owner's partial first at each step. Then it is only
// copied: every rank that receives it gets the same bits, and runs repeat bit
// for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/channel_job.h"
#include "engine/channel_plan.h"
#include "engine/reduce_op.h"

namespace reccl {

// Ranges of a buffer moved as one stream, in order (each cut into chunks).
using Regions = std::vector<Range>;

// The power-of-two core of a group of n positions: P = the largest power of
// two <= n; positions below 2(n - P) fold in pairs, the odd one of each pair
// staying as a virtual rank of the core.
struct HalvingCore {
  explicit HalvingCore(int n);
  int pow2 = 1;
  int extra = 0;  // n - pow2: the number of fold pairs
  // The virtual rank of a position; -1 for one that folds out.
  int virtualOf(int position) const;
  // The position that runs the steps as virtual rank v.
  int positionOf(int v) const;
  // The positions whose data virtual rank v holds, in position order (the
  // even one of a fold pair first).
  std::vector<int> positionsOf(int v) const;
  // Virtual rank v's slot: v with its log2 P bits reversed (its own inverse).
  // Slots at distance P/2 are virtual ranks at distance 1.
  int slotOf(int v) const;
};

// What one channel moves. `blocks[s]`: what the virtual rank in slot s owns
// at the end of the halving (and holds at the start of the doubling), the same
// on every rank. `folded`: for this rank's fold pair (empty for other ranks), what the
// even position gives the odd one first; `returned`: what the odd one gives
// back at the end.
struct HalvingBlocks {
  std::vector<Regions> blocks;
  Regions folded;
  Regions returned;
};

// Runs over every rank of the job's group, in place in `work`: with `reduce`,
// the reduce-scatter by recursive halving (AVG divided at the end); with
// `gather`, then the all-gather by recursive doubling. No connection is made
// when every block is empty.
void halvingDoubling(ChannelJob& job, uint8_t* work, const HalvingBlocks& plan,
                     const ReduceOp* reduce, bool gather, SendList& sends);

// all_reduce of `range` (elements of `work`): the range cut into P blocks, in slot order.
HalvingBlocks allreduceBlocks(const ChannelJob& job, const Range& range);
// reduce_scatter (`reducing`) and all_gather over one block of `count`
// elements per rank (rank r's at r * count), of which this channel moves
// `range`: the block of virtual rank v (at slot slotOf(v)) is that range of
// the block of the rank at each of its positions. A reduce_scatter's fold gives every rank's block
// and returns the even position's own; an all_gather's gives the even position's own and returns
// every other.
HalvingBlocks perRankBlocks(const ChannelJob& job, size_t count, const Range& range, bool reducing);

// For chunkElems (collective.h), in units of the largest channel range: in an
// all_reduce one connection carries at most one range per op (the fold, its
// return, or the steps with the first partner: half a range each way twice),
// and one more for the chunks cut short at the step edges. With per-rank
// blocks it carries at most one range per rank (the fold gives all of them;
// the halving and the doubling with one partner give disjoint halves), each
// cut into at most its share of chunks: pass the group's size.
constexpr int kHalvingSegmentsPerConnection = 2;

}  // namespace reccl
