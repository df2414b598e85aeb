#include "engine/reduce.h"

#include <cstring>

#include "engine/collective.h"
#include "engine/direct.h"
#include "engine/recursive_doubling.h"
#include "engine/ring.h"

namespace reccl {

void reduce(Communicator& comm, const void* in, void* out, size_t count, DataType dtype,
            ReduceOp op, int root, Millis timeout) {
  const int rank = comm.rank(), size = comm.size();
  checkRoot(root, size);
  checkReduceOp(op, dtype);
  const size_t bytes = count * elementSize(dtype);
  const Algorithm algorithm = chooseAlgorithm(comm, bytes);
  const bool rd = algorithm == Algorithm::kRecursiveDoubling;
  OpDescriptor desc = OpDescriptor::of(OpKind::kReduce, dtype, count, root, op);
  desc.algorithm = static_cast<uint8_t>(algorithm);
  // The root reduces in place into `out`; the others in a work buffer (their
  // `out` stays untouched).
  uint8_t* work;
  if (rank == root) {
    copyIfDistinct(out, in, bytes);
    work = bytesOf(out);
  } else {
    work = comm.opScratch(bytes);
    if (bytes) std::memcpy(work, in, bytes);
  }
  comm.run(desc, timeout, rd ? reducePayload(work, count, dtype, op) : RdPayload{},
           [&](const OpContext& ctx) {
             if (size == 1) return;
             if (rd) {
               if (rank == root && op == ReduceOp::kAvg) divideBy(out, count, dtype, size);
               return;
             }
             const std::vector<Range> ranges = comm.channelPlan().split(count);
             const size_t unit =
                 chunkElems(comm, dtype, largestRingSegment(ranges, size), 2 * (size - 1));
             comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
               const std::vector<Range> segs = ringSegments(ranges[job.channel], size);
               SegmentFn seg = [&](int j) { return segs[j]; };
               RegionSends regions(size);
               // Each rank ends with the segment of its ring position.
               const int mine = job.position();
               ringReduceScatter(job, work, seg, mine, op, regions, sends);
               std::vector<Transfer> sendTo, recvFrom;
               if (rank != root) {
                 sendTo.push_back({root, work, segs[mine], mine, job.chunkElems});
               } else {
                 for (int p = 0; p < size; ++p) {
                   const int theirs = job.layout.position(p);
                   if (p != root)
                     recvFrom.push_back({p, work, segs[theirs], theirs, job.chunkElems});
                 }
               }
               directExchange(job, sendTo, recvFrom, sends, &regions);
             });
           });
}

}  // namespace reccl
