#include "transport/link_monitor.h"

#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "core/health.h"
#include "core/log.h"
#include "core/thread_name.h"

namespace reccl {

LinkMonitor::LinkMonitor(std::map<int, int> watched) : watched_(std::move(watched)) {
  socket_ = Fd(::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC | SOCK_NONBLOCK, NETLINK_ROUTE));
  if (!socket_.valid()) {
    RECCL_LOG(kWarn, std::string("netlink unavailable (") + std::strerror(errno) +
                         "); link loss is detected by heartbeats only");
    return;
  }
  sockaddr_nl address{};
  address.nl_family = AF_NETLINK;
  address.nl_groups = RTMGRP_LINK;
  if (::bind(socket_.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    RECCL_LOG(kWarn, std::string("netlink bind failed (") + std::strerror(errno) +
                         "); link loss is detected by heartbeats only");
    socket_.reset();
    return;
  }
  wake_ = makeWakeFd();
  thread_ = std::thread([this] { run(); });
}

LinkMonitor::~LinkMonitor() {
  stop_.store(true);
  if (wake_.valid()) signalWake(wake_.get());
  if (thread_.joinable()) thread_.join();
}

void LinkMonitor::handle(const uint8_t* bytes, size_t length) {
  int remaining = static_cast<int>(length);
  for (auto* message = reinterpret_cast<const nlmsghdr*>(bytes); NLMSG_OK(message, remaining);
       message = NLMSG_NEXT(message, remaining)) {
    if (message->nlmsg_type != RTM_NEWLINK && message->nlmsg_type != RTM_DELLINK) continue;
    if (message->nlmsg_len < NLMSG_LENGTH(sizeof(ifinfomsg))) continue;
    const auto* info = static_cast<const ifinfomsg*>(NLMSG_DATA(message));
    auto it = watched_.find(info->ifi_index);
    if (it == watched_.end()) continue;
    bool up = message->nlmsg_type == RTM_NEWLINK && (info->ifi_flags & IFF_UP) &&
              (info->ifi_flags & IFF_RUNNING);
    NicHealth::instance().setLinkUp(it->second, up, up ? Reason::kLinkUp : Reason::kLinkDown);
  }
}

void LinkMonitor::run() {
  nameThisThread("reccl-linkmon");
  std::vector<uint8_t> buffer(64 << 10);
  while (!stop_.load()) {
    pollfd fds[2] = {{socket_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) <= 0 || !(fds[0].revents & POLLIN)) continue;
    for (;;) {
      ssize_t got = ::recv(socket_.get(), buffer.data(), buffer.size(), MSG_DONTWAIT);
      if (got <= 0) break;
      handle(buffer.data(), static_cast<size_t>(got));
    }
  }
}

}  // namespace reccl
