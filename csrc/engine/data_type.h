// Element types the collective engine moves and reduces. The engine sees only
// byte pointers, element counts and this enum; the torch layer maps dtypes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace reccl {

enum class DataType : uint8_t {
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat32 = 3,
  kFloat64 = 4,
  kInt8 = 5,
  kInt16 = 6,
  kInt32 = 7,
  kInt64 = 8,
  kUInt8 = 9,
  kBool = 10,  // one byte, 0 or 1
};

// Bytes per element; throws ConfigError for a value outside the enum.
size_t elementSize(DataType type);
// "float32", "bfloat16", ... ; "dtype(<n>)" for a value outside the enum.
const char* dataTypeName(DataType type);
bool isFloating(DataType type);
// True when `raw` names a DataType (descriptors from the wire are checked).
bool isValidDataType(uint8_t raw);

}  // namespace reccl
