#include "engine/reduce_op.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "engine/half.h"

// The kernels are simple loops; let the compiler vectorize them.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3")
#endif

namespace reccl {

namespace {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

// Storage type -> accumulation type, load and store.
template <typename S>
struct Elem {
  using Acc = S;
  static Acc load(S v) { return v; }
  static S store(Acc a) { return a; }
};
template <>
struct Elem<Half> {
  using Acc = float;
  static float load(Half v) { return halfToFloat(v.bits); }
  static Half store(float a) { return Half{floatToHalf(a)}; }
};
template <>
struct Elem<BFloat16> {
  using Acc = float;
  static float load(BFloat16 v) { return bfloat16ToFloat(v.bits); }
  static BFloat16 store(float a) { return BFloat16{floatToBfloat16(a)}; }
};

template <typename A>
A wrapAdd(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

template <typename A>
A wrapMul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    // Promote to at least unsigned int so the product of two shorts cannot overflow int.
    using P = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
    return static_cast<A>(static_cast<P>(static_cast<U>(a)) * static_cast<P>(static_cast<U>(b)));
  } else {
    return a * b;
  }
}

// Min/max for floating types propagate NaN (as torch.minimum/maximum) and order
// -0 below +0 (IEEE 754-2019 minimum/maximum), so the result never depends on
// operand order (the rings and the small-message path agree).
template <typename A>
A minOf(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    if (a != a) return a;
    if (b != b) return b;
    if (a == b) return std::signbit(a) ? a : b;
  }
  return b < a ? b : a;
}
template <typename A>
A maxOf(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    if (a != a) return a;
    if (b != b) return b;
    if (a == b) return std::signbit(a) ? b : a;
  }
  return a < b ? b : a;
}

// Calls fn(op-functor) for `op` on accumulation type A.
template <typename A, typename Fn>
void withOp(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return fn([](A a, A b) { return wrapAdd(a, b); });
    case ReduceOp::kProduct: return fn([](A a, A b) { return wrapMul(a, b); });
    case ReduceOp::kMin: return fn([](A a, A b) { return minOf(a, b); });
    case ReduceOp::kMax: return fn([](A a, A b) { return maxOf(a, b); });
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<A>) {
        if (op == ReduceOp::kBand) return fn([](A a, A b) { return static_cast<A>(a & b); });
        if (op == ReduceOp::kBor) return fn([](A a, A b) { return static_cast<A>(a | b); });
        return fn([](A a, A b) { return static_cast<A>(a ^ b); });
      }
      break;
  }
  throw ConfigError(std::string("reduce op ") + reduceOpName(op) + " is not valid here");
}

// Bool: the logical meaning of each op, on bytes that are 0 or 1.
template <typename Fn>
void withBoolOp(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor:
      return fn([](uint8_t a, uint8_t b) { return static_cast<uint8_t>((a | b) != 0); });
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand:
      return fn([](uint8_t a, uint8_t b) { return static_cast<uint8_t>((a & b) != 0); });
    case ReduceOp::kBxor:
      return fn([](uint8_t a, uint8_t b) { return static_cast<uint8_t>((a != 0) != (b != 0)); });
    case ReduceOp::kAvg: break;
  }
  throw ConfigError(std::string("reduce op ") + reduceOpName(op) + " is not valid for bool");
}

template <typename S>
void reduceIntoTyped(void* dstRaw, const void* srcRaw, size_t count, ReduceOp op) {
  using A = typename Elem<S>::Acc;
  S* dst = static_cast<S*>(dstRaw);
  const S* src = static_cast<const S*>(srcRaw);
  withOp<A>(op, [&](auto f) {
    for (size_t i = 0; i < count; ++i) {
      dst[i] = Elem<S>::store(f(Elem<S>::load(dst[i]), Elem<S>::load(src[i])));
    }
  });
}

template <typename A>
A divideValue(A value, int divisor) {
  if constexpr (std::is_integral_v<A>) {
    return static_cast<A>(value / static_cast<A>(divisor));
  } else {
    return value / static_cast<A>(divisor);
  }
}

template <typename S>
void reduceAllTyped(void* dstRaw, const void* const* inputs, int n, size_t count, ReduceOp op) {
  using A = typename Elem<S>::Acc;
  S* dst = static_cast<S*>(dstRaw);
  constexpr size_t kBlock = 1024;  // accumulate a block in A, then store once
  A acc[kBlock];
  withOp<A>(op, [&](auto f) {
    for (size_t base = 0; base < count; base += kBlock) {
      const size_t len = std::min(kBlock, count - base);
      const S* first = static_cast<const S*>(inputs[0]) + base;
      for (size_t i = 0; i < len; ++i) acc[i] = Elem<S>::load(first[i]);
      for (int k = 1; k < n; ++k) {
        const S* in = static_cast<const S*>(inputs[k]) + base;
        for (size_t i = 0; i < len; ++i) acc[i] = f(acc[i], Elem<S>::load(in[i]));
      }
      if (op == ReduceOp::kAvg) {
        for (size_t i = 0; i < len; ++i) acc[i] = divideValue<A>(acc[i], n);
      }
      for (size_t i = 0; i < len; ++i) dst[base + i] = Elem<S>::store(acc[i]);
    }
  });
}

template <typename S>
void divideTyped(void* dataRaw, size_t count, int divisor) {
  using A = typename Elem<S>::Acc;
  S* data = static_cast<S*>(dataRaw);
  for (size_t i = 0; i < count; ++i) {
    data[i] = Elem<S>::store(divideValue<A>(Elem<S>::load(data[i]), divisor));
  }
}

// Calls fn(S{}) with the storage type of `type` (bool excluded).
template <typename Fn>
void withStorage(DataType type, Fn&& fn) {
  switch (type) {
    case DataType::kFloat16: return fn(Half{});
    case DataType::kBFloat16: return fn(BFloat16{});
    case DataType::kFloat32: return fn(float{});
    case DataType::kFloat64: return fn(double{});
    case DataType::kInt8: return fn(int8_t{});
    case DataType::kInt16: return fn(int16_t{});
    case DataType::kInt32: return fn(int32_t{});
    case DataType::kInt64: return fn(int64_t{});
    case DataType::kUInt8: return fn(uint8_t{});
    case DataType::kBool: break;
  }
  throw ConfigError(std::string("no arithmetic for ") + dataTypeName(type));
}

}  // namespace

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kAvg: return "AVG";
    case ReduceOp::kProduct: return "PRODUCT";
    case ReduceOp::kMin: return "MIN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kBand: return "BAND";
    case ReduceOp::kBor: return "BOR";
    case ReduceOp::kBxor: return "BXOR";
  }
  return "op(?)";
}

bool isValidReduceOp(uint8_t raw) {
  return raw >= static_cast<uint8_t>(ReduceOp::kSum) &&
         raw <= static_cast<uint8_t>(ReduceOp::kBxor);
}

void checkReduceOp(ReduceOp op, DataType type) {
  if (!isValidReduceOp(static_cast<uint8_t>(op))) {
    throw ConfigError("unknown reduce op " + std::to_string(static_cast<int>(op)) +
                      "; valid: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR");
  }
  bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
  if (bitwise && isFloating(type)) {
    throw ConfigError(std::string("reduce op ") + reduceOpName(op) + " is not defined for " +
                      dataTypeName(type) +
                      "; valid for floating types: SUM, AVG, PRODUCT, MIN, MAX (BAND, BOR and "
                      "BXOR need an integer or bool tensor)");
  }
  if (op == ReduceOp::kAvg && type == DataType::kBool) {
    throw ConfigError(
        "reduce op AVG is not defined for bool; valid for bool: SUM (or), PRODUCT (and), MIN, "
        "MAX, BAND, BOR, BXOR");
  }
}

void reduceInto(void* dst, const void* src, size_t count, DataType type, ReduceOp op) {
  if (count == 0) return;
  if (type == DataType::kBool) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    withBoolOp(op, [&](auto f) {
      for (size_t i = 0; i < count; ++i) d[i] = f(d[i], s[i]);
    });
    return;
  }
  withStorage(type, [&](auto tag) { reduceIntoTyped<decltype(tag)>(dst, src, count, op); });
}

void reduceAll(void* dst, const void* const* inputs, int inputCount, size_t count, DataType type,
               ReduceOp op) {
  if (count == 0 || inputCount <= 0) return;
  if (type == DataType::kBool) {
    auto* d = static_cast<uint8_t*>(dst);
    withBoolOp(op, [&](auto f) {
      // Element by element: `dst` may be any one of the inputs.
      for (size_t i = 0; i < count; ++i) {
        uint8_t v = static_cast<const uint8_t*>(inputs[0])[i] != 0;
        for (int k = 1; k < inputCount; ++k) v = f(v, static_cast<const uint8_t*>(inputs[k])[i]);
        d[i] = v;
      }
    });
    return;
  }
  withStorage(type,
              [&](auto tag) { reduceAllTyped<decltype(tag)>(dst, inputs, inputCount, count, op); });
}

void divideBy(void* data, size_t count, DataType type, int divisor) {
  if (count == 0 || divisor == 1) return;
  withStorage(type, [&](auto tag) { divideTyped<decltype(tag)>(data, count, divisor); });
}

}  // namespace reccl
