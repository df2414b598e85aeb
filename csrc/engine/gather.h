// gather: the root ends with every rank's `count` elements. Small (all N
// blocks within RECCL_SMALL_BYTES): recursive doubling gathers every block on
// every rank inside the agreement (log2 N steps); only the root keeps them.
// Larger: per channel, every rank sends its block straight to the root.
#pragma once

#include <cstddef>

#include "core/clock.h"
#include "engine/communicator.h"
#include "engine/data_type.h"

namespace reccl {

// `out` (size*count elements, rank r's at r*count) on the root only.
void gather(Communicator& comm, const void* in, void* out, size_t count, DataType dtype, int root,
            Millis timeout);

}  // namespace reccl
