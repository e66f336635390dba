#pragma once
// Argument checks shared by the ops' public entry points.

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace amp8::detail {

// The CUDA branch of an op in a build without CUDA.
[[noreturn]] inline void no_cuda(std::string_view op) {
  TORCH_CHECK(false, op, ": got a CUDA tensor but amp8 was built without CUDA");
}

// float32, bfloat16 or float16: the dtypes the ops read as high precision.
inline bool is_high_precision(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// A defined, non-empty, contiguous float32 / bfloat16 / float16 tensor on the CPU or CUDA;
// errors name it `name`.
inline void check_high_precision_input(const at::Tensor& x, std::string_view op,
                                       std::string_view name = "x") {
  TORCH_CHECK(x.defined(), op, ": ", name, " must be a defined tensor");
  TORCH_CHECK(is_high_precision(x.scalar_type()), op, ": ", name,
              " must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.numel() > 0, op, ": ", name, " must be non-empty, got shape ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), op, ": ", name,
              " must be contiguous (call .contiguous()), got strides ", x.strides(), " for shape ",
              x.sizes());
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), op, ": ", name, " must be on CPU or CUDA, got ",
              x.device());
}

inline void check_scalar_slot(const at::Tensor& t, const at::Tensor& x, std::string_view op,
                              std::string_view name, std::string_view x_name = "x") {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == 1, op, ": ", name, " must hold exactly one element, got shape ",
              t.sizes());
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " must be on ", x.device(), " like ",
              x_name, ", got ", t.device());
}

// A bias-gradient output: a contiguous float32 / bfloat16 / float16 [cols] tensor on `device`.
inline void check_dbias_out(const at::Tensor& dbias_out, int64_t cols, const at::Device& device,
                            std::string_view op) {
  const auto dtype = dbias_out.scalar_type();
  TORCH_CHECK(is_high_precision(dtype) && dbias_out.dim() == 1 && dbias_out.size(0) == cols &&
                  dbias_out.is_contiguous() && dbias_out.device() == device,
              op, ": dbias_out must be a contiguous float32, bfloat16 or float16 [", cols,
              "] tensor on ", device, ", got ", dtype, " ", dbias_out.sizes(), " on ",
              dbias_out.device());
}

// The same for the column sums of a 2-D x.
inline void check_dbias_out(const at::Tensor& dbias_out, const at::Tensor& x, std::string_view op) {
  check_dbias_out(dbias_out, x.size(1), x.device(), op);
}

// ---- Lists for one multi-tensor launch (sum_of_squares, compute_amax_many) ----

// Why one multi-tensor launch cannot take `tensors`: its first entry that is undefined, not
// float32 / bfloat16 / float16, not on tensors[0]'s device, or not contiguous, described as
// "name[i] ...". std::nullopt when every entry fits (and for an empty list).
inline std::optional<std::string> multi_tensor_list_problem(const std::vector<at::Tensor>& tensors,
                                                            std::string_view name) {
  if (tensors.empty()) return std::nullopt;
  const auto device = tensors.front().device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!t.defined()) return c10::str(name, "[", i, "] is undefined");
    if (!is_high_precision(t.scalar_type())) {
      return c10::str(name, "[", i, "] must be float32, bfloat16 or float16, got ",
                      t.scalar_type());
    }
    if (t.device() != device) {
      return c10::str(name, "[", i, "] is on ", t.device(), ", ", name, "[0] on ", device,
                      ": all must be on one device");
    }
    if (!t.is_contiguous()) return c10::str(name, "[", i, "] (", t.sizes(), ") must be contiguous");
  }
  return std::nullopt;
}

// At least one tensor, and every one fits (multi_tensor_list_problem); errors start "op: ".
inline void check_multi_tensor_list(const std::vector<at::Tensor>& tensors, std::string_view op,
                                    std::string_view name) {
  TORCH_CHECK(!tensors.empty(), op, ": ", name, " must hold at least one tensor");
  if (auto problem = multi_tensor_list_problem(tensors, name))
    TORCH_CHECK(false, op, ": ", *problem);
}

// ---- The fused optimizer steps' entries (fused_adam_step, fused_sgd_step) ----

// "op: tensors[index]." — the prefix that names one entry in an error.
inline std::string step_entry_name(std::string_view op, size_t index) {
  return std::string(op) + ": tensors[" + std::to_string(index) + "].";
}

// The dtypes a fused step's tensor may have.
enum class StepDtypes {
  kFloat32,            // a master, SGD's momentum buffer
  kFloat32OrBFloat16,  // an Adam moment
  kHighPrecision,      // a gradient, a model copy: float32, bfloat16 or float16
  kFloat8E4M3,         // an FP8 weight Adam's step writes (AdamStepTensor::model_copy_scale)
};

// One tensor of an entry: defined, on `device` (the first param's), contiguous, of the param's
// shape, and of one of `dtypes`.
inline void check_step_tensor(const at::Tensor& x, const at::Tensor& param, const at::Device& device,
                              const std::string& where, const char* field, StepDtypes dtypes) {
  TORCH_CHECK(x.defined(), where, field, " must be a defined tensor");
  TORCH_CHECK(x.device() == device, where, field, " must be on ", device, " (the first param's "
              "device), got ", x.device());
  TORCH_CHECK(x.is_contiguous(), where, field, " must be contiguous");
  TORCH_CHECK(x.sizes() == param.sizes(), where, field, " must have the param's shape ",
              param.sizes(), ", got ", x.sizes());
  const auto dtype = x.scalar_type();
  switch (dtypes) {
    case StepDtypes::kFloat32:
      TORCH_CHECK(dtype == at::kFloat, where, field, " must be float32, got ", dtype);
      break;
    case StepDtypes::kFloat32OrBFloat16:
      TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, where, field,
                  " must be float32 or bfloat16, got ", dtype);
      break;
    case StepDtypes::kHighPrecision:
      TORCH_CHECK(is_high_precision(dtype), where, field, " must be float32, bfloat16 or float16, got ", dtype);
      break;
    case StepDtypes::kFloat8E4M3:
      TORCH_CHECK(dtype == at::kFloat8_e4m3fn, where, field, " must be float8_e4m3fn, got ", dtype);
      break;
  }
}

// The param, its gradient and, when defined, the model's half copy of an entry.
inline void check_step_param_grad_copy(const at::Tensor& param, const at::Tensor& grad,
                                       const at::Tensor& model_copy, const at::Device& device,
                                       const std::string& where) {
  check_step_tensor(param, param, device, where, "param", StepDtypes::kFloat32);
  check_step_tensor(grad, param, device, where, "grad", StepDtypes::kHighPrecision);
  if (!model_copy.defined()) return;
  check_step_tensor(model_copy, param, device, where, "model_copy", StepDtypes::kHighPrecision);
  TORCH_CHECK(model_copy.scalar_type() != at::kFloat, where,
              "model_copy must be bfloat16 or float16 (a float32 param is its own master), got float32");
}

// gelu_input: the GELU input whose derivative multiplies grad.
inline void check_gelu_input(const at::Tensor& grad, const at::Tensor& gelu_input, std::string_view op) {
  TORCH_CHECK(gelu_input.defined(), op, ": gelu_input must be defined");
  TORCH_CHECK(gelu_input.sizes() == grad.sizes() && gelu_input.scalar_type() == grad.scalar_type() &&
                  gelu_input.device() == grad.device() && gelu_input.is_contiguous(),
              op, ": gelu_input must be a contiguous ", grad.scalar_type(), " ", grad.sizes(),
              " tensor on ", grad.device(), " (as grad), got ", gelu_input.scalar_type(), " ",
              gelu_input.sizes(), " on ", gelu_input.device(),
              gelu_input.is_contiguous() ? "" : ", not contiguous");
}

}  // namespace amp8::detail
