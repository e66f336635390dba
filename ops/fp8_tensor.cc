#include "ops/fp8_tensor.h"

#include <utility>

namespace amp8 {

Fp8Tensor::Fp8Tensor(at::Tensor data_, at::Tensor scale_inv_, Fp8Format format_)
    : data(std::move(data_)), scale_inv(std::move(scale_inv_)), format(format_) {
  TORCH_CHECK(data.defined(), "Fp8Tensor: data must be defined");
  TORCH_CHECK(data.scalar_type() == fp8_dtype(format), "Fp8Tensor: data must be ",
              fp8_dtype(format), " for format ", fp8_format_name(format), ", got ",
              data.scalar_type());
  TORCH_CHECK(
      scale_inv.defined() && scale_inv.scalar_type() == at::kFloat && scale_inv.numel() == 1,
      "Fp8Tensor: scale_inv must be a float32 tensor of one element");
  TORCH_CHECK(scale_inv.device() == data.device(), "Fp8Tensor: scale_inv must be on ",
              data.device(), " like data, got ", scale_inv.device());
}

at::Tensor Fp8Tensor::dequantize(at::ScalarType dtype) const {
  TORCH_CHECK(defined(), "Fp8Tensor::dequantize: tensor is empty (default-constructed)");
  return (data.to(at::kFloat) * scale_inv.reshape({})).to(dtype);
}

}  // namespace amp8
