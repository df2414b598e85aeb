#include "pg/store_rendezvous.h"

#include "core/error.h"

namespace reccl {

void StoreRendezvous::set(const std::string& key, const std::vector<uint8_t>& value) {
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
  store_->multiSet(keys, values);
}

std::vector<std::vector<uint8_t>> StoreRendezvous::getMany(const std::vector<std::string>& keys,
                                                           Millis timeout) {
  if (keys.empty()) return {};
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

std::unique_ptr<Rendezvous> StoreRendezvous::sideChannel() {
  c10::intrusive_ptr<c10d::Store> own;
  try {
    own = store_->clone();  // TCPStore: a new client connection
  } catch (const std::exception&) {
    own = store_;  // stores that cannot clone (in-process ones) are shared
  }
  return std::make_unique<StoreRendezvous>(own ? own : store_);
}

int64_t StoreRendezvous::add(const std::string& key, int64_t delta) { return store_->add(key, delta); }

}  // namespace reccl
