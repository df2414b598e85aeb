// Reduction operators and the element-wise kernels that apply them. Half types
// are accumulated in float; integer sums and products wrap (two's complement);
// bool maps SUM/MAX/BOR to OR, PRODUCT/MIN/BAND to AND and BXOR to XOR. AVG
// reduces as SUM and divides once at the end (integers: truncating division).
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/data_type.h"

namespace reccl {

enum class ReduceOp : uint8_t {
  kSum = 1,
  kAvg = 2,
  kProduct = 3,
  kMin = 4,
  kMax = 5,
  kBand = 6,
  kBor = 7,
  kBxor = 8,
};

const char* reduceOpName(ReduceOp op);
bool isValidReduceOp(uint8_t raw);
// Throws ConfigError when `op` is not defined for `type` (bitwise ops on
// floating types, AVG on bool), naming what is valid.
void checkReduceOp(ReduceOp op, DataType type);

// dst[i] = dst[i] op src[i] for `count` elements (AVG: the sum).
void reduceInto(void* dst, const void* src, size_t count, DataType type, ReduceOp op);

// dst[i] = inputs[0][i] op inputs[1][i] op ... in that order, accumulating half
// types in float and rounding once; AVG divides by `inputCount`. `dst` may be
// (exactly) one of the inputs.
void reduceAll(void* dst, const void* const* inputs, int inputCount, size_t count, DataType type,
               ReduceOp op);

// data[i] /= divisor (the last step of AVG).
void divideBy(void* data, size_t count, DataType type, int divisor);

}  // namespace reccl
