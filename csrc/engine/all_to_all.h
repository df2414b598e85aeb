// all_to_all: every rank sends its own block to every other rank. Always by
// the channels (its count vectors are O(N), so no recursive doubling): per
// channel, direct transfers with every peer. The agreement checks the counts
// by a 64-bit digest; only when it does not add up do the pairs compare them.
#pragma once

#include <cstdint>
#include <vector>

#include "core/clock.h"
#include "engine/communicator.h"
#include "engine/data_type.h"

namespace reccl {

// Counts and offsets in elements, one per rank: this rank sends
// sendCounts[p] elements from in + sendOffsets[p] to rank p and receives
// recvCounts[p] from it into out + recvOffsets[p].
void alltoall(Communicator& comm, const void* in, const std::vector<uint64_t>& sendCounts,
              const std::vector<uint64_t>& sendOffsets, void* out,
              const std::vector<uint64_t>& recvCounts, const std::vector<uint64_t>& recvOffsets,
              DataType dtype, Millis timeout);

}  // namespace reccl
