#include "engine/all_reduce.h"

#include <algorithm>

#include "engine/collective.h"
#include "engine/halving_doubling.h"
#include "engine/proportional.h"
#include "engine/recursive_doubling.h"
#include "engine/ring.h"

namespace reccl {

namespace {

// Direct transfers' parts per ring chunk.
constexpr size_t kDirectPartsPerChunk = 8;

// The data phase by direct transfers in the ring's order (proportional.h):
// `weights` the shares (empty: equal), over the channels of the plan in force.
void proportional(Communicator& comm, const OpContext& ctx, void* out, size_t count, DataType dtype,
                  ReduceOp op, const std::vector<uint64_t>& weights) {
  const ChannelPlan& plan = comm.channelPlan();
  const std::vector<Range> shares =
      weights.empty() ? splitEvenly(count, comm.size()) : splitByWeights(count, weights);
  const std::vector<RingSegment> order = ringReductionOrder(count, plan.channels(), comm.size());
  std::vector<std::vector<Range>> pieces;
  size_t largest = 0;
  for (int c = 0; c < plan.channels(); ++c) {
    pieces.push_back(sharePieces(shares, plan, c));
    largest = std::max(largest, largestRange(pieces.back()));
  }
  // Each connection carries one piece each way per phase. The parts are an
  // eighth of the ring's chunk: direct transfers fill and drain their pipeline
  // once per op (a part is reduced once every peer's piece of it is in, and
  // returned only then), which small parts hide. Measured on 4 hosts with one
  // NIC of 4 down: 1 MiB parts kept 0.70 of fault-free, 128 KiB 0.79-0.80,
  // 32-64 KiB 0.76-0.77 (docs/benchmarks.md).
  const size_t unit = chunkElems(comm, dtype, largest, 2, kDirectPartsPerChunk);
  comm.forChannels(ctx, dtype, unit, [&](ChannelJob& job, SendList& sends) {
    proportionalAllreduce(job, bytesOf(out), pieces[job.channel], order, op, sends);
  });
}

}  // namespace

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
             // Unequal shares, or a DCR plan (which would move the ring's
             // segments, so its order): the fault-free ring's order by direct
             // transfers. With two ranks each element is one operation on two
             // values whichever segment holds it: the ring keeps the bits.
             const std::vector<uint64_t>& weights = comm.shareWeights();
             if (algorithm == Algorithm::kChannels && size > 2 &&
                 (!weights.empty() || !comm.channelPlan().equal())) {
               proportional(comm, ctx, out, count, dtype, op, weights);
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
