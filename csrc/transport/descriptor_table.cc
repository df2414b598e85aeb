#include "transport/descriptor_table.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>

namespace reccl {

namespace {

constexpr int kReservedDescriptors = 4096;

// min(kReservedDescriptors, the soft RLIMIT_NOFILE).
int descriptorTableTarget() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return kReservedDescriptors;
  }
  return static_cast<int>(std::min<rlim_t>(kReservedDescriptors, limit.rlim_cur));
}

// Opens an fd numbered target - 1 (F_DUPFD takes the lowest free one at or
// above it), which makes the kernel size the table for it, then closes it.
void growTo(int target) {
  const int seed = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (seed < 0) return;
  const int high = ::fcntl(seed, F_DUPFD_CLOEXEC, target - 1);
  if (high >= 0) ::close(high);
  ::close(seed);
}

}  // namespace

void reserveDescriptorTable() {
  // Once per process: a child forked after the parent's call starts with a
  // table sized to its open fds, not the parent's reserve.
  static std::atomic<pid_t> grownFor{0};
  const pid_t self = ::getpid();
  if (grownFor.exchange(self) == self) return;
  try {
    // Detached, not joined: it owns nothing and ends within the kernel's grace
    // period, and a join at exit would hang a child forked while it ran.
    std::thread(growTo, descriptorTableTarget()).detach();
  } catch (const std::system_error&) {
    // No thread to be had: the table grows as fds are opened, as before.
  }
}

}  // namespace reccl
