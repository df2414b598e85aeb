// all_reduce by direct transfers in the fault-free ring's reduction order, for
// one channel. It runs instead of the ring whenever the ring's order would
// change or its division would not fit: with unequal shares (shares.h), and
// with a DCR plan (rebalance.h), whose channel division moves the ring's
// segment boundaries. Rank r reduces its share, which every other rank sends it
// directly (reduce-scatter), and sends the result directly to every other rank
// (all-gather): it sends and receives S + (N-2) s_r in all, so a rank with a
// small share carries little. Pipelined: every share is cut into the same
// number of parts (so part k of every share is reduced at about the same
// time), a part is reduced as soon as every rank's piece of it has arrived,
// and sent back at once on the return lane (links.h), so a link carries
// results while the reduce-scatter is still flowing on it.
//
// The reduction order is the fault-free ring's, element by element: each
// element of the ring's segment j (an equal channel plan, each channel's
// range cut into N segments, ring.h) is reduced starting from position j+1's
// value, then j+2's, ..., ending with position j's, with the same
// reduceInto() calls, whichever rank holds it and whatever the channel plan.
// Results are therefore bit-identical to the fault-free run for every dtype
// and op.
#pragma once

#include <cstddef>
#include <vector>

#include "engine/channel_job.h"
#include "engine/reduce_op.h"

namespace reccl {

// One segment of the fault-free ring: its elements and the ring position
// that ends with its reduction (the chain starts at the next position).
struct RingSegment {
  Range elements;
  int finalPosition = 0;
};

// The fault-free ring all_reduce's segments of `count` elements over
// `channels` equal channels and `size` ranks, in element order.
std::vector<RingSegment> ringReductionOrder(size_t count, int channels, int size);

// This channel's piece of every rank's share: rank o's share cut over the
// channels by `plan`, the range of `channel`; by rank.
std::vector<Range> sharePieces(const std::vector<Range>& shares, const ChannelPlan& plan,
                               int channel);

// The all_reduce of `buffer` on one channel: `pieces` (by rank) as
// sharePieces() gives them, `order` as ringReductionOrder() gives it.
void proportionalAllreduce(ChannelJob& job, uint8_t* buffer, const std::vector<Range>& pieces,
                           const std::vector<RingSegment>& order, ReduceOp op, SendList& sends);

}  // namespace reccl
