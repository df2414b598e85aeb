#include "engine/gather.h"

#include "engine/collective.h"
#include "engine/direct.h"
#include "engine/recursive_doubling.h"

namespace reccl {

void gather(Communicator& comm, const void* in, void* out, size_t count, DataType dtype, int root,
            Millis timeout) {
  const int rank = comm.rank(), size = comm.size();
  const RootedOp op = rootedOp(comm, OpKind::kGather, count, dtype, root);
  const size_t bytes = op.bytes;
  // Small: every rank gathers every block (the others into a work buffer).
  const Layout& layout = comm.layout(op.desc.kind, timeout);
  uint8_t* blocks = nullptr;
  if (op.rd) {
    blocks = rank == root ? gatherBlocks(comm, layout, out, bytes) : comm.opScratch(bytes * size);
    copyIfDistinct(blocks + layout.position(rank) * bytes, in, bytes);
  } else if (rank == root) {
    copyIfDistinct(bytesOf(out) + rank * bytes, in, bytes);
  }
  comm.run(op.desc, timeout, op.rd ? gatherPayload(blocks, bytes, size) : RdPayload{},
           [&](const OpContext& ctx) {
             if (op.rd && rank == root) blocksToRankOrder(layout, blocks, out, bytes);
             if (size == 1 || op.rd) return;
             const std::vector<Range> ranges = comm.channelPlan().split(count);
             const size_t unit = chunkElems(comm, dtype, largestRange(ranges), 1);
             comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
               const Range range = ranges[job.channel];
               std::vector<Transfer> sendTo, recvFrom;
               if (rank != root) {
                 sendTo.push_back({root, const_cast<uint8_t*>(bytesOf(in)), range});
               } else {
                 for (int p = 0; p < size; ++p) {
                   if (p != root) {
                     recvFrom.push_back({p, bytesOf(out), {p * count + range.offset, range.count}});
                   }
                 }
               }
               directExchange(job, sendTo, recvFrom, sends);
             });
           });
}

}  // namespace reccl
