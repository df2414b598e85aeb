#include "transport/same_host.h"

#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/topology.h"
#include "transport/random_bytes.h"

namespace reccl {

namespace {

uint64_t freshToken() {
  uint64_t token = 0;
  while (token == 0) randomBytes(reinterpret_cast<uint8_t*>(&token), sizeof(token));
  return token;
}

}  // namespace

uint64_t sameHostKey() {
  static const uint64_t key = [] {
    // The kernel's own identity (boot id, network namespace), never
    // RECCL_HOST_ID: only the kernel decides who can read whom. Plus the pid
    // namespace, in which the HELLO's pid is read.
    char pidNamespace[64] = {};
    if (::readlink("/proc/self/ns/pid", pidNamespace, sizeof(pidNamespace) - 1) <= 0) {
      return uint64_t{0};  // no /proc: no offers
    }
    const uint64_t hash = hostKeyOf(hostIdentity("") + "/" + pidNamespace);
    return hash == 0 ? uint64_t{1} : hash;
  }();
  return key;
}

SameHostWindow::SameHostWindow() : expected_(freshToken()), token_(expected_) {}

bool PeerMemory::read(void* into, uint64_t address, size_t bytes, std::string* why) const {
  size_t done = 0;
  while (done < bytes) {
    iovec local{static_cast<uint8_t*>(into) + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(address + done), bytes - done};
    const ssize_t got = ::process_vm_readv(pid_, &local, 1, &remote, 1, 0);
    if (got <= 0) {
      const int error = got < 0 ? errno : EFAULT;
      *why = "same-host read of " + std::to_string(bytes) + " bytes from pid " +
             std::to_string(pid_) + ": " + std::strerror(error);
      std::string gone;
      // A sender that revoked its window or exited is a path going away; any
      // other refusal will repeat, so this transport stops taking offers.
      if (error != ESRCH && tokenHolds(&gone) && unreadable_) unreadable_->store(true);
      return false;
    }
    done += static_cast<size_t>(got);
  }
  return tokenHolds(why);
}

bool PeerMemory::tokenHolds(std::string* why) const {
  uint64_t seen = 0;
  iovec local{&seen, sizeof(seen)};
  iovec remote{reinterpret_cast<void*>(tokenAddress_), sizeof(seen)};
  const ssize_t got = ::process_vm_readv(pid_, &local, 1, &remote, 1, 0);
  if (got != static_cast<ssize_t>(sizeof(seen))) {
    *why = "same-host token of pid " + std::to_string(pid_) +
           " unreadable: " + (got < 0 ? std::strerror(errno) : "short read");
    return false;
  }
  if (seen != token_) {
    *why = "pid " + std::to_string(pid_) + " revoked its same-host window (its path is gone)";
    return false;
  }
  return true;
}

}  // namespace reccl
