// all_reduce: every rank ends with the reduction of every rank's `count`
// elements. Small (count elements within RECCL_SMALL_BYTES): recursive
// doubling reduces them inside the agreement, log2 N steps. Larger: per
// channel, a ring reduce-scatter then a ring all-gather, so each rank sends
// 2(N-1)/N of the data.
#pragma once

#include <cstddef>

#include "core/clock.h"
#include "engine/communicator.h"
#include "engine/data_type.h"
#include "engine/reduce_op.h"

namespace reccl {

// `in` and `out` may be the same buffer.
void allreduce(Communicator& comm, const void* in, void* out, size_t count, DataType dtype,
               ReduceOp op, Millis timeout);

}  // namespace reccl
