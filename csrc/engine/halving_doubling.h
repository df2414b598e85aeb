// Rabenseifner's all_reduce for one channel: a reduce-scatter by recursive
// halving, then an all-gather by recursive doubling. Bandwidth-optimal like the
// ring (each rank sends 2(P-1)/P of the channel's data) but in 2 log2 P
// dependent steps instead of the ring's 2(N-1), so it wins where per-step
// latency dominates a ring step (many ranks, messages of a few MiB). Each step
// is chunked and pipelined like the ring: its sends go out at once, its
// receives are posted a window ahead and reduced as they arrive.
//
// Positions (layout.h) stand in for ranks, so partners at distance 1 share a
// host where the layout groups hosts. With N = P + r ranks (P the largest
// power of two <= N), the first 2r positions fold in pairs first: the even one
// sends its whole range to the odd one, which reduces it and takes part; the
// even one receives the result at the end.
//
// Every element's reduction is computed on exactly one rank, in an order fixed
// by the positions alone, then copied to the others: every rank ends with the
// same bits, and runs repeat bit for bit.
#pragma once

#include <cstdint>

#include "engine/channel_job.h"
#include "engine/channel_plan.h"
#include "engine/reduce_op.h"

namespace reccl {

// Reduces `range` of `work` (elements) over every rank of the job's group in
// place (AVG divided); no connection is made when the range is empty.
void halvingDoublingAllreduce(ChannelJob& job, uint8_t* work, const Range& range, ReduceOp op,
                              SendList& sends);

// For chunkElems (collective.h), in units of the largest channel range: one
// connection carries at most one range per op (the fold, its return, or the
// steps with the farthest partner: half a range each way twice), and one more
// for the chunks cut short at the step edges.
constexpr int kHalvingSegmentsPerConnection = 2;

}  // namespace reccl
