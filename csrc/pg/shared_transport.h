// The process-wide TCP transport the process groups share: one acceptor per
// NIC, one supervisor, one link monitor, made on first use from the RECCL_*
// environment and destroyed (every thread joined, every socket closed) when the
// last process group that uses it is gone. Always TCP: RECCL_TRANSPORT chooses
// the NCCL plugin's transport only, since the engine has not been run over IB
// (the verbs emulation is in-process; the engine's tests are multi-process).
#pragma once

#include <memory>

#include "transport/transport.h"

namespace reccl {

std::shared_ptr<Transport> sharedTransport();

}  // namespace reccl
