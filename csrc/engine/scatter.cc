#include "engine/scatter.h"

#include <cstring>

#include "engine/collective.h"
#include "engine/direct.h"
#include "engine/recursive_doubling.h"

namespace reccl {

void scatter(Communicator& comm, const void* in, void* out, size_t count, DataType dtype, int root,
             Millis timeout) {
  const int rank = comm.rank(), size = comm.size();
  const RootedOp op = rootedOp(comm, OpKind::kScatter, count, dtype, root);
  const size_t bytes = op.bytes;
  // Small: every rank receives all blocks into a work buffer.
  uint8_t* blocks = op.rd ? comm.opScratch(bytes * size) : nullptr;
  if (op.rd && rank == root && bytes) std::memcpy(blocks, in, bytes * size);
  const int rootPosition = comm.layout(op.desc.kind, timeout).position(root);
  comm.run(op.desc, timeout,
           op.rd ? broadcastPayload(blocks, bytes * size, rootPosition) : RdPayload{},
           [&](const OpContext& ctx) {
             if (op.rd) {
               if (bytes) std::memcpy(out, blocks + rank * bytes, bytes);
               return;
             }
             if (rank == root) copyIfDistinct(out, bytesOf(in) + root * bytes, bytes);
             if (size == 1) return;
             const std::vector<Range> ranges = comm.channelPlan().split(count);
             const size_t unit = chunkElems(comm, dtype, largestRange(ranges), 1);
             comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
               const Range range = ranges[job.channel];
               std::vector<Transfer> sendTo, recvFrom;
               if (rank == root) {
                 for (int p = 0; p < size; ++p) {
                   if (p != root) {
                     sendTo.push_back({p,
                                       const_cast<uint8_t*>(bytesOf(in)),
                                       {p * count + range.offset, range.count}});
                   }
                 }
               } else {
                 recvFrom.push_back({root, bytesOf(out), range});
               }
               directExchange(job, sendTo, recvFrom, sends);
             });
           });
}

}  // namespace reccl
