#include "ops/accumulate.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "ops/detail/checks.h"
#include "ops/detail/cuda_ops.h"

namespace amp8 {

void accumulate_in_float32(const std::vector<at::Tensor>& sums, const std::vector<at::Tensor>& grads,
                           const std::vector<bool>& overwrite) {
  constexpr const char* kOp = "accumulate_in_float32";
  TORCH_CHECK(sums.size() == grads.size() && overwrite.size() == grads.size(), kOp,
              ": sums, grads and overwrite must have one length, got ", sums.size(), ", ", grads.size(),
              " and ", overwrite.size());
  if (grads.empty()) return;
  if (auto problem = detail::multi_tensor_list_problem(grads, "grads")) TORCH_CHECK(false, kOp, ": ", *problem);
  const auto device = grads.front().device();
  for (size_t i = 0; i < sums.size(); ++i) {
    const auto& sum = sums[i];
    TORCH_CHECK(sum.defined() && sum.scalar_type() == at::kFloat, kOp, ": sums[", i, "] must be float32, got ",
                sum.defined() ? c10::toString(sum.scalar_type()) : "an undefined tensor");
    TORCH_CHECK(sum.device() == device, kOp, ": sums[", i, "] is on ", sum.device(), ", grads on ", device,
                ": all must be on one device");
    TORCH_CHECK(sum.is_contiguous(), kOp, ": sums[", i, "] (", sum.sizes(), ") must be contiguous");
    TORCH_CHECK(sum.sizes() == grads[i].sizes(), kOp, ": sums[", i, "] is ", sum.sizes(), ", grads[", i, "] ",
                grads[i].sizes(), ": each sum must have its gradient's shape");
  }
  if (device.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::accumulate_in_float32_cuda(sums, grads, overwrite);
    return;
#else
    detail::no_cuda(kOp);
#endif
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < sums.size(); ++i) {
    // Both round once: float32 + float32(grad), or the exact widening of the gradient.
    auto sum = sums[i];
    if (overwrite[i]) sum.copy_(grads[i]);
    else sum.add_(grads[i]);
  }
}

}  // namespace amp8
