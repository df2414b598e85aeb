#include "engine/all_gather.h"

#include "engine/collective.h"
#include "engine/recursive_doubling.h"
#include "engine/ring.h"

namespace reccl {

void allgather(Communicator& comm, const void* in, void* out, size_t count, DataType dtype,
               Millis timeout) {
  const int rank = comm.rank(), size = comm.size();
  const size_t bytes = count * elementSize(dtype);
  const Algorithm algorithm = chooseAlgorithm(comm, bytes * size);
  const bool rd = algorithm == Algorithm::kRecursiveDoubling;
  OpDescriptor desc = OpDescriptor::of(OpKind::kAllgather, dtype, count);
  desc.algorithm = static_cast<uint8_t>(algorithm);
  const Layout& layout = comm.layout(desc.kind, timeout);
  uint8_t* blocks = rd ? gatherBlocks(comm, layout, out, bytes) : bytesOf(out);
  copyIfDistinct(blocks + (rd ? layout.position(rank) : rank) * bytes, in, bytes);
  comm.run(desc, timeout, rd ? gatherPayload(blocks, bytes, size) : RdPayload{},
           [&](const OpContext& ctx) {
             if (rd) blocksToRankOrder(layout, blocks, out, bytes);
             if (size == 1 || rd) return;
             const std::vector<Range> ranges = comm.channelPlan().split(count);
             const size_t unit = chunkElems(comm, dtype, largestRange(ranges), size - 1);
             comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
               const Range range = ranges[job.channel];
               // Segment j: the block of the rank at ring position j.
               SegmentFn seg = [&](int j) {
                 return Range{job.layout.rankAt(j) * count + range.offset, range.count};
               };
               ringAllgather(job, bytesOf(out), seg, job.position(), nullptr, sends);
             });
           });
}

}  // namespace reccl
