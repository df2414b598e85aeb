#include "engine/all_to_all.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "engine/agreement.h"
#include "engine/collective.h"
#include "engine/direct.h"

namespace reccl {

namespace {

// At most this many chunks per pair and channel (a connection carries one
// pair's transfer): well below the transport's bound on outstanding requests.
constexpr size_t kMaxChunksPerTransfer = 128;

}  // namespace

void alltoall(Communicator& comm, const void* in, const std::vector<uint64_t>& sendCounts,
              const std::vector<uint64_t>& sendOffsets, void* out,
              const std::vector<uint64_t>& recvCounts, const std::vector<uint64_t>& recvOffsets,
              DataType dtype, Millis timeout) {
  const int rank = comm.rank(), size = comm.size();
  const size_t n = static_cast<size_t>(size);
  if (sendCounts.size() != n || sendOffsets.size() != n || recvCounts.size() != n ||
      recvOffsets.size() != n) {
    throw ConfigError("all_to_all needs one send and receive count and offset per rank (" +
                      std::to_string(size) + ")");
  }
  const size_t elem = elementSize(dtype);
  auto pairUnit = [&](uint64_t count) {
    size_t base = std::max<size_t>(1, comm.options().chunkBytes / elem);
    return std::max<size_t>(base, (count + kMaxChunksPerTransfer - 1) / kMaxChunksPerTransfer);
  };
  OpDescriptor desc;
  desc.kind = OpKind::kAlltoall;
  desc.dtype = dtype;
  desc.algorithm = static_cast<uint8_t>(Algorithm::kChannels);
  desc.sendCounts = sendCounts;
  desc.recvCounts = recvCounts;
  for (uint64_t c : sendCounts) desc.count += c;
  // Counts are checked by a digest in the agreement; each pair's own counts
  // are compared only when the digest says some pair disagrees.
  const uint64_t digest = alltoallCountsDigest(rank, size, sendCounts, recvCounts);
  comm.run(
      desc, timeout, RdPayload{},
      [&](const OpContext& ctx) {
        copyIfDistinct(bytesOf(out) + recvOffsets[rank] * elem,
                       bytesOf(in) + sendOffsets[rank] * elem, sendCounts[rank] * elem);
        if (size == 1) return;
        const ChannelPlan& plan = comm.channelPlan();
        comm.forChannels(ctx, dtype, 1, [&](ChannelJob& job, SendList& sends) {
          std::vector<Transfer> sendTo, recvFrom;
          for (int p = 0; p < size; ++p) {
            if (p == rank) continue;
            Range s = plan.split(sendCounts[p])[job.channel];
            s.offset += sendOffsets[p];
            sendTo.push_back(
                {p, const_cast<uint8_t*>(bytesOf(in)), s, -1, pairUnit(sendCounts[p])});
            Range r = plan.split(recvCounts[p])[job.channel];
            r.offset += recvOffsets[p];
            recvFrom.push_back({p, bytesOf(out), r, -1, pairUnit(recvCounts[p])});
          }
          directExchange(job, sendTo, recvFrom, sends);
        });
      },
      digest);
}

}  // namespace reccl
