#pragma once
// CUDA paths of the ops, defined in ops/cuda/*.cc when amp8 is built with CUDA
// (AMP8_WITH_CUDA). Arguments are already checked by the public entry points.

#include <ATen/ATen.h>

#include <atomic>
#include <vector>

#include "ops/blockwise.h"
#include "ops/fp8_format.h"
#include "ops/fused_adam.h"
#include "ops/fused_sgd.h"
#include "ops/layer_norm.h"
#include "ops/fp8_gemm.h"
#include "ops/fp8_tensor.h"
#include "ops/scaling.h"

namespace amp8::detail {

// Writes fp8(clamp(x * scale)) into `out` (x's shape, FP8 dtype), 1/scale into scale_inv_out,
// and max|x| into `amax` when non-null.
void quantize_cuda(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                   const at::Tensor& out, const at::Tensor& scale_inv_out, float* amax,
                   bool accumulate_amax);
// quantize_cuda's codes for each xs[i] (one dtype) into outs[i], scaled by scales[scale_index[i]];
// no amax, no scale_inv. Checked by the caller (ops/quantize.cc).
void quantize_many_cuda(const std::vector<at::Tensor>& xs, const at::Tensor& scales,
                        const std::vector<int64_t>& scale_index, Fp8Format format,
                        const std::vector<at::Tensor>& outs);
// The same plus out_t = outᵀ for a 2-D x, from one read of x. `out` may be a column block of a
// wider matrix (unit column stride, rows out.stride(0) apart); out_t is contiguous.
// With dbias_out ([cols]; float32, bfloat16 or float16) also dbias_out = Σ_rows x (summed in
// float32), from the same read where the fused
// kernel takes the shape, else by ATen after the cast.
void cast_transpose_cuda(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                         const at::Tensor& out, const at::Tensor& out_t,
                         const at::Tensor& scale_inv_out, float* amax, bool accumulate_amax,
                         const at::Tensor& dbias_out = {});
// cast_transpose_cuda of gelu(x) (tanh GELU in float32, amax of those values), in one kernel;
// false, having done nothing, where that kernel does not take the shape.
bool cast_transpose_gelu_cuda(const at::Tensor& x, const at::Tensor& scale, Fp8Format format,
                              const at::Tensor& out, const at::Tensor& out_t,
                              const at::Tensor& scale_inv_out, float* amax, bool accumulate_amax);
// The same for swiglu(gate_up) [rows, 2·ffn] → out [rows, ffn], out_t [ffn, rows].
bool cast_transpose_swiglu_cuda(const at::Tensor& gate_up, const at::Tensor& scale,
                                Fp8Format format, const at::Tensor& out, const at::Tensor& out_t,
                                const at::Tensor& scale_inv_out, float* amax,
                                bool accumulate_amax);
// The same for swiglu_backward(grad, gate_up) [rows, 2·ffn] (grad [rows, ffn]); false also
// with dbias_out defined.
bool cast_transpose_dswiglu_cuda(const at::Tensor& grad, const at::Tensor& gate_up,
                                 const at::Tensor& scale, Fp8Format format, const at::Tensor& out,
                                 const at::Tensor& out_t, const at::Tensor& scale_inv_out,
                                 float* amax, bool accumulate_amax, const at::Tensor& dbias_out);
// The same for grad · gelu'(gelu_input), with the column sums of those values into dbias_out
// when it is defined.
bool cast_transpose_dgelu_cuda(const at::Tensor& grad, const at::Tensor& gelu_input,
                               const at::Tensor& scale, Fp8Format format, const at::Tensor& out,
                               const at::Tensor& out_t, const at::Tensor& scale_inv_out,
                               float* amax, bool accumulate_amax, const at::Tensor& dbias_out);
void amax_cuda(const at::Tensor& x, const at::Tensor& amax_out);
// amax_out[i] = max|xs[i]| for each i, amax_out zeroed by the caller (compute_amax_many);
// one multi-tensor launch per 128 tensors of a dtype.
void amax_many_cuda(const std::vector<at::Tensor>& xs, const at::Tensor& amax_out);
// The activation whose values activation_amax_cuda measures: what cast_transpose_gelu_cuda /
// _dgelu_cuda / _swiglu_cuda / _dswiglu_cuda quantize.
enum class AmaxActivation { kGelu, kDGelu, kSwiGlu, kDSwiGlu };
// max|values| that the activation-fused cast of the same inputs quantizes (x: GELU's input, the
// gradient, gate/up, the gradient; `gate`: GELU's input for kDGelu, gate/up for kDSwiGlu, else
// undefined), into amax_out (float32 [1] on x's device), from one read of the inputs, the values
// themselves not written.
void activation_amax_cuda(AmaxActivation activation, const at::Tensor& x, const at::Tensor& gate,
                          const at::Tensor& amax_out);
// scale_out[i] = scale_from_amax(amax[i], 1, fp8_max, 2^margin) for every i (1-D, contiguous).
void current_scale_cuda(const at::Tensor& amax, float fp8_max, float margin_divisor,
                        const at::Tensor& scale_out);
void delayed_scaling_update_cuda(const std::vector<DelayedScalingGroup>& groups, float fp8_max,
                                 float margin_divisor, AmaxComputeAlgo algo);

// LayerNorm kernels (ops/cuda/layer_norm_kernels.cu). gamma/beta (and grad_gamma/grad_beta)
// are contiguous [hidden] or undefined, all defined ones of one dtype: float32 or x's; `out` is
// x's dtype or FP8 (then scale/scale_inv/amax are used). Return false, having done nothing but
// perhaps zeroed amax, when the fused kernels do not take the shape. RMSNorm: beta and mean
// undefined.
bool layer_norm_cuda(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                     double eps, Normalization norm, const at::Tensor& out, const at::Tensor& mean,
                     const at::Tensor& rstd, const at::Tensor& scale,
                     const at::Tensor& scale_inv_out, float* amax, bool accumulate_amax);
bool layer_norm_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                              Normalization norm, const at::Tensor& mean, const at::Tensor& rstd,
                              const at::Tensor& gamma, const at::Tensor& grad_residual,
                              const at::Tensor& grad_input, const at::Tensor& grad_gamma,
                              const at::Tensor& grad_beta);
void byte_transpose_cuda(const at::Tensor& in, const at::Tensor& out);

// Llama's elementwise ops (swiglu_kernels.cu, rotary_kernels.cu); outputs allocated by the
// caller, contiguous, in the input's dtype.
void swiglu_cuda(const at::Tensor& gate_up, const at::Tensor& out);
void swiglu_backward_cuda(const at::Tensor& grad, const at::Tensor& gate_up,
                          const at::Tensor& grad_gate_up);
void rotary_embedding_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           bool inverse, const at::Tensor& out);

// Multi-tensor Adam / AdamW (fused_adam_kernels.cu); arguments checked by fused_adam_step.
void fused_adam_step_cuda(const std::vector<AdamStepTensor>& tensors, const AdamStepOptions& options,
                          double grad_multiplier);

// Multi-tensor SGD (fused_sgd_kernels.cu); arguments checked by fused_sgd_step.
void fused_sgd_step_cuda(const std::vector<SgdStepTensor>& tensors, const SgdStepOptions& options,
                         double grad_multiplier);

// Σ x² of every tensor (sum_of_squares_kernels.cu), float32 [1]; arguments checked by
// sum_of_squares (ops/sum_of_squares.h).
at::Tensor sum_of_squares_cuda(const std::vector<at::Tensor>& tensors);

// sums[i] += grads[i] (= where overwrite[i]) in float32 (accumulate_kernels.cu); arguments
// checked by accumulate_in_float32 (ops/accumulate.h).
void accumulate_in_float32_cuda(const std::vector<at::Tensor>& sums, const std::vector<at::Tensor>& grads,
                                const std::vector<bool>& overwrite);

// Counted by the CUDA GEMM, read by fp8_gemm_candidates_timed (ops/fp8_gemm.cc).
extern std::atomic<int64_t> fp8_gemm_candidates_timed;

// cuBLASLt FP8 GEMM; arguments checked, bias already in the dtype cuBLASLt takes.
at::Tensor fp8_gemm_cuda(const Fp8Tensor& a, const Fp8Tensor& b, at::ScalarType out_dtype,
                         const Fp8GemmOptions& options);

// Blockwise FP8 (blockwise_kernels.cu): x's tiles into out / scale_inv and, when out_t is
// defined, xᵀ's into out_t / scale_inv_t, all allocated by the caller in the layouts of
// Fp8BlockwiseTensor (128×128 padding zeroed); dbias_out (checked) as quantize_blockwise's.
void quantize_blockwise_cuda(const at::Tensor& x, const BlockwiseQuantizeOptions& options,
                             const at::Tensor& out, const at::Tensor& scale_inv,
                             const at::Tensor& out_t, const at::Tensor& scale_inv_t,
                             const at::Tensor& dbias_out = {});
// quantize_blockwise_columns' per-piece launches into out / scale_inv / out_t / scale_inv_t (x's
// layouts, x = the pieces side by side; out_t defined) and dbias_out (checked; may be
// undefined): false, having launched nothing, where a piece does not take them
// (ops/blockwise.h).
bool quantize_blockwise_columns_cuda(const std::vector<at::Tensor>& pieces,
                                     const BlockwiseQuantizeOptions& options, const at::Tensor& out,
                                     const at::Tensor& scale_inv, const at::Tensor& out_t,
                                     const at::Tensor& scale_inv_t, const at::Tensor& dbias_out);
// quantize_blockwise_gelu (gelu_input undefined) or _dgelu in one kernel, outputs and
// arguments as quantize_blockwise_cuda's: false, having launched nothing, where the kernel does
// not take the shape (ops/blockwise.h).
bool quantize_blockwise_gelu_cuda(const at::Tensor& x, const at::Tensor& gelu_input,
                                  const BlockwiseQuantizeOptions& options, const at::Tensor& out,
                                  const at::Tensor& scale_inv, const at::Tensor& out_t,
                                  const at::Tensor& scale_inv_t, const at::Tensor& dbias_out);
// blockwise_shard_amax and quantize_shards_blockwise (ops/blockwise.h), arguments checked.
void blockwise_shard_amax_cuda(const std::vector<Fp8WeightShard>& shards,
                               const std::vector<at::Tensor>& amaxes);
void quantize_shards_blockwise_cuda(const std::vector<Fp8WeightShard>& shards,
                                    const std::vector<at::Tensor>& amaxes,
                                    const BlockwiseQuantizeOptions& options,
                                    const std::vector<at::Tensor>& outs,
                                    const std::vector<at::Tensor>& scale_invs);
// quantize_whole_weights_blockwise (ops/blockwise.h), arguments checked.
void quantize_whole_weights_blockwise_cuda(const std::vector<Fp8WeightShard>& shards,
                                           const BlockwiseQuantizeOptions& options,
                                           const std::vector<at::Tensor>& outs,
                                           const std::vector<at::Tensor>& scale_invs);
// cuBLASLt's block-scaled FP8 GEMM; arguments checked: bias undefined or bfloat16 [N], out /
// accumulate, nothing else.
at::Tensor fp8_blockwise_gemm_cuda(const Fp8BlockwiseTensor& a, const Fp8BlockwiseTensor& b,
                                   at::ScalarType out_dtype, const Fp8GemmOptions& options);

}  // namespace amp8::detail
