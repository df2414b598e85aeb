#include "engine/reduce_scatter.h"

#include <cstring>

#include "engine/collective.h"
#include "engine/recursive_doubling.h"
#include "engine/ring.h"

namespace reccl {

void reduceScatter(Communicator& comm, const void* in, void* out, size_t count, DataType dtype,
                   ReduceOp op, Millis timeout) {
  checkReduceOp(op, dtype);
  const int rank = comm.rank(), size = comm.size();
  const size_t bytes = count * elementSize(dtype);  // per rank
  const Algorithm algorithm = chooseAlgorithm(comm, bytes * size);
  const bool rd = algorithm == Algorithm::kRecursiveDoubling;
  OpDescriptor desc = OpDescriptor::of(OpKind::kReduceScatter, dtype, count, -1, op);
  desc.algorithm = static_cast<uint8_t>(algorithm);
  uint8_t* work = comm.opScratch(bytes * size);
  if (bytes) std::memcpy(work, in, bytes * size);
  comm.run(desc, timeout, rd ? reducePayload(work, count * size, dtype, op) : RdPayload{},
           [&](const OpContext& ctx) {
             if (size > 1 && !rd) {
               const std::vector<Range> ranges = comm.channelPlan().split(count);
               const size_t unit = chunkElems(comm, dtype, largestRange(ranges), size - 1);
               comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
                 const Range range = ranges[job.channel];
                 // Segment j: the block of the rank at ring position j.
                 SegmentFn seg = [&](int j) {
                   return Range{job.layout.rankAt(j) * count + range.offset, range.count};
                 };
                 RegionSends regions(size);
                 ringReduceScatter(job, work, seg, job.position(), op, regions, sends);
               });
             }
             if (bytes) std::memcpy(out, work + rank * bytes, bytes);
             if (rd && op == ReduceOp::kAvg) divideBy(out, count, dtype, size);
           });
}

}  // namespace reccl
