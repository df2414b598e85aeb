#include "engine/all_gather.h"

#include "engine/collective.h"
#include "engine/halving_doubling.h"
#include "engine/recursive_doubling.h"
#include "engine/ring.h"

namespace reccl {

void allgather(Communicator& comm, const void* in, void* out, size_t count, DataType dtype,
               Millis timeout) {
  const int rank = comm.rank(), size = comm.size();
  const size_t bytes = count * elementSize(dtype);
  const Algorithm algorithm = chooseAlgorithmOrHalving(comm, bytes * size);
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
             if (algorithm == Algorithm::kHalvingDoubling) {
               const size_t unit = chunkElems(comm, dtype, largestRange(ranges), size);
               comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
                 halvingDoubling(job, bytesOf(out),
                                 perRankBlocks(job, count, ranges[job.channel], false), nullptr,
                                 true, sends);
               });
               return;
             }
             const size_t unit = chunkElems(comm, dtype, largestRange(ranges), size - 1);
             comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
               ringAllgather(job, bytesOf(out), rankBlockSegments(job, count, ranges[job.channel]),
                             job.position(), nullptr, sends);
             });
           });
}

}  // namespace reccl
