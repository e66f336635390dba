#include "ops/rotary.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <string_view>
#include <utility>
#include <vector>

#include "ops/detail/checks.h"
#include "ops/detail/cuda_ops.h"
#include "ops/detail/elementwise_formulas.h"

namespace amp8 {
namespace {

constexpr std::string_view kOp = "rotary_embedding";

void check_args(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.defined(), kOp, ": x must be a defined tensor");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, kOp,
              ": x must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, kOp,
              ": x must be [batch, seq, heads, head_dim] with an even head_dim, got shape ",
              x.sizes());
  TORCH_CHECK(x.numel() > 0, kOp, ": x must be non-empty, got shape ", x.sizes());
  TORCH_CHECK(x.stride(3) == 1, kOp,
              ": x's last dimension must be contiguous (stride 1), got strides ", x.strides());
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), kOp, ": x must be on CPU or CUDA, got ", x.device());
  const std::vector<int64_t> table{x.size(1), x.size(3) / 2};
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    TORCH_CHECK(t->defined() && t->scalar_type() == at::kFloat, kOp, ": ", name,
                " must be a float32 tensor");
    TORCH_CHECK(t->sizes() == at::IntArrayRef(table), kOp, ": ", name, " must have shape ",
                at::IntArrayRef(table), " ([seq, head_dim / 2] of x ", x.sizes(), "), got ",
                t->sizes());
    TORCH_CHECK(t->is_contiguous(), kOp, ": ", name, " must be contiguous");
    TORCH_CHECK(t->device() == x.device(), kOp, ": ", name, " must be on ", x.device(),
                " like x, got ", t->device());
  }
}

// ---- CPU reference: (batch, seq, head) rows in parallel ----

template <typename T>
void rotary_cpu(const at::Tensor& x, const float* cos, const float* sin, bool inverse, T* out) {
  const int64_t seq = x.size(1), heads = x.size(2), head_dim = x.size(3);
  const int64_t half = head_dim / 2;
  const T* base = x.const_data_ptr<T>();
  at::parallel_for(0, x.size(0) * seq * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t h = row % heads, t = (row / heads) % seq, b = row / (heads * seq);
      const T* src = base + b * x.stride(0) + t * x.stride(1) + h * x.stride(2);
      T* dst = out + row * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const auto r = detail::rotate_pair(static_cast<float>(src[2 * i]),
                                           static_cast<float>(src[2 * i + 1]), cos[t * half + i],
                                           sin[t * half + i], inverse);
        dst[2 * i] = static_cast<T>(r.first);
        dst[2 * i + 1] = static_cast<T>(r.second);
      }
    }
  });
}

}  // namespace

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            bool inverse) {
  check_args(x, cos, sin);
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::rotary_embedding_cuda(x, cos, sin, inverse, out);
    return out;
#else
    detail::no_cuda(kOp);
#endif
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "amp8_rotary", [&] {
    rotary_cpu<scalar_t>(x, cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), inverse,
                         out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace amp8
