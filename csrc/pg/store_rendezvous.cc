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
  // timeout: a wait of our own first is a second round trip to the store host
  // for nothing when that bound is ours anyway (the usual case: torch gives
  // the store the group's timeout). Only a store with another bound gets one.
  const bool ownWait = store_->getTimeout() != timeout;
  storeRequests.fetch_add(ownWait ? 2 : 1);
  try {
    if (ownWait) store_->wait(keys, timeout);
    return store_->multiGet(keys);
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
