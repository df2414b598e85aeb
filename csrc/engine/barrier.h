// barrier: returns once every rank has called it. It is the agreement alone
// (recursive doubling, log2 N steps, no data).
#pragma once

#include "core/clock.h"
#include "engine/communicator.h"

namespace reccl {

void barrier(Communicator& comm, Millis timeout);

}  // namespace reccl
