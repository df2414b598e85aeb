#include "engine/data_type.h"

#include <string>

#include "core/error.h"

namespace reccl {

size_t elementSize(DataType type) {
  switch (type) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16: return 2;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool: return 1;
  }
  throw ConfigError("unknown data type " + std::to_string(static_cast<int>(type)));
}

const char* dataTypeName(DataType type) {
  switch (type) {
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kInt8: return "int8";
    case DataType::kInt16: return "int16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kUInt8: return "uint8";
    case DataType::kBool: return "bool";
  }
  return "dtype(?)";
}

bool isFloating(DataType type) {
  return type == DataType::kFloat16 || type == DataType::kBFloat16 || type == DataType::kFloat32 ||
         type == DataType::kFloat64;
}

bool isValidDataType(uint8_t raw) {
  return raw >= static_cast<uint8_t>(DataType::kFloat16) &&
         raw <= static_cast<uint8_t>(DataType::kBool);
}

}  // namespace reccl
