// all_gather: every rank ends with every rank's `count` elements. Small (all
// N blocks within RECCL_SMALL_BYTES): recursive doubling gathers them inside
// the agreement, log2 N steps. Larger: per channel, a ring all-gather, or with
// RECCL_ALGO=halving recursive doubling (halving_doubling.h).
#pragma once

#include <cstddef>

#include "core/clock.h"
#include "engine/communicator.h"
#include "engine/data_type.h"

namespace reccl {

// `out` holds size*count elements, rank r's at r*count.
void allgather(Communicator& comm, const void* in, void* out, size_t count, DataType dtype,
               Millis timeout);

}  // namespace reccl
