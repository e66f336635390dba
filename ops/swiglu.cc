#include "ops/swiglu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <string_view>
#include <vector>

#include "ops/detail/checks.h"
#include "ops/detail/cuda_ops.h"
#include "ops/detail/elementwise_formulas.h"

namespace amp8 {
namespace {

constexpr std::string_view kForward = "swiglu";
constexpr std::string_view kBackward = "swiglu_backward";

void check_gate_up(const at::Tensor& gate_up, std::string_view op) {
  detail::check_high_precision_input(gate_up, op, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, op,
              ": gate_up's last dimension must be even (gate and up of ffn features each), got "
              "shape ",
              gate_up.sizes());
}

std::vector<int64_t> half_last(const at::Tensor& gate_up) {
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  return sizes;
}

// ---- CPU reference: rows in parallel, the shared float32 formulas ----

template <typename T>
void swiglu_cpu(const T* gate_up, T* out, int64_t rows, int64_t ffn) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * ffn;
      for (int64_t j = 0; j < ffn; ++j) {
        out[r * ffn + j] = static_cast<T>(
            detail::swiglu(static_cast<float>(gate[j]), static_cast<float>(gate[ffn + j])));
      }
    }
  });
}

template <typename T>
void swiglu_backward_cpu(const T* grad, const T* gate_up, T* grad_gate_up, int64_t rows,
                         int64_t ffn) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * ffn;
      T* grad_gate = grad_gate_up + r * 2 * ffn;
      for (int64_t j = 0; j < ffn; ++j) {
        const auto d = detail::swiglu_backward(static_cast<float>(grad[r * ffn + j]),
                                               static_cast<float>(gate[j]),
                                               static_cast<float>(gate[ffn + j]));
        grad_gate[j] = static_cast<T>(d.gate);
        grad_gate[ffn + j] = static_cast<T>(d.up);
      }
    }
  });
}

}  // namespace

at::Tensor swiglu(const at::Tensor& gate_up) {
  check_gate_up(gate_up, kForward);
  auto out = at::empty(half_last(gate_up), gate_up.options());
  if (gate_up.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::swiglu_cuda(gate_up, out);
    return out;
#else
    detail::no_cuda(kForward);
#endif
  }
  const int64_t ffn = out.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "amp8_swiglu", [&] {
    swiglu_cpu(gate_up.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
               out.numel() / ffn, ffn);
  });
  return out;
}

at::Tensor swiglu_backward(const at::Tensor& grad, const at::Tensor& gate_up) {
  check_gate_up(gate_up, kBackward);
  detail::check_high_precision_input(grad, kBackward, "grad");
  TORCH_CHECK(grad.scalar_type() == gate_up.scalar_type(), kBackward,
              ": grad must have gate_up's dtype ", gate_up.scalar_type(), ", got ",
              grad.scalar_type());
  TORCH_CHECK(grad.sizes() == at::IntArrayRef(half_last(gate_up)), kBackward,
              ": grad must have shape ", at::IntArrayRef(half_last(gate_up)),
              " (gate_up's with the last dimension halved), got ", grad.sizes());
  TORCH_CHECK(grad.device() == gate_up.device(), kBackward, ": grad must be on ",
              gate_up.device(), " like gate_up, got ", grad.device());
  auto grad_gate_up = at::empty_like(gate_up);
  if (gate_up.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::swiglu_backward_cuda(grad, gate_up, grad_gate_up);
    return grad_gate_up;
#else
    detail::no_cuda(kBackward);
#endif
  }
  const int64_t ffn = grad.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(),
                                  "amp8_swiglu_backward", [&] {
    swiglu_backward_cpu(grad.const_data_ptr<scalar_t>(), gate_up.const_data_ptr<scalar_t>(),
                        grad_gate_up.mutable_data_ptr<scalar_t>(), grad.numel() / ffn, ffn);
  });
  return grad_gate_up;
}

}  // namespace amp8
