// reduce_scatter: rank r ends with the reduction of block r of every rank's
// input. Small (all N blocks within RECCL_SMALL_BYTES): recursive doubling
// reduces the whole input inside the agreement and each rank keeps its block.
// Larger: per channel, a ring reduce-scatter over the blocks, or with
// RECCL_ALGO=halving recursive halving (halving_doubling.h).
#pragma once

#include <cstddef>

#include "core/clock.h"
#include "engine/communicator.h"
#include "engine/data_type.h"
#include "engine/reduce_op.h"

namespace reccl {

// `in` holds size*count elements (block r at r*count); `out` count elements.
void reduceScatter(Communicator& comm, const void* in, void* out, size_t count, DataType dtype,
                   ReduceOp op, Millis timeout);

}  // namespace reccl
