// Ring algorithms for one channel, chunked and pipelined: a chunk is forwarded
// as soon as it has arrived (and been reduced), so every step of the ring is
// busy at once. The ring runs in the layout's order (layout.h: a host's ranks
// next to each other); segment j of the ring is seg(j) (elements of the
// buffer), j counted in that order, the same segmentation on every rank. Bandwidth-optimal for
// large messages: each rank sends 2(N-1)/N of the data for an allreduce.
#pragma once

#include <functional>
#include <vector>

#include "engine/channel_job.h"
#include "engine/reduce_op.h"

namespace reccl {

using SegmentFn = std::function<Range(int segment)>;

// The ring segments of one channel's `range`: `parts` near-equal pieces (the
// same on every rank), for rings that cut each channel's range per rank.
std::vector<Range> ringSegments(const Range& range, int parts);
// The largest such segment over every channel's range (it sizes the chunks).
size_t largestRingSegment(const std::vector<Range>& ranges, int parts);
// The segments of a collective over one block of `count` elements per rank
// (rank r's at r * count: reduce_scatter, all_gather): segment j is the
// channel's `range` of the block of the rank at ring position j.
SegmentFn rankBlockSegments(const ChannelJob& job, size_t count, const Range& range);

// After N-1 steps segment `finalSegment` of `work` holds the reduction over all
// ranks (AVG already divided); other segments hold partial sums. Each rank must
// pass finalSegment = its position + k for one k common to all ranks. Records in
// `regions` which send read which chunk, and queues every send in `sends`.
void ringReduceScatter(ChannelJob& job, uint8_t* work, const SegmentFn& seg, int finalSegment,
                       ReduceOp op, RegionSends& regions, SendList& sends);

// Each rank holds segment `ownSegment` (= position + k for a common k); after N-1
// steps every rank holds every segment. With `regions`, a receive waits until
// the reduce-scatter send that read its region has completed.
void ringAllgather(ChannelJob& job, uint8_t* buffer, const SegmentFn& seg, int ownSegment,
                   RegionSends* regions, SendList& sends);

// Root's `range` of `buffer` down the chain from rank `root` along the ring order.
void chainBroadcast(ChannelJob& job, uint8_t* buffer, const Range& range, int root,
                    SendList& sends);

}  // namespace reccl
