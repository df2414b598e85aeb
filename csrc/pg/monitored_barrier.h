// Gloo's monitored barrier for reccl groups: rank 0 waits (bounded) for every
// other rank to arrive and names the ranks that did not; the others wait
// (bounded) for rank 0's release. It runs through the group's store, apart
// from the engine, so it works before the first collective, after a failed
// one, and while peers are stuck in one. Messages are Gloo's, so code that
// matches them (torch's tests, log scrapers) works unchanged.
//
// Store traffic per barrier: one key per arriving rank (rank 0 reads and
// deletes them) and one release key (deleted at the group's next barrier).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace reccl {

// The `generation`-th monitored barrier of the group (every member counts its
// own calls, so they agree). Throws c10::DistBackendError: on rank 0 naming
// the first rank that did not arrive within `timeout` (every such rank with
// `waitAllRanks`), on the others when rank 0 did not release them in time.
void monitoredBarrier(c10d::Store& store, uint64_t generation, int rank, int size,
                      std::chrono::milliseconds timeout, bool waitAllRanks);

}  // namespace reccl
