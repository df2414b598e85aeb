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
  storeRequests.fetch_add(2);  // wait, then multiGet
  try {
    store_->wait(keys, timeout);
  } catch (const std::exception& e) {
    std::string missing;
    for (const auto& key : keys) {
      if (!store_->check({key})) missing += (missing.empty() ? "'" : ", '") + key + "'";
    }
    throw TimeoutError("reccl rendezvous: " + (missing.empty() ? std::string("keys") : missing) +
                       " did not appear in the store within " + std::to_string(timeout.count()) +
                       " ms (did every rank create the group?): " + firstLine(e.what()));
  }
  return store_->multiGet(keys);
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
