// The system verbs library, loaded with dlopen("libibverbs.so.1") at run time:
// reccl links no RDMA library, so it loads and runs (TCP, emulation) on hosts
// without one. Compiled against <infiniband/verbs.h> when the headers are
// present at build time (libibverbs-dev); without them the loader only
// reports that this build has no verbs support.
#pragma once

#include <memory>
#include <string>

#include "transport/ib/verbs_api.h"

namespace reccl {

// What ibv_is_fork_initialized answers (kUnknown: the library lacks it,
// rdma-core older than v35).
enum class ForkState { kUnknown, kDisabled, kEnabled, kUnneeded };

// Whether loadSystemVerbs must call ibv_fork_init, as NCCL does: a process
// that forks after registering memory (a DataLoader's workers) needs fork
// protection on registered pages, or the parent's registered memory can be
// copied-on-write away from the NIC. Not when it is on already, unneeded (a
// kernel with fork support for RDMA), or RDMAV_FORK_SAFE / IBV_FORK_SAFE is set
// (`rdmavForkSafe` / `ibvForkSafe`, nullptr when unset: libibverbs then turns it
// on itself).
bool needsForkInit(ForkState state, const char* rdmavForkSafe, const char* ibvForkSafe);

// True when this build was compiled against the libibverbs headers.
bool verbsHeadersCompiledIn();

// The loaded library, or nullptr with the reason in `error` (library absent,
// a symbol missing, or a build without the headers).
std::shared_ptr<VerbsApi> loadSystemVerbs(std::string* error);

}  // namespace reccl
