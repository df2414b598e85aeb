#include "engine/descriptor.h"

#include <cstring>
#include <sstream>

namespace reccl {

namespace {

constexpr uint32_t kDescriptorMagic = 0x44434552;  // "RECD" little-endian
constexpr uint8_t kDescriptorVersion = 4;

#pragma pack(push, 1)
struct WireDescriptor {
  uint32_t magic;
  uint8_t version;
  uint8_t kind;
  uint8_t dtype;
  uint8_t op;
  int32_t root;
  int32_t sender;
  uint64_t seq;
  uint64_t count;
  uint64_t planId;
  uint32_t groupSize;
  int32_t rejectIndex;
  int64_t rejectGot;
  uint64_t chunkBytes;
  uint32_t channels;
  uint8_t algorithm;
  uint8_t rejectReason;
  char rejectArgument[Rejection::kMaxArgumentName];  // not NUL-terminated when full
  int64_t rejectWant;
};
#pragma pack(pop)
static_assert(sizeof(WireDescriptor) == kDescriptorBytes, "descriptor header is 96 bytes");

bool hasRoot(OpKind kind) {
  return kind == OpKind::kBroadcast || kind == OpKind::kReduce || kind == OpKind::kGather ||
         kind == OpKind::kScatter;
}
bool hasOp(OpKind kind) {
  return kind == OpKind::kAllreduce || kind == OpKind::kReduce || kind == OpKind::kReduceScatter;
}
bool hasCount(OpKind kind) { return kind != OpKind::kAlltoall && kind != OpKind::kBarrier; }

bool validKind(uint8_t raw) {
  return raw >= static_cast<uint8_t>(OpKind::kAllreduce) &&
         raw <= static_cast<uint8_t>(OpKind::kBarrier);
}

bool validArgumentName(const std::string& name) {
  if (name.empty() || name.size() > Rejection::kMaxArgumentName) return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || c == '_')) return false;
  }
  return true;
}

}  // namespace

std::string Rejection::describe(DataType dtype) const {
  const std::string at = index >= 0 ? argument + "[" + std::to_string(index) + "]" : argument;
  const std::string g = std::to_string(got), w = std::to_string(want);
  switch (reason) {
    case Reason::kNone: break;
    case Reason::kListLength:
      return argument + " has " + g + (got == 1 ? " entry" : " entries") + ", expected " + w;
    case Reason::kElementCount: return at + " has " + g + " elements, expected " + w;
    case Reason::kDtype: return at + " has a dtype other than the op's " + dataTypeName(dtype);
    case Reason::kNotRoot:
      return argument + " (" + g + " tensors) was given on a rank that is not the root";
    case Reason::kSplitSizes:
      return argument + " add up to " + g + ", not to the tensor's " + w +
             " rows along dim 0 (they must be non-negative and add up to them)";
    case Reason::kIndivisible:
      return argument + " has " + g + " elements, which do not divide evenly over " + w +
             " ranks (give split sizes)";
  }
  return "no rejection";
}

const char* opKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllreduce: return "all_reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllgather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kAlltoall: return "all_to_all";
    case OpKind::kBarrier: return "barrier";
  }
  return "collective(?)";
}

std::string OpDescriptor::describe() const {
  std::ostringstream out;
  out << opKindName(kind) << "(";
  if (kind == OpKind::kBarrier) {
    out << ")";
    return out.str();
  }
  out << dataTypeName(dtype);
  if (hasCount(kind)) out << ", " << count << (count == 1 ? " element" : " elements");
  if (kind == OpKind::kAlltoall)
    out << ", sends " << count << (count == 1 ? " element" : " elements");
  if (hasOp(kind)) out << ", op=" << reduceOpName(op);
  if (hasRoot(kind)) out << ", root=" << root;
  out << ")";
  return out.str();
}

void encodeDescriptor(const OpDescriptor& desc, int sender, int groupSize, uint8_t* out) {
  WireDescriptor wire{};
  wire.magic = kDescriptorMagic;
  wire.version = kDescriptorVersion;
  wire.kind = static_cast<uint8_t>(desc.kind);
  wire.dtype = static_cast<uint8_t>(desc.dtype);
  wire.op = static_cast<uint8_t>(desc.op);
  wire.root = desc.root;
  wire.sender = sender;
  wire.seq = desc.seq;
  wire.count = desc.count;
  wire.planId = desc.planId;
  wire.groupSize = static_cast<uint32_t>(groupSize);
  wire.chunkBytes = desc.chunkBytes;
  wire.channels = desc.channels;
  wire.algorithm = desc.algorithm;
  if (desc.rejection) {
    if (!validArgumentName(desc.rejection.argument)) {
      throw Error("internal: rejection names argument '" + desc.rejection.argument +
                  "' ([a-z_], 1 to 18 characters)");
    }
    wire.rejectReason = static_cast<uint8_t>(desc.rejection.reason);
    const std::string& name = desc.rejection.argument;
    std::memcpy(wire.rejectArgument, name.data(), name.size());
    wire.rejectIndex = desc.rejection.index;
    wire.rejectGot = desc.rejection.got;
    wire.rejectWant = desc.rejection.want;
  }
  std::memcpy(out, &wire, sizeof(wire));
}

DecodedDescriptor decodeDescriptor(const uint8_t* data, size_t bytes, int groupSize) {
  if (bytes < sizeof(WireDescriptor)) {
    throw ProtocolError("collective descriptor of " + std::to_string(bytes) +
                        " bytes is shorter than its " + std::to_string(kDescriptorBytes) +
                        "-byte header");
  }
  WireDescriptor wire;
  std::memcpy(&wire, data, sizeof(wire));
  if (wire.magic != kDescriptorMagic || wire.version != kDescriptorVersion) {
    throw ProtocolError(
        "not a collective descriptor (bad magic or version); the peer is "
        "out of step or runs another reccl version");
  }
  if (!validKind(wire.kind) || !isValidDataType(wire.dtype) || !isValidReduceOp(wire.op)) {
    throw ProtocolError("collective descriptor names an unknown kind, dtype or reduce op");
  }
  if (wire.groupSize != static_cast<uint32_t>(groupSize) || wire.sender < 0 ||
      wire.sender >= groupSize) {
    throw ProtocolError("collective descriptor from a group of " + std::to_string(wire.groupSize) +
                        " ranks (sender " + std::to_string(wire.sender) + "); this group has " +
                        std::to_string(groupSize));
  }
  DecodedDescriptor out;
  out.sender = wire.sender;
  OpDescriptor& desc = out.desc;
  desc.seq = wire.seq;
  desc.kind = static_cast<OpKind>(wire.kind);
  desc.dtype = static_cast<DataType>(wire.dtype);
  desc.op = static_cast<ReduceOp>(wire.op);
  desc.root = wire.root;
  desc.count = wire.count;
  desc.planId = wire.planId;
  desc.chunkBytes = wire.chunkBytes;
  desc.channels = wire.channels;
  desc.algorithm = wire.algorithm;
  if (wire.rejectReason > static_cast<uint8_t>(Rejection::Reason::kIndivisible)) {
    throw ProtocolError("collective descriptor names an unknown rejection reason " +
                        std::to_string(wire.rejectReason));
  }
  desc.rejection.reason = static_cast<Rejection::Reason>(wire.rejectReason);
  if (desc.rejection) {
    desc.rejection.argument.assign(wire.rejectArgument,
                                   strnlen(wire.rejectArgument, sizeof(wire.rejectArgument)));
    if (!validArgumentName(desc.rejection.argument)) {
      throw ProtocolError("collective descriptor's rejection names no valid argument");
    }
    desc.rejection.index = wire.rejectIndex;
    desc.rejection.got = wire.rejectGot;
    desc.rejection.want = wire.rejectWant;
  }
  return out;
}

bool sameOp(const OpDescriptor& a, const OpDescriptor& b) {
  if (a.seq != b.seq || a.kind != b.kind || !(a.rejection == b.rejection)) return false;
  if (a.kind == OpKind::kBarrier) return true;
  return a.dtype == b.dtype && a.planId == b.planId && a.chunkBytes == b.chunkBytes &&
         a.channels == b.channels && a.algorithm == b.algorithm &&
         (!hasCount(a.kind) || a.count == b.count) && (!hasRoot(a.kind) || a.root == b.root) &&
         (!hasOp(a.kind) || a.op == b.op);
}

std::string mismatchMessage(const std::string& group, int ra, const OpDescriptor& a, int rb,
                            const OpDescriptor& b) {
  const std::string A = "rank " + std::to_string(ra), B = "rank " + std::to_string(rb);
  std::string extra;
  if (a.seq != b.seq) {
    extra = " (" + A + " is at op #" + std::to_string(a.seq) + ", " + B + " at op #" +
            std::to_string(b.seq) + ")";
  } else if (a.kind != OpKind::kBarrier && a.kind == b.kind &&
             (a.chunkBytes != b.chunkBytes || a.channels != b.channels)) {
    extra = " (" + A + " uses " + std::to_string(a.channels) + " channels of " +
            std::to_string(a.chunkBytes) + "-byte chunks, " + B + " uses " +
            std::to_string(b.channels) + " of " + std::to_string(b.chunkBytes) +
            "; the backend options must be the same on every rank)";
  } else if (a.kind == b.kind && a.algorithm != b.algorithm) {
    extra =
        " (they chose different algorithms: RECCL_SMALL_BYTES and RECCL_ALGO must be the same on "
        "every rank)";
  } else if (a.kind == b.kind && a.planId != b.planId) {
    extra = " (channel plans " + std::to_string(a.planId) + " and " + std::to_string(b.planId) +
            " differ)";
  }
  return "reccl: collective mismatch in process group '" + group + "' at op #" +
         std::to_string(a.seq) + ": " + A + " called " + a.describe() + " but " + B + " called " +
         b.describe() + extra +
         ". Every rank of a group must call the same collectives in the same order with matching "
         "dtype, size, root and reduce op.";
}

std::string rejectionMessage(const std::string& group, int rank, const OpDescriptor& desc) {
  return "reccl: invalid arguments in process group '" + group + "' at op #" +
         std::to_string(desc.seq) + ": rank " + std::to_string(rank) + " called " +
         desc.describe() + " but its " + desc.rejection.describe(desc.dtype) +
         ". Every rank fails this op at once; the group stays usable.";
}

}  // namespace reccl
