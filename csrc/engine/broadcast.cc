#include "engine/broadcast.h"

#include "engine/collective.h"
#include "engine/recursive_doubling.h"
#include "engine/ring.h"

namespace reccl {

void broadcast(Communicator& comm, void* buffer, size_t count, DataType dtype, int root,
               Millis timeout) {
  checkRoot(root, comm.size());
  const size_t bytes = count * elementSize(dtype);
  const Algorithm algorithm = chooseAlgorithm(comm, bytes);
  const bool rd = algorithm == Algorithm::kRecursiveDoubling;
  OpDescriptor desc = OpDescriptor::of(OpKind::kBroadcast, dtype, count, root);
  desc.algorithm = static_cast<uint8_t>(algorithm);
  const int rootPosition = comm.layout(desc.kind, timeout).position(root);
  comm.run(desc, timeout, rd ? broadcastPayload(bytesOf(buffer), bytes, rootPosition) : RdPayload{},
           [&](const OpContext& ctx) {
             if (comm.size() == 1 || rd) return;
             const std::vector<Range> ranges = comm.channelPlan().split(count);
             const size_t unit = chunkElems(comm, dtype, largestRange(ranges), 1);
             comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
               chainBroadcast(job, bytesOf(buffer), ranges[job.channel], root, sends);
             });
           });
}

}  // namespace reccl
