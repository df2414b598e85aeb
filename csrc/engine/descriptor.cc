#include "engine/descriptor.h"

#include <cstring>
#include <sstream>

namespace reccl {

namespace {

constexpr uint32_t kDescriptorMagic = 0x44434552;  // "RECD" little-endian
constexpr uint8_t kDescriptorVersion = 2;

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
  uint32_t countVectors;  // 1 when send/recv count vectors follow
  uint32_t inlineBytes;
  uint64_t chunkBytes;
  uint32_t channels;
  uint64_t proposalId;
  uint64_t proposalStartOp;
  uint64_t proposalAvoid;
  uint64_t reserved;
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

}  // namespace

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
  if (kind == OpKind::kAlltoall) {
    uint64_t sent = 0, received = 0;
    for (uint64_t c : sendCounts) sent += c;
    for (uint64_t c : recvCounts) received += c;
    out << ", sends " << sent << ", receives " << received << " elements";
  }
  if (hasOp(kind)) out << ", op=" << reduceOpName(op);
  if (hasRoot(kind)) out << ", root=" << root;
  out << ")";
  return out.str();
}

size_t descriptorMessageBytes(const OpDescriptor& desc, int groupSize, uint32_t inlineBytes) {
  size_t vectors = desc.kind == OpKind::kAlltoall ? 2 * sizeof(uint64_t) * groupSize : 0;
  return kDescriptorBytes + vectors + inlineBytes;
}

size_t encodeDescriptor(const OpDescriptor& desc, int sender, int groupSize,
                        uint32_t inlineBytes, uint8_t* out) {
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
  wire.countVectors = desc.kind == OpKind::kAlltoall ? 1 : 0;
  wire.inlineBytes = inlineBytes;
  wire.chunkBytes = desc.chunkBytes;
  wire.channels = desc.channels;
  wire.proposalId = desc.proposal.id;
  wire.proposalStartOp = desc.proposal.startOp;
  wire.proposalAvoid = desc.proposal.avoidMask;
  std::memcpy(out, &wire, sizeof(wire));
  size_t offset = sizeof(wire);
  if (wire.countVectors) {
    if (desc.sendCounts.size() != static_cast<size_t>(groupSize) ||
        desc.recvCounts.size() != static_cast<size_t>(groupSize)) {
      throw ConfigError("all_to_all needs one send and one receive count per rank");
    }
    std::memcpy(out + offset, desc.sendCounts.data(), sizeof(uint64_t) * groupSize);
    offset += sizeof(uint64_t) * groupSize;
    std::memcpy(out + offset, desc.recvCounts.data(), sizeof(uint64_t) * groupSize);
    offset += sizeof(uint64_t) * groupSize;
  }
  return offset;  // the caller appends the inline payload
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
    throw ProtocolError("not a collective descriptor (bad magic or version); the peer is "
                        "out of step or runs another reccl version");
  }
  if (!validKind(wire.kind) || !isValidDataType(wire.dtype) || !isValidReduceOp(wire.op)) {
    throw ProtocolError("collective descriptor names an unknown kind, dtype or reduce op");
  }
  if (wire.groupSize != static_cast<uint32_t>(groupSize) || wire.sender < 0 ||
      wire.sender >= groupSize) {
    throw ProtocolError("collective descriptor from a group of " +
                        std::to_string(wire.groupSize) + " ranks (sender " +
                        std::to_string(wire.sender) + "); this group has " +
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
  desc.proposal = PlanProposal{wire.proposalId, wire.proposalStartOp, wire.proposalAvoid};
  size_t offset = sizeof(wire);
  if (wire.countVectors) {
    size_t vectorBytes = sizeof(uint64_t) * groupSize;
    if (bytes < offset + 2 * vectorBytes) {
      throw ProtocolError("collective descriptor too short for its count vectors");
    }
    desc.sendCounts.resize(groupSize);
    desc.recvCounts.resize(groupSize);
    std::memcpy(desc.sendCounts.data(), data + offset, vectorBytes);
    offset += vectorBytes;
    std::memcpy(desc.recvCounts.data(), data + offset, vectorBytes);
    offset += vectorBytes;
  }
  if (bytes != offset + wire.inlineBytes) {
    throw ProtocolError("collective descriptor announces " + std::to_string(wire.inlineBytes) +
                        " inline bytes but carries " + std::to_string(bytes - offset));
  }
  out.payload = data + offset;
  out.payloadBytes = wire.inlineBytes;
  return out;
}

void checkConsistent(const std::vector<OpDescriptor>& byRank, const std::string& group) {
  const int size = static_cast<int>(byRank.size());
  if (size == 0) return;
  const OpDescriptor& first = byRank[0];
  auto fail = [&](const std::string& what) {
    throw MismatchError("reccl: collective mismatch in process group '" + group + "' at op #" +
                        std::to_string(first.seq) + ": " + what +
                        ". Every rank of a group must call the same collectives in the same "
                        "order with matching dtype, size, root and reduce op.");
  };
  for (int r = 1; r < size; ++r) {
    const OpDescriptor& d = byRank[r];
    bool same = d.seq == first.seq && d.kind == first.kind;
    if (same && first.kind != OpKind::kBarrier) {
      same = d.dtype == first.dtype && d.planId == first.planId &&
             d.chunkBytes == first.chunkBytes && d.channels == first.channels &&
             (!hasCount(first.kind) || d.count == first.count) &&
             (!hasRoot(first.kind) || d.root == first.root) &&
             (!hasOp(first.kind) || d.op == first.op);
    }
    if (!same) {
      std::string extra;
      if (d.seq != first.seq) {
        extra = " (rank 0 is at op #" + std::to_string(first.seq) + ", rank " +
                std::to_string(r) + " at op #" + std::to_string(d.seq) + ")";
      } else if (d.chunkBytes != first.chunkBytes || d.channels != first.channels) {
        extra = " (rank 0 uses " + std::to_string(first.channels) + " channels of " +
                std::to_string(first.chunkBytes) + "-byte chunks, rank " + std::to_string(r) +
                " uses " + std::to_string(d.channels) + " of " + std::to_string(d.chunkBytes) +
                "; the backend options must be the same on every rank)";
      } else if (d.planId != first.planId) {
        extra = " (channel plans " + std::to_string(first.planId) + " and " +
                std::to_string(d.planId) + " differ)";
      }
      fail("rank 0 called " + first.describe() + " but rank " + std::to_string(r) + " called " +
           d.describe() + extra);
    }
  }
  if (first.kind == OpKind::kAlltoall) {
    for (int s = 0; s < size; ++s) {
      for (int d = 0; d < size; ++d) {
        uint64_t sent = byRank[s].sendCounts.at(d);
        uint64_t expected = byRank[d].recvCounts.at(s);
        if (sent != expected) {
          fail("in " + std::string(opKindName(first.kind)) + "(" + dataTypeName(first.dtype) +
               ") rank " + std::to_string(s) + " sends " + std::to_string(sent) +
               " elements to rank " + std::to_string(d) + " but rank " + std::to_string(d) +
               " expects " + std::to_string(expected) + " from rank " + std::to_string(s));
        }
      }
    }
  }
}

}  // namespace reccl
