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

// True when this build was compiled against the libibverbs headers.
bool verbsHeadersCompiledIn();

// The loaded library, or nullptr with the reason in `error` (library absent,
// a symbol missing, or a build without the headers).
std::shared_ptr<VerbsApi> loadSystemVerbs(std::string* error);

}  // namespace reccl
