#include "pg/fault_record.h"

#include <cstring>
#include <string>

#include "core/error.h"

namespace reccl {

namespace {

constexpr uint32_t kRecordMagic = 0x42434552;  // "RECB" little-endian
constexpr uint32_t kRecordVersion = 2;         // 2: nicsSlow

#pragma pack(push, 1)
struct WireRecord {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  uint32_t reserved;
  uint64_t nicsDown;
  uint64_t deviceOps;
  int64_t wallNs;
  uint64_t nicsSlow;
};
#pragma pack(pop)
static_assert(sizeof(WireRecord) == 48, "board record size in the store");

}  // namespace

std::vector<uint8_t> encodeBoardRecord(const BoardRecord& record) {
  WireRecord wire{kRecordMagic,    kRecordVersion,   record.rank,   0,
                  record.nicsDown, record.deviceOps, record.wallNs, record.nicsSlow};
  std::vector<uint8_t> out(sizeof(wire));
  std::memcpy(out.data(), &wire, sizeof(wire));
  return out;
}

BoardRecord decodeBoardRecord(const std::vector<uint8_t>& bytes) {
  WireRecord wire;
  if (bytes.size() != sizeof(wire)) {
    throw ProtocolError("a fault record of " + std::to_string(bytes.size()) + " bytes (expected " +
                        std::to_string(sizeof(wire)) + ")");
  }
  std::memcpy(&wire, bytes.data(), sizeof(wire));
  if (wire.magic != kRecordMagic || wire.version != kRecordVersion || wire.rank < 0) {
    throw ProtocolError("not a fault record (bad magic, version or rank)");
  }
  return BoardRecord{wire.rank, wire.nicsDown, wire.deviceOps, wire.wallNs, wire.nicsSlow};
}

std::vector<uint8_t> boardLogEntry(int rank) {
  const std::string entry = std::to_string(rank) + ",";
  return std::vector<uint8_t>(entry.begin(), entry.end());
}

std::set<int> parseBoardLog(const std::vector<uint8_t>& log) {
  std::set<int> ranks;
  int64_t value = -1;  // the digits of the entry so far; -1: none yet
  for (uint8_t c : log) {
    if (c == ',' && value >= 0) {
      ranks.insert(static_cast<int>(value));
      value = -1;
    } else if (c >= '0' && c <= '9' && value < (int64_t{1} << 31) / 10) {
      value = (value < 0 ? 0 : value * 10) + (c - '0');
    } else {
      throw ProtocolError("the job's fault log is malformed (" + std::to_string(log.size()) +
                          " bytes)");
    }
  }
  return ranks;
}

}  // namespace reccl
