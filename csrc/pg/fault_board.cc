#include "pg/fault_board.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "core/clock.h"
#include "core/health.h"
#include "core/log.h"
#include "core/thread_name.h"

namespace reccl {

namespace {

constexpr Millis kStopBound(2000);      // destruction never waits longer for the thread
constexpr Millis kMaxRetryDelay(5000);  // a store that does not answer: retry this rarely at most
const char* const kLogKey = "reccl/board/log";
std::atomic<uint64_t> boardRequests{0};

std::string recordKey(int rank) { return "reccl/board/" + std::to_string(rank); }

uint64_t localNicsDown() {
  NicHealth& health = NicHealth::instance();
  uint64_t mask = 0;
  const size_t count = std::min<size_t>(health.names().size(), 64);
  for (size_t id = 0; id < count; ++id) {
    if (!health.usable(static_cast<int>(id))) mask |= uint64_t{1} << id;
  }
  return mask;
}

// The NICs with a grey-failure verdict (degraded, or on trial after one).
uint64_t localNicsSlow() {
  NicHealth& health = NicHealth::instance();
  uint64_t mask = 0;
  const size_t count = std::min<size_t>(health.names().size(), 64);
  for (size_t id = 0; id < count; ++id) {
    if (health.grey(static_cast<int>(id)) != GreyState::kHealthy) mask |= uint64_t{1} << id;
  }
  return mask;
}

// The store below every group prefix.
c10::intrusive_ptr<c10d::Store> jobStore(const c10::intrusive_ptr<c10d::Store>& store) {
  if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get())) {
    return prefixed->getUnderlyingNonPrefixStore();
  }
  return store;
}

}  // namespace

struct FaultBoard::Shared {
  std::mutex mutex;
  std::condition_variable wake;
  std::condition_variable exited;
  bool stopping = false;
  bool poked = true;  // publish once at start if a NIC is already down
  bool done = false;
  c10::intrusive_ptr<c10d::Store> jobStore;  // the caller's connection: never used directly
  c10::intrusive_ptr<c10d::Store> own;  // ours, made on first use (connection())
  std::mutex ownMutex;
  int rank = 0;

  // A connection of our own, so the board never queues behind (or holds up)
  // the caller's store calls; made only when there is something to say or
  // read, so a healthy job that never asks opens no extra connection.
  c10d::Store& connection() {
    std::lock_guard<std::mutex> lock(ownMutex);
    if (!own) {
      try {
        own = jobStore->clone();
      } catch (const std::exception&) {
        // in-process stores cannot clone: share it
      }
      if (!own) own = jobStore;
    }
    return *own;
  }
  Millis period{1000};
  std::map<uint64_t, std::function<uint64_t()>> counters;
  uint64_t nextToken = 1;
};

std::shared_ptr<FaultBoard> FaultBoard::join(const c10::intrusive_ptr<c10d::Store>& store,
                                             int globalRank, int periodMs) {
  static std::mutex mutex;
  static std::weak_ptr<FaultBoard> current;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto board = current.lock()) return board;
  std::shared_ptr<FaultBoard> board(new FaultBoard(jobStore(store), globalRank, periodMs));
  current = board;
  return board;
}

FaultBoard::FaultBoard(c10::intrusive_ptr<c10d::Store> store, int globalRank, int periodMs)
    : globalRank_(globalRank), shared_(std::make_shared<Shared>()) {
  shared_->jobStore = std::move(store);
  shared_->rank = globalRank;
  shared_->period = Millis(periodMs);
  std::weak_ptr<Shared> weak = shared_;
  healthToken_ = NicHealth::instance().addListener([weak](const std::string&, bool, Reason) {
    if (auto shared = weak.lock()) {
      std::lock_guard<std::mutex> lock(shared->mutex);
      shared->poked = true;
      shared->wake.notify_all();
    }
  });
  std::thread(&FaultBoard::loop, shared_).detach();
}

FaultBoard::~FaultBoard() {
  NicHealth::instance().removeListener(healthToken_);
  std::unique_lock<std::mutex> lock(shared_->mutex);
  shared_->stopping = true;
  shared_->wake.notify_all();
  // Bounded: a store call that never returns keeps only the shared state.
  shared_->exited.wait_for(lock, kStopBound, [&] { return shared_->done; });
}

void FaultBoard::loop(std::shared_ptr<Shared> s) {
  nameThisThread("reccl-board");
  bool degradedPublished = false;  // the store says we are degraded
  bool warned = false;
  Millis retryDelay(0);
  std::unique_lock<std::mutex> lock(s->mutex);
  for (;;) {
    auto due = [&] { return s->stopping || s->poked; };
    if (retryDelay.count() > 0) {
      s->wake.wait_for(lock, retryDelay, [&] { return s->stopping; });
    } else if (degradedPublished) {
      s->wake.wait_for(lock, s->period, due);  // the slow beat, only while degraded
    } else {
      s->wake.wait(lock, due);  // healthy: no wake-up until a NIC changes
    }
    if (s->stopping) break;
    s->poked = false;
    uint64_t deviceOps = 0;
    for (const auto& [token, counter] : s->counters) deviceOps += counter();
    lock.unlock();
    const uint64_t nicsDown = localNicsDown();
    const uint64_t nicsSlow = localNicsSlow();
    const bool degraded = nicsDown != 0 || nicsSlow != 0;
    bool ok = true;
    if (degraded || degradedPublished) {
      BoardRecord record{s->rank, nicsDown, deviceOps, wallNs(), nicsSlow};
      try {
        s->connection().set(recordKey(s->rank), encodeBoardRecord(record));
        boardRequests.fetch_add(1);
        if (degraded != degradedPublished) {
          s->connection().append(kLogKey, boardLogEntry(s->rank));
          boardRequests.fetch_add(1);
        }
        degradedPublished = degraded;
        if (warned) RECCL_LOG(kInfo, "reccl: the job's store answers again; fault state published");
        warned = false;
        retryDelay = Millis(0);
      } catch (const std::exception& e) {
        ok = false;
        if (!warned) {
          std::string why = e.what();
          RECCL_LOG(kWarn, "reccl: rank " + std::to_string(s->rank) +
                               " could not publish its fault state to the job's store (" +
                               why.substr(0, why.find('\n')) +
                               "); the job-wide fault picture misses it until the store answers "
                               "again; retrying quietly");
          warned = true;
        }
        retryDelay = std::min(kMaxRetryDelay, std::max(Millis(100), retryDelay * 2));
      }
    }
    lock.lock();
    if (!ok) s->poked = true;
  }
  s->done = true;
  s->exited.notify_all();
}

uint64_t FaultBoard::addDeviceOps(std::function<uint64_t()> counter) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  const uint64_t token = shared_->nextToken++;
  shared_->counters[token] = std::move(counter);
  return token;
}

void FaultBoard::removeDeviceOps(uint64_t token) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->counters.erase(token);
}

uint64_t FaultBoard::storeRequests() { return boardRequests.load(); }

std::vector<BoardRecord> FaultBoard::degraded() {
  c10d::Store& store = shared_->connection();
  boardRequests.fetch_add(1);
  if (!store.check({kLogKey})) return {};
  boardRequests.fetch_add(1);
  const std::vector<uint8_t> log = store.get(kLogKey);
  const std::set<int> ranks = parseBoardLog(log);
  if (ranks.empty()) return {};
  std::vector<std::string> keys;
  for (int r : ranks) keys.push_back(recordKey(r));
  boardRequests.fetch_add(1);
  std::vector<std::vector<uint8_t>> raw = store.multiGet(keys);
  std::vector<BoardRecord> out;
  for (const auto& bytes : raw) {
    BoardRecord record = decodeBoardRecord(bytes);
    if (record.nicsDown != 0 || record.nicsSlow != 0) out.push_back(record);
  }
  return out;
}

}  // namespace reccl
