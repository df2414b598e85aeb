// The bytes of the job's fault board (pg/fault_board.h) as they sit in the
// store: one process's record and the log of healthy <-> degraded transitions.
// Anything in the store may have been written by anyone, so decoding checks
// every byte. Torch-free, so tests/fuzz builds it on its own.
#pragma once

#include <cstdint>
#include <set>
#include <vector>

namespace reccl {

struct BoardRecord {
  int rank = -1;           // global rank
  uint64_t nicsDown = 0;   // bit n: NIC n (health-table order) is down
  uint64_t deviceOps = 0;  // NCCL collectives issued by the process's reccl groups
  int64_t wallNs = 0;      // when it was published
  uint64_t nicsSlow = 0;   // bit n: NIC n is degraded by a grey failure (also in nicsDown
                          // while it carries no traffic; not while on trial)
};

std::vector<uint8_t> encodeBoardRecord(const BoardRecord& record);
// Throws ProtocolError for a size, magic, version or rank that is wrong.
BoardRecord decodeBoardRecord(const std::vector<uint8_t>& bytes);

// The log entry a process appends at each transition: "<global rank>,".
std::vector<uint8_t> boardLogEntry(int rank);
// The ranks the log's complete entries name (a last one may lack its comma: not
// counted); throws ProtocolError for anything but boardLogEntry entries (ranks up
// to 2147483639).
std::set<int> parseBoardLog(const std::vector<uint8_t>& log);

}  // namespace reccl
