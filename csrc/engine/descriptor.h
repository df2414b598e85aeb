// What each rank says it is doing at a collective: op sequence number, kind,
// dtype, count, root, reduce op and the channel plan in force. Every collective starts by agreeing
// on the descriptors of all ranks (agreement.h), so a mismatch raises the same error, naming both
// sides, on every rank before any data moves. A rank whose own arguments are invalid in a way the
// others cannot see (a list of the wrong length, say) joins the agreement anyway with a Rejection
// in its descriptor, so every rank fails that op at once, with the same message, rather than
// waiting for it until the timeout.
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

// Why a rank's own arguments to a collective are invalid, in a fixed form that
// fits the wire descriptor. Reported like a mismatch (MismatchError): every
// agreement message was consumed, so the group stays usable.
struct Rejection {
  enum class Reason : uint8_t {
    kNone = 0,
    kListLength = 1,    // `argument` has `got` entries, `want` expected
    kElementCount = 2,  // argument[index] (index -1: argument) has `got` elements, `want` expected
    kDtype = 3,  // argument[index] has another dtype than the op's
    kNotRoot = 4,  // `argument` (`got` tensors) given on a rank that is not the root
    kSplitSizes = 5,  // split sizes `argument` add up to `got`, the tensor has `want` rows
    kIndivisible = 6,  // `argument` has `got` elements, not divisible over `want` ranks
  };
  static constexpr size_t kMaxArgumentName = 18;  // what the wire form holds

  Reason reason = Reason::kNone;
  std::string argument;  // the torch.distributed argument's name ([a-z_], at most 18)
  int32_t index = -1;
  int64_t got = 0;
  int64_t want = 0;

  explicit operator bool() const { return reason != Reason::kNone; }
  bool operator==(const Rejection& other) const {
    return reason == other.reason && argument == other.argument && index == other.index &&
           got == other.got && want == other.want;
  }
  // "scatter_list has 3 entries, expected 4"
  std::string describe(DataType dtype) const;
};

struct OpDescriptor {
  uint64_t seq = 0;  // collectives issued on this communicator before this one
  OpKind kind = OpKind::kBarrier;
  DataType dtype = DataType::kUInt8;
  ReduceOp op = ReduceOp::kSum;  // reducing kinds only
  int32_t root = -1;  // rooted kinds only
  uint64_t count = 0;  // elements per rank (see each kind); alltoall: elements sent
  uint64_t planId = 0;  // channel plan in force (DCR switches it at an agreed op)
  uint64_t chunkBytes = 0;  // the communicator's pipelining unit (must agree)
  uint32_t channels = 0;  // the communicator's channels (must agree)
  uint8_t algorithm = 0;  // how the data moves (collective.h); must agree
  Rejection rejection;  // set: this rank's arguments are invalid (never a valid op's equal)
  // alltoall only (never on the wire): elements this rank sends to / receives from each rank.
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

// The wire form of a descriptor: 96 bytes. all_to_all's count vectors are
// not carried (they are O(N)); agreement.h checks them by a digest.
constexpr size_t kDescriptorBytes = 96;

void encodeDescriptor(const OpDescriptor& desc, int sender, int groupSize, uint8_t* out);
struct DecodedDescriptor {
  OpDescriptor desc;
  int sender = -1;
};
// Validates every field; throws ProtocolError naming the problem.
DecodedDescriptor decodeDescriptor(const uint8_t* data, size_t bytes, int groupSize);

// Whether two ranks' descriptors describe the same op (an equivalence: the
// fields that matter for the kind, compared for equality).
bool sameOp(const OpDescriptor& a, const OpDescriptor& b);
// The MismatchError text for rank `ra` calling `a` and rank `rb` calling `b`.
std::string mismatchMessage(const std::string& group, int ra, const OpDescriptor& a, int rb,
                            const OpDescriptor& b);
// The MismatchError text for rank `rank` rejecting its own arguments to `desc`.
std::string rejectionMessage(const std::string& group, int rank, const OpDescriptor& desc);

}  // namespace reccl
