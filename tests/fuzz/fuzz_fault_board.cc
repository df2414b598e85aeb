// Fuzzes the fault board's store contents (pg/fault_record.h): a process's
// record and the job's transition log, which any process with the store can
// write. The first input byte picks which (even: record, odd: log), the rest is
// the value. Properties: only ProtocolError escapes; an accepted record has a
// rank >= 0 and re-encodes to bytes that decode to the same record (the reserved
// word aside, the input itself); an accepted log names no negative rank, and
// the log made of those ranks' entries parses to the same ranks.
#include <set>
#include <vector>

#include "core/error.h"
#include "fuzz_check.h"
#include "pg/fault_record.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::vector<uint8_t> value(data + 1, data + size);
  if ((data[0] & 1) == 0) {
    reccl::BoardRecord record;
    try {
      record = reccl::decodeBoardRecord(value);
    } catch (const reccl::ProtocolError&) {
      return 0;
    }
    FUZZ_CHECK(record.rank >= 0);
    const std::vector<uint8_t> encoded = reccl::encodeBoardRecord(record);
    FUZZ_CHECK(encoded.size() == value.size());
    for (size_t i = 0; i < value.size(); ++i) {
      const bool reserved = i >= 12 && i < 16;  // WireRecord::reserved: ignored, written as 0
      FUZZ_CHECK(encoded[i] == (reserved ? 0 : value[i]));
    }
    return 0;
  }
  std::set<int> ranks;
  try {
    ranks = reccl::parseBoardLog(value);
  } catch (const reccl::ProtocolError&) {
    return 0;
  }
  std::vector<uint8_t> rebuilt;
  for (int rank : ranks) {
    FUZZ_CHECK(rank >= 0);
    const std::vector<uint8_t> entry = reccl::boardLogEntry(rank);
    rebuilt.insert(rebuilt.end(), entry.begin(), entry.end());
  }
  try {
    FUZZ_CHECK(reccl::parseBoardLog(rebuilt) == ranks);
  } catch (const reccl::ProtocolError& error) {
    std::fprintf(stderr, "a log of boardLogEntry entries was refused: %s\n", error.what());
    std::abort();
  }
  return 0;
}
