#include "transport/path_plan.h"

#include <algorithm>

namespace reccl {

std::vector<PathCandidate> planPaths(int nic, int backupNic, int localNics,
                                     const ListenHandle& handle, bool withBackup) {
  std::vector<PathCandidate> candidates;
  const int remoteNics = static_cast<int>(handle.nics.size());
  auto add = [&](int local, int remote, bool upFront) {
    if (local < 0 || remote < 0 || local >= localNics || remote >= remoteNics) return;
    for (const auto& c : candidates) {
      if (c.localNic == local && c.remoteNic == remote) return;
    }
    candidates.push_back({local, remote, upFront});
  };
  // NIC i of every host sits on rail i, so the primary pairs the same rail on
  // both ends (never a cross-rail hop, even when the caller listened elsewhere)
  // and the backup pairs our backup NIC with the peer's NIC of that rail, which
  // is its backup too on identically wired hosts. The listener's own NIC and
  // backup stand in where the peer lacks the rail.
  add(nic, nic < remoteNics ? nic : handle.listenerNic, true);
  if (withBackup) {
    add(backupNic, backupNic >= 0 && backupNic < remoteNics ? backupNic : handle.listenerBackup,
        true);
    // Same-rail pairs on the remaining rails: a last resort when both are gone.
    for (int rail = 0; rail < std::min(localNics, remoteNics); ++rail) add(rail, rail, false);
  }
  return candidates;
}

}  // namespace reccl
