// What each rank says it is doing at a collective: op sequence number, kind,
// dtype, count, root, reduce op, the channel plan in force and the newest plan
// the rank has heard of (DCR adopts it in-band, see rebalance.h). Every collective starts by
// exchanging descriptors with every peer (with small payloads inline, see
// communicator.h); every rank then compares all of them, so a mismatch raises the
// same error, naming both sides, on every rank before any data moves.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/data_type.h"
#include "engine/rebalance.h"
#include "engine/reduce_op.h"

namespace reccl {

enum class OpKind : uint8_t {
  kAllreduce = 1,
  kBroadcast = 2,
  kReduce = 3,
  kAllgather = 4,
  kReduceScatter = 5,
  kGather = 6,
  kScatter = 7,
  kAlltoall = 8,
  kBarrier = 9,
};
const char* opKindName(OpKind kind);

// Ranks called different collectives (or with different arguments) at the same
// op sequence number.
class MismatchError : public Error {
 public:
  using Error::Error;
};

struct OpDescriptor {
  uint64_t seq = 0;       // collectives issued on this communicator before this one
  OpKind kind = OpKind::kBarrier;
  DataType dtype = DataType::kUInt8;
  ReduceOp op = ReduceOp::kSum;   // reducing kinds only
  int32_t root = -1;              // rooted kinds only
  uint64_t count = 0;             // elements per rank (see each kind); alltoall: 0
  uint64_t planId = 0;            // channel plan in force (DCR switches it at an agreed op)
  uint64_t chunkBytes = 0;        // the communicator's pipelining unit (must agree)
  uint32_t channels = 0;          // the communicator's channels (must agree)
  PlanProposal proposal;          // the newest plan this rank knows of (may differ)
  // alltoall only: elements this rank sends to / receives from each rank.
  std::vector<uint64_t> sendCounts;
  std::vector<uint64_t> recvCounts;

  // "all_reduce(float32, 1024 elements, op=SUM)"
  std::string describe() const;

  // A collective's descriptor; root and op only where the kind has them.
  static OpDescriptor of(OpKind kind, DataType dtype, uint64_t count, int32_t root = -1,
                         ReduceOp op = ReduceOp::kSum) {
    OpDescriptor desc;
    desc.kind = kind;
    desc.dtype = dtype;
    desc.count = count;
    desc.root = root;
    desc.op = op;
    return desc;
  }
};

// The wire header of a descriptor message: 96 bytes, then the alltoall count
// vectors (16 bytes per rank), then any inline payload.
constexpr size_t kDescriptorBytes = 96;

// Serializes `desc` from `sender`, announcing `inlineBytes` of payload after it.
// `out` must hold messageBytes(desc, inlineBytes).
size_t encodeDescriptor(const OpDescriptor& desc, int sender, int groupSize,
                        uint32_t inlineBytes, uint8_t* out);
size_t descriptorMessageBytes(const OpDescriptor& desc, int groupSize, uint32_t inlineBytes);

struct DecodedDescriptor {
  OpDescriptor desc;
  int sender = -1;
  const uint8_t* payload = nullptr;  // inline bytes, inside the decoded buffer
  uint32_t payloadBytes = 0;
};
// Validates every field and length; throws ProtocolError naming the problem.
DecodedDescriptor decodeDescriptor(const uint8_t* data, size_t bytes, int groupSize);

// Compares the descriptors of every rank (index = rank). Throws MismatchError
// naming the first difference ("rank 0 called X but rank 2 called Y"); every
// rank computes the same verdict from the same inputs.
void checkConsistent(const std::vector<OpDescriptor>& byRank, const std::string& group);

}  // namespace reccl
