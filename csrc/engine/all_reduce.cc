#include "engine/all_reduce.h"

#include "engine/collective.h"
#include "engine/halving_doubling.h"
#include "engine/recursive_doubling.h"
#include "engine/ring.h"

namespace reccl {

void allreduce(Communicator& comm, const void* in, void* out, size_t count, DataType dtype,
               ReduceOp op, Millis timeout) {
  checkReduceOp(op, dtype);
  const int size = comm.size();
  const size_t bytes = count * elementSize(dtype);
  const Algorithm algorithm = chooseAlgorithmOrHalving(comm, bytes);
  const bool rd = algorithm == Algorithm::kRecursiveDoubling;
  OpDescriptor desc = OpDescriptor::of(OpKind::kAllreduce, dtype, count, -1, op);
  desc.algorithm = static_cast<uint8_t>(algorithm);
  copyIfDistinct(out, in, bytes);
  comm.run(desc, timeout, rd ? reducePayload(bytesOf(out), count, dtype, op) : RdPayload{},
           [&](const OpContext& ctx) {
             if (size == 1) return;
             if (rd) {
               if (op == ReduceOp::kAvg) divideBy(out, count, dtype, size);
               return;
             }
             const std::vector<Range> ranges = comm.channelPlan().split(count);
             if (algorithm == Algorithm::kHalvingDoubling) {
               const size_t unit =
                   chunkElems(comm, dtype, largestRange(ranges), kHalvingSegmentsPerConnection);
               comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
                 halvingDoubling(job, bytesOf(out), allreduceBlocks(job, ranges[job.channel]), &op,
                                 true, sends);
               });
               return;
             }
             const size_t unit =
                 chunkElems(comm, dtype, largestRingSegment(ranges, size), 2 * (size - 1));
             comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
               const std::vector<Range> segs = ringSegments(ranges[job.channel], size);
               SegmentFn seg = [&](int j) { return segs[j]; };
               RegionSends regions(size);
               ringReduceScatter(job, bytesOf(out), seg, job.position(), op, regions, sends);
               ringAllgather(job, bytesOf(out), seg, job.position(), &regions, sends);
             });
           });
}

}  // namespace reccl
