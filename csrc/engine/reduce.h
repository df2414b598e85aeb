// reduce: the root ends with the reduction of every rank's `count` elements.
// Small (within RECCL_SMALL_BYTES): recursive doubling reduces them inside the
// agreement (every rank computes the result; only the root keeps it). Larger:
// per channel, a ring reduce-scatter (rank r ends with segment r reduced), then
// every rank sends its segment straight to the root.
#pragma once

#include <cstddef>

#include "core/clock.h"
#include "engine/communicator.h"
#include "engine/data_type.h"
#include "engine/reduce_op.h"

namespace reccl {

// `out` (count elements) is written on the root only; `in` is never written.
void reduce(Communicator& comm, const void* in, void* out, size_t count, DataType dtype,
            ReduceOp op, int root, Millis timeout);

}  // namespace reccl
