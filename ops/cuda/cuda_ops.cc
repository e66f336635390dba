// LibTorch glue of the CUDA paths: device guard, current stream, raw pointers, error checks.

#include "ops/detail/cuda_ops.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <map>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops/cuda/kernels.h"
#include "ops/detail/row_sum.h"

#define AMP8_CUDA_CHECK(expr)                                                               \
  do {                                                                                      \
    const int amp8_err_ = (expr);                                                           \
    TORCH_CHECK(amp8_err_ == 0, "CUDA error at ", __FILE__, ":", __LINE__, ": ",            \
                cudaGetErrorString(static_cast<cudaError_t>(amp8_err_)), " (", #expr, ")"); \
  } while (0)

namespace amp8::detail {
namespace {

cuda::InputType input_type(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return cuda::InputType::kFloat;
    case at::kBFloat16:
      return cuda::InputType::kBFloat16;
    case at::kHalf:
      return cuda::InputType::kHalf;
    default:
      TORCH_CHECK(false, "expected float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

cuda::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

const void* optional_ptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }
void* optional_mutable_ptr(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr() : nullptr;
}

// The model copy an optimizer kernel writes: none, bf16, fp16 or (Adam only) FP8 E4M3.
cuda::CopyType copy_type(const at::Tensor& copy) {
  if (!copy.defined()) return cuda::CopyType::kNone;
  switch (copy.scalar_type()) {
    case at::kBFloat16:
      return cuda::CopyType::kBFloat16;
    case at::kFloat8_e4m3fn:
      return cuda::CopyType::kFloat8E4M3;
    default:
      return cuda::CopyType::kHalf;
  }
}

// The type an Adam moment is stored in: float32 or bfloat16 (fused_adam_step checks).
cuda::MomentType moment_type(const at::Tensor& moment) {
  return moment.scalar_type() == at::kBFloat16 ? cuda::MomentType::kBFloat16 : cuda::MomentType::kFloat;
}

// The type the LayerNorm kernels read gamma and beta in: that of whichever is defined (the
// caller makes them agree), float32 when neither is.
cuda::InputType weight_type(const at::Tensor& gamma, const at::Tensor& beta) {
  if (gamma.defined()) return input_type(gamma);
  if (beta.defined()) return input_type(beta);
  return cuda::InputType::kFloat;
}

// For the multi-tensor kernels, templated on their tensors' dtypes: groups `tensors` by
// key_of(tensor) (the dtypes a launch is instantiated for, ordered: the launches come in a fixed
// order), each entry to_entry(tensor) in the list's order, and calls launch(entries, count, key)
// once per key present.
template <typename Entry, typename Tensor, typename KeyOf, typename ToEntry, typename Launch>
void launch_grouped(const std::vector<Tensor>& tensors, KeyOf&& key_of, ToEntry&& to_entry, Launch&& launch) {
  std::map<std::invoke_result_t<KeyOf, const Tensor&>, std::vector<Entry>> groups;
  for (const auto& t : tensors) groups[key_of(t)].push_back(to_entry(t));
  for (const auto& [key, entries] : groups) {
    AMP8_CUDA_CHECK(launch(entries.data(), static_cast<int>(entries.size()), key));
  }
}

}  // namespace

void quantize_cuda(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                   const at::Tensor& out, const at::Tensor& scale_inv_out, float* amax,
                   bool accumulate_amax) {
  const c10::cuda::CUDAGuard guard(x.device());
  AMP8_CUDA_CHECK(
      cuda::launch_quantize(x.const_data_ptr(), input_type(x), out.mutable_data_ptr(), x.numel(),
                            scale.const_data_ptr<float>(), scale_inv_out.mutable_data_ptr<float>(),
                            amax, accumulate_amax, format == Fp8Format::kE5M2, current_stream()));
}

void quantize_many_cuda(const std::vector<at::Tensor>& xs, const at::Tensor& scales,
                        const std::vector<int64_t>& scale_index, Fp8Format format,
                        const std::vector<at::Tensor>& outs) {
  if (xs.empty()) return;
  const c10::cuda::CUDAGuard guard(xs.front().device());
  std::vector<cuda::QuantizeManyTensor> tensors(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    tensors[i] = {xs[i].const_data_ptr(), static_cast<uint8_t*>(outs[i].mutable_data_ptr()),
                  scales.const_data_ptr<float>() + scale_index[i], xs[i].numel()};
  }
  AMP8_CUDA_CHECK(cuda::launch_quantize_many(tensors.data(), static_cast<int>(tensors.size()),
                                             input_type(xs.front()), {format == Fp8Format::kE5M2},
                                             current_stream()));
}

namespace {

cuda::BlockwiseScaling blockwise_scaling(const BlockwiseQuantizeOptions& options) {
  return {options.format == Fp8Format::kE5M2, options.power_of_2_scales,
          static_cast<float>(options.amax_epsilon)};
}

}  // namespace

void quantize_blockwise_cuda(const at::Tensor& x, const BlockwiseQuantizeOptions& options,
                             const at::Tensor& out, const at::Tensor& scale_inv,
                             const at::Tensor& out_t, const at::Tensor& scale_inv_t,
                             const at::Tensor& dbias_out) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto scaling = blockwise_scaling(options);
  const bool transposed = out_t.defined();
  if (options.block == Fp8BlockShape::k1x128) {
    // The bias gradient from the quantizing read where the kernel sums columns; else LibTorch's.
    const bool sums = dbias_out.defined() &&
                      cuda::quantize_1x128_sums_columns(input_type(x), x.size(0), x.size(1),
                                                        x.const_data_ptr(),
                                                        transposed ? out_t.const_data_ptr() : nullptr);
    if (dbias_out.defined() && !sums) sum_rows_into(dbias_out, x);
    const auto part = sums ? at::empty({cuda::quantize_1x128_dbias_parts(x.size(0)), x.size(1)},
                                       x.options().dtype(at::kFloat))
                           : at::Tensor();
    AMP8_CUDA_CHECK(cuda::launch_quantize_1x128(
        x.const_data_ptr(), input_type(x), x.size(0), x.size(1), scaling, out.mutable_data_ptr(),
        scale_inv.mutable_data_ptr<float>(), transposed ? out_t.mutable_data_ptr() : nullptr,
        transposed ? scale_inv_t.mutable_data_ptr<float>() : nullptr, current_stream(),
        sums ? part.mutable_data_ptr<float>() : nullptr,
        sums ? dbias_out.mutable_data_ptr() : nullptr,
        sums ? input_type(dbias_out) : cuda::InputType::kFloat));
    return;
  }
  if (dbias_out.defined()) sum_rows_into(dbias_out, x);
  AMP8_CUDA_CHECK(cuda::launch_quantize_128x128(
      x.const_data_ptr(), input_type(x), x.size(0), x.size(1), scaling, out.mutable_data_ptr(),
      scale_inv.mutable_data_ptr<float>(), scale_inv.size(1),
      transposed ? out_t.mutable_data_ptr() : nullptr,
      transposed ? scale_inv_t.mutable_data_ptr<float>() : nullptr,
      transposed ? scale_inv_t.size(1) : 0, current_stream()));
}

bool quantize_blockwise_columns_cuda(const std::vector<at::Tensor>& pieces,
                                     const BlockwiseQuantizeOptions& options, const at::Tensor& out,
                                     const at::Tensor& scale_inv, const at::Tensor& out_t,
                                     const at::Tensor& scale_inv_t, const at::Tensor& dbias_out) {
  if (options.block != Fp8BlockShape::k1x128 || !out_t.defined()) return false;
  std::vector<const void*> data;
  std::vector<int64_t> cols;
  for (const auto& piece : pieces) {
    if (!piece.is_contiguous()) return false;
    data.push_back(piece.const_data_ptr());
    cols.push_back(piece.size(1));
  }
  const auto& first = pieces.front();
  const int64_t rows = first.size(0), width = out.size(1);
  const c10::cuda::CUDAGuard guard(first.device());
  const auto part = dbias_out.defined()
                        ? at::empty({cuda::quantize_1x128_dbias_parts(rows), width},
                                    first.options().dtype(at::kFloat))
                        : at::Tensor();
  const int err = cuda::launch_quantize_1x128_columns(
      data.data(), cols.data(), static_cast<int>(pieces.size()), input_type(first), rows,
      blockwise_scaling(options), out.mutable_data_ptr(), scale_inv.mutable_data_ptr<float>(),
      out_t.mutable_data_ptr(), scale_inv_t.mutable_data_ptr<float>(), current_stream(),
      part.defined() ? part.mutable_data_ptr<float>() : nullptr,
      dbias_out.defined() ? dbias_out.mutable_data_ptr() : nullptr,
      dbias_out.defined() ? input_type(dbias_out) : cuda::InputType::kFloat);
  if (err == cuda::kUnsupportedShape) return false;
  AMP8_CUDA_CHECK(err);
  return true;
}

bool quantize_blockwise_gelu_cuda(const at::Tensor& x, const at::Tensor& gelu_input,
                                  const BlockwiseQuantizeOptions& options, const at::Tensor& out,
                                  const at::Tensor& scale_inv, const at::Tensor& out_t,
                                  const at::Tensor& scale_inv_t, const at::Tensor& dbias_out) {
  if (options.block != Fp8BlockShape::k1x128 || !out_t.defined() ||
      !cuda::quantize_1x128_sums_columns(input_type(x), x.size(0), x.size(1), x.const_data_ptr(),
                                         out_t.const_data_ptr()) ||
      (gelu_input.defined() && reinterpret_cast<uintptr_t>(gelu_input.const_data_ptr()) % 16 != 0)) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const auto part = dbias_out.defined()
                        ? at::empty({cuda::quantize_1x128_dbias_parts(x.size(0)), x.size(1)},
                                    x.options().dtype(at::kFloat))
                        : at::Tensor();
  AMP8_CUDA_CHECK(cuda::launch_quantize_1x128_activation(
      x.const_data_ptr(), gelu_input.defined() ? gelu_input.const_data_ptr() : nullptr,
      input_type(x), gelu_input.defined() ? cuda::CastActivation::kDGelu : cuda::CastActivation::kGelu,
      x.size(0), x.size(1), blockwise_scaling(options), out.mutable_data_ptr(),
      scale_inv.mutable_data_ptr<float>(), out_t.mutable_data_ptr(),
      scale_inv_t.mutable_data_ptr<float>(), current_stream(),
      part.defined() ? part.mutable_data_ptr<float>() : nullptr,
      dbias_out.defined() ? dbias_out.mutable_data_ptr() : nullptr,
      dbias_out.defined() ? input_type(dbias_out) : cuda::InputType::kFloat));
  return true;
}

namespace {

std::vector<cuda::BlockwiseShard> blockwise_shards(const std::vector<Fp8WeightShard>& shards,
                                                  const std::vector<at::Tensor>& amaxes) {
  std::vector<cuda::BlockwiseShard> table(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    table[i].values = s.values.const_data_ptr();
    table[i].rows = s.rows;
    table[i].cols = s.cols;
    table[i].offset = s.offset;
    table[i].numel = s.values.numel();
    table[i].amax = amaxes[i].mutable_data_ptr<float>();
  }
  return table;
}

void check_one_input_type(const std::vector<Fp8WeightShard>& shards, const char* fn) {
  for (const auto& s : shards) {
    TORCH_CHECK(s.values.scalar_type() == shards.front().values.scalar_type() &&
                    s.values.device() == shards.front().values.device(),
                fn, ": on CUDA every shard must have the first's dtype and device (",
                shards.front().values.scalar_type(), " on ", shards.front().values.device(),
                "), got ", s.values.scalar_type(), " on ", s.values.device());
  }
}

}  // namespace

void blockwise_shard_amax_cuda(const std::vector<Fp8WeightShard>& shards,
                               const std::vector<at::Tensor>& amaxes) {
  check_one_input_type(shards, "blockwise_shard_amax");
  const c10::cuda::CUDAGuard guard(shards.front().values.device());
  const auto table = blockwise_shards(shards, amaxes);
  AMP8_CUDA_CHECK(cuda::launch_blockwise_shard_amax(table.data(), static_cast<int>(table.size()),
                                                    input_type(shards.front().values),
                                                    current_stream()));
}

void quantize_shards_blockwise_cuda(const std::vector<Fp8WeightShard>& shards,
                                    const std::vector<at::Tensor>& amaxes,
                                    const BlockwiseQuantizeOptions& options,
                                    const std::vector<at::Tensor>& outs,
                                    const std::vector<at::Tensor>& scale_invs) {
  check_one_input_type(shards, "quantize_shards_blockwise");
  const c10::cuda::CUDAGuard guard(shards.front().values.device());
  auto table = blockwise_shards(shards, amaxes);
  for (size_t i = 0; i < table.size(); ++i) {
    table[i].out = outs[i].mutable_data_ptr();
    table[i].scale_inv = scale_invs[i].mutable_data_ptr<float>();
    table[i].scale_ld = scale_invs[i].size(1);
  }
  AMP8_CUDA_CHECK(cuda::launch_quantize_shards_blockwise(
      table.data(), static_cast<int>(table.size()), input_type(shards.front().values), blockwise_scaling(options),
      current_stream()));
}

void quantize_whole_weights_blockwise_cuda(const std::vector<Fp8WeightShard>& shards,
                                           const BlockwiseQuantizeOptions& options,
                                           const std::vector<at::Tensor>& outs,
                                           const std::vector<at::Tensor>& scale_invs) {
  const c10::cuda::CUDAGuard guard(shards.front().values.device());
  const auto scaling = blockwise_scaling(options);
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    AMP8_CUDA_CHECK(cuda::launch_quantize_128x128(
        s.values.const_data_ptr(), input_type(s.values), s.rows, s.cols, scaling,
        outs[i].mutable_data_ptr(), scale_invs[i].mutable_data_ptr<float>(), scale_invs[i].size(1),
        nullptr, nullptr, 0, current_stream()));
  }
}

namespace {

// launch_cast_transpose_fused on tensors; false when it does not take the shape (it did nothing).
bool cast_transpose_fused_cuda(const at::Tensor& x, const at::Tensor& gate,
                               cuda::CastActivation activation, const at::Tensor& scale,
                               Fp8Format format, const at::Tensor& out, const at::Tensor& out_t,
                               const at::Tensor& scale_inv_out, float* amax, bool accumulate_amax,
                               const at::Tensor& dbias_out) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor part;
  if (dbias_out.defined()) {
    part = at::empty({cuda::cast_transpose_dbias_parts(x.size(0)), x.size(1)},
                     x.options().dtype(at::kFloat));
  }
  // The output's columns: x's, but half of them for SwiGLU (x holds gate and up), twice them for
  // SwiGLU's backward (gate holds gate and up).
  const int err = cuda::launch_cast_transpose_fused(
      x.const_data_ptr(), gate.defined() ? gate.const_data_ptr() : nullptr, input_type(x),
      activation, out.mutable_data_ptr(), out_t.mutable_data_ptr(), out.size(0), out.size(1),
      scale.const_data_ptr<float>(), scale_inv_out.mutable_data_ptr<float>(), amax,
      accumulate_amax, format == Fp8Format::kE5M2,
      part.defined() ? part.mutable_data_ptr<float>() : nullptr, optional_mutable_ptr(dbias_out),
      dbias_out.defined() ? input_type(dbias_out) : cuda::InputType::kFloat, current_stream(),
      out.stride(0));
  if (err == cuda::kUnsupportedShape) return false;
  AMP8_CUDA_CHECK(err);
  return true;
}

}  // namespace

void cast_transpose_cuda(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                         const at::Tensor& out, const at::Tensor& out_t,
                         const at::Tensor& scale_inv_out, float* amax, bool accumulate_amax,
                         const at::Tensor& dbias_out) {
  const c10::cuda::CUDAGuard guard(x.device());
  if (dbias_out.defined()) {
    if (cast_transpose_fused_cuda(x, {}, cuda::CastActivation::kNone, scale, format, out, out_t,
                                  scale_inv_out, amax, accumulate_amax, dbias_out)) {
      return;
    }
    sum_rows_into(dbias_out, x);
  }
  AMP8_CUDA_CHECK(cuda::launch_cast_transpose(
      x.const_data_ptr(), input_type(x), out.mutable_data_ptr(), out_t.mutable_data_ptr(),
      x.size(0), x.size(1), scale.const_data_ptr<float>(), scale_inv_out.mutable_data_ptr<float>(),
      amax, accumulate_amax, format == Fp8Format::kE5M2, current_stream(), out.stride(0)));
}

bool cast_transpose_gelu_cuda(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                              const at::Tensor& out, const at::Tensor& out_t,
                              const at::Tensor& scale_inv_out, float* amax, bool accumulate_amax) {
  return cast_transpose_fused_cuda(x, {}, cuda::CastActivation::kGelu, scale, format, out, out_t,
                                   scale_inv_out, amax, accumulate_amax, {});
}

bool cast_transpose_swiglu_cuda(const at::Tensor& gate_up, const at::Tensor& scale,
                                Fp8Format format, const at::Tensor& out, const at::Tensor& out_t,
                                const at::Tensor& scale_inv_out, float* amax,
                                bool accumulate_amax) {
  return cast_transpose_fused_cuda(gate_up, {}, cuda::CastActivation::kSwiGlu, scale, format, out,
                                   out_t, scale_inv_out, amax, accumulate_amax, {});
}

bool cast_transpose_dswiglu_cuda(const at::Tensor& grad, const at::Tensor& gate_up,
                                 const at::Tensor& scale, Fp8Format format, const at::Tensor& out,
                                 const at::Tensor& out_t, const at::Tensor& scale_inv_out,
                                 float* amax, bool accumulate_amax, const at::Tensor& dbias_out) {
  if (dbias_out.defined()) return false;  // no dbias variant of that kernel
  return cast_transpose_fused_cuda(grad, gate_up, cuda::CastActivation::kDSwiGlu, scale, format,
                                   out, out_t, scale_inv_out, amax, accumulate_amax, dbias_out);
}

bool cast_transpose_dgelu_cuda(const at::Tensor& grad, const at::Tensor& gelu_input,
                               const at::Tensor& scale, Fp8Format format, const at::Tensor& out,
                               const at::Tensor& out_t, const at::Tensor& scale_inv_out,
                               float* amax, bool accumulate_amax, const at::Tensor& dbias_out) {
  return cast_transpose_fused_cuda(grad, gelu_input, cuda::CastActivation::kDGelu, scale, format,
                                   out, out_t, scale_inv_out, amax, accumulate_amax, dbias_out);
}

void amax_cuda(const at::Tensor& x, const at::Tensor& amax_out) {
  const c10::cuda::CUDAGuard guard(x.device());
  AMP8_CUDA_CHECK(cuda::launch_amax(x.const_data_ptr(), input_type(x), x.numel(),
                                    amax_out.mutable_data_ptr<float>(), current_stream()));
}

void amax_many_cuda(const std::vector<at::Tensor>& xs, const at::Tensor& amax_out) {
  const c10::cuda::CUDAGuard guard(xs.front().device());
  float* amax = amax_out.mutable_data_ptr<float>();
  launch_grouped<cuda::AmaxManyTensor>(
      xs, input_type,
      [&](const at::Tensor& x) -> cuda::AmaxManyTensor { return {x.const_data_ptr(), amax++, x.numel()}; },
      [&](const cuda::AmaxManyTensor* list, int n, cuda::InputType type) {
        return cuda::launch_amax_many(list, n, type, current_stream());
      });
}

void activation_amax_cuda(AmaxActivation activation, const at::Tensor& x, const at::Tensor& gate,
                          const at::Tensor& amax_out) {
  const c10::cuda::CUDAGuard guard(x.device());
  // The kernel's activation, and the output's columns as launch_cast_transpose_fused counts them.
  auto [kind, cols] = [&]() -> std::pair<cuda::CastActivation, int64_t> {
    switch (activation) {
      case AmaxActivation::kGelu:
        return {cuda::CastActivation::kGelu, x.size(1)};
      case AmaxActivation::kDGelu:
        return {cuda::CastActivation::kDGelu, x.size(1)};
      case AmaxActivation::kSwiGlu:
        return {cuda::CastActivation::kSwiGlu, x.size(1) / 2};
      case AmaxActivation::kDSwiGlu:
        return {cuda::CastActivation::kDSwiGlu, gate.size(1)};
    }
    TORCH_INTERNAL_ASSERT(false, "activation_amax_cuda: unknown activation");
  }();
  AMP8_CUDA_CHECK(cuda::launch_activation_amax(
      x.const_data_ptr(), gate.defined() ? gate.const_data_ptr() : nullptr, input_type(x), kind,
      x.size(0), cols, amax_out.mutable_data_ptr<float>(), current_stream()));
}

void current_scale_cuda(const at::Tensor& amax, float fp8_max, float margin_divisor,
                        const at::Tensor& scale_out) {
  const c10::cuda::CUDAGuard guard(amax.device());
  AMP8_CUDA_CHECK(cuda::launch_current_scale(amax.const_data_ptr<float>(),
                                             scale_out.mutable_data_ptr<float>(), amax.numel(),
                                             fp8_max, margin_divisor, current_stream()));
}

void delayed_scaling_update_cuda(const std::vector<DelayedScalingGroup>& groups, float fp8_max,
                                 float margin_divisor, AmaxComputeAlgo algo) {
  const c10::cuda::CUDAGuard guard(groups.front().amax_history.device());
  std::vector<cuda::ScalingGroupPointers> pointers;
  pointers.reserve(groups.size());
  for (const auto& g : groups) {
    pointers.push_back({g.amax_history.mutable_data_ptr<float>(), g.scale.mutable_data_ptr<float>(),
                        g.scale_inv.mutable_data_ptr<float>(), g.amax_history.size(1)});
  }
  AMP8_CUDA_CHECK(cuda::launch_delayed_scaling_update(
      pointers.data(), static_cast<int>(pointers.size()), groups.front().amax_history.size(0),
      algo == AmaxComputeAlgo::kMostRecent, fp8_max, margin_divisor, current_stream()));
}


bool layer_norm_cuda(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                     double eps, Normalization norm, const at::Tensor& out, const at::Tensor& mean,
                     const at::Tensor& rstd, const at::Tensor& scale,
                     const at::Tensor& scale_inv_out, float* amax, bool accumulate_amax) {
  const c10::cuda::CUDAGuard guard(x.device());
  int out_fp8 = 0;
  if (out.scalar_type() == at::kFloat8_e4m3fn) out_fp8 = 1;
  if (out.scalar_type() == at::kFloat8_e5m2) out_fp8 = 2;
  const int rc = cuda::launch_layer_norm_fwd(
      x.const_data_ptr(), input_type(x), optional_ptr(gamma), optional_ptr(beta),
      weight_type(gamma, beta), x.size(0), x.size(1), static_cast<float>(eps),
      norm == Normalization::kRMSNorm, out.mutable_data_ptr(), out_fp8,
      static_cast<float*>(optional_mutable_ptr(mean)),
      rstd.mutable_data_ptr<float>(), out_fp8 ? scale.const_data_ptr<float>() : nullptr,
      out_fp8 ? scale_inv_out.mutable_data_ptr<float>() : nullptr, amax, accumulate_amax,
      current_stream());
  if (rc == cuda::kUnsupportedShape) return false;
  AMP8_CUDA_CHECK(rc);
  return true;
}

bool layer_norm_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                              Normalization norm, const at::Tensor& mean, const at::Tensor& rstd,
                              const at::Tensor& gamma, const at::Tensor& grad_residual,
                              const at::Tensor& grad_input, const at::Tensor& grad_gamma,
                              const at::Tensor& grad_beta) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), hidden = x.size(1);
  const auto weights = weight_type(gamma.defined() ? gamma : grad_gamma, grad_beta);
  const int parts = cuda::layer_norm_bwd_parts(
      grad_out.const_data_ptr(), x.const_data_ptr(), optional_ptr(grad_residual),
      grad_input.const_data_ptr(), optional_ptr(gamma), input_type(x), weights, rows, hidden,
      norm == Normalization::kRMSNorm);
  if (parts == 0) return false;
  auto workspace = at::empty({2, parts, hidden}, x.options().dtype(at::kFloat));
  const int rc = cuda::launch_layer_norm_bwd(
      grad_out.const_data_ptr(), x.const_data_ptr(), input_type(x),
      norm == Normalization::kRMSNorm, static_cast<const float*>(optional_ptr(mean)),
      rstd.const_data_ptr<float>(), optional_ptr(gamma), weights, rows, hidden,
      optional_ptr(grad_residual), grad_input.mutable_data_ptr(),
      workspace.mutable_data_ptr<float>(), parts, optional_mutable_ptr(grad_gamma),
      optional_mutable_ptr(grad_beta), current_stream());
  if (rc == cuda::kUnsupportedShape) return false;
  AMP8_CUDA_CHECK(rc);
  return true;
}

void byte_transpose_cuda(const at::Tensor& in, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(in.device());
  AMP8_CUDA_CHECK(cuda::launch_byte_transpose(in.const_data_ptr(), out.mutable_data_ptr(),
                                              in.size(0), in.size(1), current_stream()));
}

void swiglu_cuda(const at::Tensor& gate_up, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const int64_t ffn = out.size(-1);
  AMP8_CUDA_CHECK(cuda::launch_swiglu(gate_up.const_data_ptr(), input_type(gate_up),
                                      out.mutable_data_ptr(), out.numel() / ffn, ffn,
                                      current_stream()));
}

void swiglu_backward_cuda(const at::Tensor& grad, const at::Tensor& gate_up,
                          const at::Tensor& grad_gate_up) {
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const int64_t ffn = grad.size(-1);
  AMP8_CUDA_CHECK(cuda::launch_swiglu_backward(
      grad.const_data_ptr(), gate_up.const_data_ptr(), input_type(gate_up),
      grad_gate_up.mutable_data_ptr(), grad.numel() / ffn, ffn, current_stream()));
}

void rotary_embedding_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           bool inverse, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  AMP8_CUDA_CHECK(cuda::launch_rotary(
      x.const_data_ptr(), input_type(x), out.mutable_data_ptr(), x.size(0), x.size(1), x.size(2),
      x.size(3), x.stride(0), x.stride(1), x.stride(2), cos.const_data_ptr<float>(),
      sin.const_data_ptr<float>(), inverse, current_stream()));
}

void fused_adam_step_cuda(const std::vector<AdamStepTensor>& tensors, const AdamStepOptions& o,
                          double grad_multiplier) {
  const c10::cuda::CUDAGuard guard(tensors.front().param.device());
  cuda::AdamScalars scalars{};
  scalars.param_decay = o.decoupled_weight_decay && o.weight_decay != 0
                            ? static_cast<float>(1 - o.lr * o.weight_decay)
                            : 1.0f;
  scalars.weight_decay_l2 = o.decoupled_weight_decay ? 0.0f : static_cast<float>(o.weight_decay);
  scalars.beta1 = static_cast<float>(o.beta1);
  scalars.one_minus_beta1 = static_cast<float>(1 - o.beta1);
  scalars.beta2 = static_cast<float>(o.beta2);
  scalars.one_minus_beta2 = static_cast<float>(1 - o.beta2);
  scalars.eps = static_cast<float>(o.eps);
  scalars.grad_multiplier = static_cast<float>(grad_multiplier);
  launch_grouped<cuda::AdamTensorPointers>(
      tensors,
      [](const AdamStepTensor& t) {
        return std::tuple{input_type(t.grad), copy_type(t.model_copy), moment_type(t.exp_avg),
                          moment_type(t.exp_avg_sq)};
      },
      [&](const AdamStepTensor& t) -> cuda::AdamTensorPointers {
        return {t.param.mutable_data_ptr<float>(), t.exp_avg.mutable_data_ptr(),
                t.exp_avg_sq.mutable_data_ptr(), t.grad.const_data_ptr(),
                optional_mutable_ptr(t.model_copy),
                static_cast<float*>(optional_mutable_ptr(t.amax)), t.param.numel(),
                static_cast<float>(o.lr / (1 - std::pow(o.beta1, t.step))),
                static_cast<float>(std::sqrt(1 - std::pow(o.beta2, t.step))),
                t.model_copy_scale.defined() ? t.model_copy_scale.const_data_ptr<float>() : nullptr};
      },
      [&](const cuda::AdamTensorPointers* pointers, int n, const auto& types) {
        const auto [grad, copy, exp_avg, exp_avg_sq] = types;
        return cuda::launch_fused_adam(pointers, n, {grad, copy, exp_avg, exp_avg_sq}, scalars,
                                       current_stream());
      });
}

at::Tensor sum_of_squares_cuda(const std::vector<at::Tensor>& tensors) {
  const c10::cuda::CUDAGuard guard(tensors.front().device());
  constexpr int64_t kChunk = cuda::kSumOfSquaresChunk;
  int64_t chunks = 0;
  for (const auto& t : tensors) chunks += (t.numel() + kChunk - 1) / kChunk;
  const auto options = at::TensorOptions().dtype(at::kFloat).device(tensors.front().device());
  if (chunks == 0) return at::zeros({1}, options);
  const auto partials = at::empty({chunks}, options);
  // Each tensor's partials where its chunks fall in the whole list.
  float* next = partials.mutable_data_ptr<float>();
  launch_grouped<cuda::SumOfSquaresTensor>(
      tensors, input_type,
      [&](const at::Tensor& t) -> cuda::SumOfSquaresTensor {
        cuda::SumOfSquaresTensor entry{t.const_data_ptr(), next, t.numel()};
        next += (t.numel() + kChunk - 1) / kChunk;
        return entry;
      },
      [&](const cuda::SumOfSquaresTensor* list, int n, cuda::InputType type) {
        return cuda::launch_sum_of_squares(list, n, type, current_stream());
      });
  return partials.sum().reshape({1});
}

void accumulate_in_float32_cuda(const std::vector<at::Tensor>& sums, const std::vector<at::Tensor>& grads,
                                const std::vector<bool>& overwrite) {
  const c10::cuda::CUDAGuard guard(grads.front().device());
  size_t next = 0;  // launch_grouped makes the entries in the list's order
  launch_grouped<cuda::AccumulateTensor>(
      grads, input_type,
      [&](const at::Tensor& grad) -> cuda::AccumulateTensor {
        const size_t i = next++;
        return {sums[i].mutable_data_ptr<float>(), grad.const_data_ptr(), grad.numel(), overwrite[i]};
      },
      [&](const cuda::AccumulateTensor* list, int n, cuda::InputType type) {
        return cuda::launch_accumulate_in_float32(list, n, type, current_stream());
      });
}

void fused_sgd_step_cuda(const std::vector<SgdStepTensor>& tensors, const SgdStepOptions& o,
                         double grad_multiplier) {
  const c10::cuda::CUDAGuard guard(tensors.front().param.device());
  cuda::SgdScalars scalars{};
  scalars.neg_lr = static_cast<float>(-1 * o.lr);
  scalars.momentum = static_cast<float>(o.momentum);
  scalars.one_minus_dampening = static_cast<float>(1 - o.dampening);
  scalars.weight_decay = static_cast<float>(o.weight_decay);
  scalars.grad_multiplier = static_cast<float>(grad_multiplier);
  scalars.nesterov = o.nesterov;
  const bool with_momentum = o.momentum != 0;
  launch_grouped<cuda::SgdTensorPointers>(
      tensors, [](const SgdStepTensor& t) { return std::pair{input_type(t.grad), copy_type(t.model_copy)}; },
      [&](const SgdStepTensor& t) -> cuda::SgdTensorPointers {
        return {t.param.mutable_data_ptr<float>(),
                with_momentum ? t.momentum_buffer.mutable_data_ptr<float>() : nullptr,
                t.grad.const_data_ptr(), optional_mutable_ptr(t.model_copy), t.param.numel(),
                t.first_step};
      },
      [&](const cuda::SgdTensorPointers* pointers, int n, const auto& types) {
        return cuda::launch_fused_sgd(pointers, n, types.first, types.second, scalars, current_stream());
      });
}

}  // namespace amp8::detail
