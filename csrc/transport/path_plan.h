// Which paths a new connection gets: the primary, the backup and (as a last
// resort) the other rails, as (local NIC, remote NIC) pairs. Shared by the
// transports, so every transport pairs NICs the same way.
#pragma once

#include <vector>

#include "core/connection.h"
#include "transport/handle.h"

namespace reccl {

// `nic`: the local NIC the caller connects from; `backupNic`: its backup (-1
// for none); `localNics`: how many NICs this process has; `withBackup`:
// RECCL_BACKUP.
std::vector<PathCandidate> planPaths(int nic, int backupNic, int localNics,
                                     const ListenHandle& handle, bool withBackup);

}  // namespace reccl
