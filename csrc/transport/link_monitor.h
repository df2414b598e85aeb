// Watches kernel link state over rtnetlink and feeds the NIC health table, so
// an interface losing carrier fails every path on it within milliseconds.
#pragma once

#include <atomic>
#include <map>
#include <string>
#include <thread>

#include "transport/socket.h"

namespace reccl {

class LinkMonitor {
 public:
  // `watched`: kernel ifindex -> NicHealth id. Loopback is never watched.
  explicit LinkMonitor(std::map<int, int> watched);
  ~LinkMonitor();
  LinkMonitor(const LinkMonitor&) = delete;
  LinkMonitor& operator=(const LinkMonitor&) = delete;

 private:
  void run();
  void handle(const uint8_t* bytes, size_t length);

  const std::map<int, int> watched_;
  Fd socket_;
  Fd wake_;  // signalled by the destructor: the poll waits without a timeout
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace reccl
