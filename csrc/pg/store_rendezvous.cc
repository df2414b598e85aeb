#include "pg/store_rendezvous.h"

#include "core/error.h"

#include <atomic>

namespace reccl {

namespace {
std::atomic<uint64_t> storeRequests{0};
}  // namespace

uint64_t StoreRendezvous::requests() { return storeRequests.load(); }

void StoreRendezvous::set(const std::string& key, const std::vector<uint8_t>& value) {
  storeRequests.fetch_add(1);
  store_->set(key, value);
}

namespace {
std::string firstLine(const char* what) {
  std::string s(what);
  return s.substr(0, s.find('\n'));
}
}  // namespace

std::vector<uint8_t> StoreRendezvous::get(const std::string& key, Millis timeout) {
  return getMany({key}, timeout).at(0);
}

void StoreRendezvous::setMany(const std::vector<std::string>& keys,
                              const std::vector<std::vector<uint8_t>>& values) {
  storeRequests.fetch_add(1);
  store_->multiSet(keys, values);
}

std::vector<std::vector<uint8_t>> StoreRendezvous::getMany(const std::vector<std::string>& keys,
                                                           Millis timeout) {
  if (keys.empty()) return {};
  // A store's multiGet waits for its keys by itself, bounded by the store's
  // timeout. Within our bound that is all it takes: a store whose bound is
  // shorter (torch gives a new group's store init_process_group's timeout,
  // the group often a longer one) is asked again until ours has passed (the
  // last ask may end up to one store bound later). Only a store whose bound is
  // longer than ours, or that has none, gets a wait of our own first, a second
  // round trip to the store host.
  const Clock::time_point deadline = Clock::now() + timeout;
  const std::chrono::milliseconds storeBound = store_->getTimeout();
  const bool ownWait = storeBound == c10d::Store::kNoTimeout || storeBound > timeout;
  try {
    if (ownWait) {
      storeRequests.fetch_add(1);
      store_->wait(keys, timeout);
    }
    for (;;) {
      storeRequests.fetch_add(1);
      try {
        return store_->multiGet(keys);
      } catch (const c10::DistStoreError&) {
        // The store's bound passed; ours may not have. Keys that are all
        // there mean another failure: rethrown below.
        if (ownWait || Clock::now() >= deadline) throw;
        bool present = true;
        for (const auto& key : keys) present = present && store_->check({key});
        if (present) throw;
      }
    }
  } catch (const std::exception& e) {
    std::string missing;
    for (const auto& key : keys) {
      if (!store_->check({key})) missing += (missing.empty() ? "'" : ", '") + key + "'";
    }
    // Keys that are all there: the store failed otherwise (its host gone, say).
    if (missing.empty()) throw;
    throw TimeoutError("reccl rendezvous: " + missing + " did not appear in the store within " +
                       std::to_string(timeout.count()) +
                       " ms (did every rank create the group?): " + firstLine(e.what()));
  }
}

void StoreRendezvous::erase(const std::string& key) {
  storeRequests.fetch_add(1);
  store_->deleteKey(key);
}

int64_t StoreRendezvous::add(const std::string& key, int64_t delta) {
  storeRequests.fetch_add(1);
  return store_->add(key, delta);
}

}  // namespace reccl
