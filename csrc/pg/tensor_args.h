// From torch arguments to engine arguments: dtype and reduce-op mapping and
// the checks every tensor goes through (CPU, dense, supported dtype), with
// errors that say what is valid.
#pragma once

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "engine/data_type.h"
#include "engine/descriptor.h"
#include "engine/reduce_op.h"

namespace reccl {

// Throws c10::Error naming the supported dtypes.
DataType toDataType(at::ScalarType type, const char* op);
// Throws c10::Error for PREMUL_SUM and anything the engine lacks.
ReduceOp toReduceOp(const c10d::ReduceOp& op, const char* name);

// CPU, strided (dense), a supported dtype. `what` names the argument.
void checkTensor(const at::Tensor& tensor, const char* op, const char* what);
// Exactly one tensor (reccl drives one device per process).
const at::Tensor& singleTensor(const std::vector<at::Tensor>& tensors, const char* op);
// Every tensor has `like`'s dtype and number of elements.
void checkSameShape(const std::vector<at::Tensor>& tensors, const at::Tensor& like, const char* op,
                    const char* what);
// A list of one tensor per rank (`ranks` of them), each with `like`'s dtype
// and number of elements: its first problem as a Rejection naming `argument`
// (empty when valid). Tensors that are not CPU, dense or of a supported dtype
// still throw (checkTensor).
Rejection checkPerRankList(const std::vector<at::Tensor>& list, size_t ranks,
                           const at::Tensor& like, const char* op, const char* argument);
// `tensor` (the argument named `argument`) has `like`'s dtype and `elements`
// elements: its problem as a Rejection (empty when valid).
Rejection checkTensorLike(const at::Tensor& tensor, const at::Tensor& like, int64_t elements,
                          const char* argument);

}  // namespace reccl
