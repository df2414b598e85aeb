#include "engine/reduce_scatter.h"

#include <cstring>

#include "engine/collective.h"
#include "engine/halving_doubling.h"
#include "engine/recursive_doubling.h"
#include "engine/ring.h"

namespace reccl {

namespace {

// Reduces `work` (size blocks of `count`) so that this rank's block holds the
// reduction over every rank, per channel by `algorithm` (ring or halving).
void reduceScatterOverChannels(Communicator& comm, const OpContext& ctx, uint8_t* work,
                               size_t count, DataType dtype, ReduceOp op, Algorithm algorithm) {
  const int size = comm.size();
  const std::vector<Range> ranges = comm.channelPlan().split(count);
  if (algorithm == Algorithm::kHalvingDoubling) {
    const size_t unit = chunkElems(comm, dtype, largestRange(ranges), size);
    comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
      halvingDoubling(job, work, perRankBlocks(job, count, ranges[job.channel], true), &op, false,
                      sends);
    });
    return;
  }
  const size_t unit = chunkElems(comm, dtype, largestRange(ranges), size - 1);
  comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
    RegionSends regions(size);
    ringReduceScatter(job, work, rankBlockSegments(job, count, ranges[job.channel]), job.position(),
                      op, regions, sends);
  });
}

}  // namespace

void reduceScatter(Communicator& comm, const void* in, void* out, size_t count, DataType dtype,
                   ReduceOp op, Millis timeout) {
  checkReduceOp(op, dtype);
  const int rank = comm.rank(), size = comm.size();
  const size_t bytes = count * elementSize(dtype);  // per rank
  const Algorithm algorithm = chooseAlgorithmOrHalving(comm, bytes * size);
  const bool rd = algorithm == Algorithm::kRecursiveDoubling;
  OpDescriptor desc = OpDescriptor::of(OpKind::kReduceScatter, dtype, count, -1, op);
  desc.algorithm = static_cast<uint8_t>(algorithm);
  uint8_t* work = comm.opScratch(bytes * size);
  if (bytes) std::memcpy(work, in, bytes * size);
  comm.run(desc, timeout, rd ? reducePayload(work, count * size, dtype, op) : RdPayload{},
           [&](const OpContext& ctx) {
             if (size > 1 && !rd)
               reduceScatterOverChannels(comm, ctx, work, count, dtype, op, algorithm);
             if (bytes) std::memcpy(out, work + rank * bytes, bytes);
             if (rd && op == ReduceOp::kAvg) divideBy(out, count, dtype, size);
           });
}

}  // namespace reccl
