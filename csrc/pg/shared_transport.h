// The process-wide TCP transport the process groups share: one acceptor per
// NIC, one supervisor, one link monitor, made on first use from the RECCL_*
// environment and destroyed (every thread joined, every socket closed) when the
// last process group that uses it is gone.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace reccl {

std::shared_ptr<Transport> sharedTransport();

}  // namespace reccl
