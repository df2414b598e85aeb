#include "pg/tensor_args.h"

namespace reccl {

namespace {
constexpr const char* kSupported =
    "float16, bfloat16, float32, float64, int8, int16, int32, int64, uint8, bool";
}

DataType toDataType(at::ScalarType type, const char* op) {
  switch (type) {
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kChar: return DataType::kInt8;
    case at::kShort: return DataType::kInt16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kByte: return DataType::kUInt8;
    case at::kBool: return DataType::kBool;
    default: break;
  }
  TORCH_CHECK(false, "reccl ", op, ": dtype ", c10::toString(type),
              " is not supported; supported dtypes: ", kSupported);
}

ReduceOp toReduceOp(const c10d::ReduceOp& op, const char* name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return ReduceOp::kSum;
    case c10d::ReduceOp::AVG: return ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT: return ReduceOp::kProduct;
    case c10d::ReduceOp::MIN: return ReduceOp::kMin;
    case c10d::ReduceOp::MAX: return ReduceOp::kMax;
    case c10d::ReduceOp::BAND: return ReduceOp::kBand;
    case c10d::ReduceOp::BOR: return ReduceOp::kBor;
    case c10d::ReduceOp::BXOR: return ReduceOp::kBxor;
    default: break;
  }
  TORCH_CHECK(false, "reccl ", name, ": reduce op ", static_cast<int>(op.op_),
              " (PREMUL_SUM or unknown) is not supported; supported: SUM, AVG, PRODUCT, MIN, "
              "MAX, BAND, BOR, BXOR");
}

void checkTensor(const at::Tensor& tensor, const char* op, const char* what) {
  TORCH_CHECK(tensor.defined(), "reccl ", op, ": ", what, " is an undefined tensor");
  TORCH_CHECK(tensor.device().is_cpu(), "reccl ", op, ": ", what, " is on ", tensor.device(),
              "; the reccl CPU engine takes CPU tensors");
  TORCH_CHECK(tensor.layout() == at::kStrided, "reccl ", op, ": ", what,
              " is not a dense (strided) tensor; sparse and other layouts are not supported");
  toDataType(tensor.scalar_type(), op);
}

const at::Tensor& singleTensor(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "reccl ", op, " takes exactly one tensor per process, got ",
              tensors.size());
  checkTensor(tensors[0], op, "the tensor");
  return tensors[0];
}

void checkSameShape(const std::vector<at::Tensor>& tensors, const at::Tensor& like, const char* op,
                    const char* what) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    checkTensor(tensors[i], op, what);
    TORCH_CHECK(tensors[i].scalar_type() == like.scalar_type(), "reccl ", op, ": ", what, "[", i,
                "] has dtype ", tensors[i].scalar_type(), ", expected ", like.scalar_type());
    TORCH_CHECK(tensors[i].numel() == like.numel(), "reccl ", op, ": ", what, "[", i, "] has ",
                tensors[i].numel(), " elements, expected ", like.numel());
  }
}

namespace {

// `tensor` against `like`'s dtype and `elements`; `index` says which entry of `argument`.
Rejection checkLike(const at::Tensor& tensor, const at::Tensor& like, int64_t elements,
                    const char* argument, int32_t index) {
  if (tensor.scalar_type() != like.scalar_type()) {
    return {Rejection::Reason::kDtype, argument, index, 0, 0};
  }
  if (tensor.numel() != elements) {
    return {Rejection::Reason::kElementCount, argument, index, tensor.numel(), elements};
  }
  return Rejection{};
}

}  // namespace

Rejection checkPerRankList(const std::vector<at::Tensor>& list, size_t ranks,
                           const at::Tensor& like, const char* op, const char* argument) {
  if (list.size() != ranks) {
    return {Rejection::Reason::kListLength, argument, -1, static_cast<int64_t>(list.size()),
            static_cast<int64_t>(ranks)};
  }
  for (size_t i = 0; i < list.size(); ++i) {
    checkTensor(list[i], op, argument);
    Rejection bad = checkLike(list[i], like, like.numel(), argument, static_cast<int32_t>(i));
    if (bad) return bad;
  }
  return Rejection{};
}

Rejection checkTensorLike(const at::Tensor& tensor, const at::Tensor& like, int64_t elements,
                          const char* argument) {
  return checkLike(tensor, like, elements, argument, -1);
}

}  // namespace reccl
