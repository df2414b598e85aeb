#include "pg/monitored_barrier.h"

#include <algorithm>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace reccl {

namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

std::string keyOf(uint64_t generation, const std::string& what) {
  return "reccl/monitored_barrier/" + std::to_string(generation) + "/" + what;
}

// Waits up to `bound` for `key`; false past it. Store::wait takes 0 as "no
// timeout", so a spent bound only checks. Stores differ in what they throw on a
// timeout (TCPStore DistStoreError, FileStore a plain c10::Error): the check
// after it tells a timeout (false) from a broken store (it throws again).
bool arrivedWithin(c10d::Store& store, const std::string& key, milliseconds bound) {
  if (bound.count() <= 0) return store.check({key});
  try {
    store.wait({key}, bound);
    return true;
  } catch (const c10::Error&) {
    return store.check({key});
  }
}

}  // namespace

void monitoredBarrier(c10d::Store& store, uint64_t generation, int rank, int size,
                      milliseconds timeout, bool waitAllRanks) {
  const std::string released = keyOf(generation, "released");
  if (rank != 0) {
    store.set(keyOf(generation, "arrived/" + std::to_string(rank)), std::vector<uint8_t>{1});
    if (!arrivedWithin(store, released, std::max(timeout, milliseconds(1)))) {
      C10_THROW_ERROR(DistBackendError,
                      c10::str("Rank ", rank,
                               " successfully reached monitoredBarrier, but received errors while "
                               "waiting for send/recv from rank 0. Please check rank 0 logs for "
                               "faulty rank. (reccl: rank 0 did not release the barrier within ",
                               timeout.count(), " ms)"));
    }
    return;
  }
  const auto deadline = Clock::now() + timeout;
  std::vector<int> failed, passed;
  for (int r = 1; r < size; ++r) {
    const auto remaining = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (!waitAllRanks && remaining.count() <= 0) {
      C10_THROW_ERROR(DistBackendError,
                      c10::str("Rank 0 timed out in monitoredBarrier after ", timeout.count(),
                               " ms. Successfully passed ranks: [", c10::Join(", ", passed),
                               "]; not checked yet: ranks ", r, " to ", size - 1));
    }
    const std::string arrived = keyOf(generation, "arrived/" + std::to_string(r));
    if (!arrivedWithin(store, arrived, remaining)) {
      if (!waitAllRanks) {
        C10_THROW_ERROR(DistBackendError,
                        c10::str("[Rank 0]: Rank ", r, " failed to pass monitoredBarrier in ",
                                 timeout.count(), " ms"));
      }
      failed.push_back(r);
      continue;
    }
    store.deleteKey(arrived);
    passed.push_back(r);
  }
  if (!failed.empty()) {
    C10_THROW_ERROR(DistBackendError,
                    c10::str("[Rank 0]: Ranks ", c10::Join(", ", failed),
                             " failed to pass monitoredBarrier in ", timeout.count(), " ms"));
  }
  store.set(released, std::vector<uint8_t>{1});
  // Every rank has read the previous release key: they all arrived here.
  if (generation > 1) store.deleteKey(keyOf(generation - 1, "released"));
}

}  // namespace reccl
