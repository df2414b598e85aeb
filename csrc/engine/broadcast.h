// broadcast: the root's `count` elements reach every rank. Small (within
// RECCL_SMALL_BYTES): recursive doubling spreads them inside the agreement,
// log2 N steps. Larger: per channel, a pipelined chain root -> root+1 -> ...
#pragma once

#include <cstddef>

#include "core/clock.h"
#include "engine/communicator.h"
#include "engine/data_type.h"

namespace reccl {

// `buffer` is read on the root and written on the others.
void broadcast(Communicator& comm, void* buffer, size_t count, DataType dtype, int root,
               Millis timeout);

}  // namespace reccl
