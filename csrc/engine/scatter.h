// scatter: rank r ends with block r of the root's input. Small (all N blocks
// within RECCL_SMALL_BYTES): recursive doubling spreads the root's blocks to
// every rank inside the agreement (log2 N steps); each keeps its own. Larger:
// per channel, the root sends each block straight to its rank.
#pragma once

#include <cstddef>

#include "core/clock.h"
#include "engine/communicator.h"
#include "engine/data_type.h"

namespace reccl {

// `in` (size*count elements, block r at r*count) on the root only.
void scatter(Communicator& comm, const void* in, void* out, size_t count, DataType dtype, int root,
             Millis timeout);

}  // namespace reccl
