#pragma once
// Host launchers of the CUDA kernels. Plain C++: no LibTorch, no CUDA headers, so that .cu files
// stay free of LibTorch and .cc files free of kernels. Each returns a cudaError_t as int.

#include <cstdint>

struct CUstream_st;

namespace amp8::cuda {

using Stream = CUstream_st*;

// Returned by a launcher whose fused kernel does not take this shape / alignment (it launched
// nothing); the caller then computes with ATen.
inline constexpr int kUnsupportedShape = -1;

enum class InputType { kFloat, kBFloat16, kHalf };

// amax (when non-null) is overwritten with max|x|, or max-merged into when accumulate_amax
// (it must then hold a non-negative float or NaN).
int launch_quantize(const void* x, InputType type, void* out, int64_t n, const float* scale,
                    float* scale_inv, float* amax, bool accumulate_amax, bool e5m2, Stream stream);

// out [rows, cols] has rows out_stride bytes apart (0: cols; more where out is a column block
// of a wider FP8 matrix, as cast_transpose_columns writes); out_t [cols, rows] is contiguous.
int launch_cast_transpose(const void* x, InputType type, void* out, void* out_t, int64_t rows,
                          int64_t cols, const float* scale, float* scale_inv, float* amax,
                          bool accumulate_amax, bool e5m2, Stream stream, int64_t out_stride = 0);

// The same with an explicit tile width (64 or 128 columns) for tuning; launch_cast_transpose
// uses kDefaultCastTransposeTileCols.
inline constexpr int kDefaultCastTransposeTileCols = 128;  // measured: bench/results
int launch_cast_transpose_tiled(const void* x, InputType type, void* out, void* out_t, int64_t rows,
                                int64_t cols, const float* scale, float* scale_inv, float* amax,
                                bool accumulate_amax, bool e5m2, int tile_cols, Stream stream,
                                int64_t out_stride = 0);

// Rows of the float32 partial-sum workspace launch_cast_transpose_fused's dbias needs ([parts, cols]).
int64_t cast_transpose_dbias_parts(int64_t rows);

// What launch_cast_transpose_fused quantizes (TE's activation-fused casts; GELU is the tanh
// approximation, computed in float32, ops/detail/gelu_formula.h):
//   kNone  x;
//   kGelu  gelu(x): an MLP's second GEMM input straight from the first GEMM's output;
//   kDGelu x · gelu'(gate), `gate` being GELU's input (x's shape and type): the gradient of the
//          first GEMM's output from the gradient of GELU's;
//   kSwiGlu silu(x[r, c]) · x[r, cols + c] (ops/detail/elementwise_formulas.h): x is the first
//          GEMM's fused gate/up output [rows, 2·cols], gate first; `gate` is unused.
//   kDSwiGlu [d gate | d up] = swiglu_backward(x, gate) (ops/detail/elementwise_formulas.h): x is
//          the gradient of SwiGLU's output [rows, cols / 2], `gate` SwiGLU's input gate/up
//          [rows, cols]: the gradient of the first GEMM's output, both halves; no dbias.
enum class CastActivation { kNone, kGelu, kDGelu, kSwiGlu, kDSwiGlu };

// launch_cast_transpose of activation(x), with the amax of those values; with `dbias` non-null
// also dbias[c] = Σ_r activation(x)[r, c] ([cols] in dbias_type, summed in float32) from the
// same read (TE's cast_transpose_dbias / cast_transpose_dbias_dgelu): per-tile column sums into
// `part` [cast_transpose_dbias_parts(rows), cols], then launch_column_sum. Only for the fast
// shape (cols % 8 == 0, rows % 16 == 0, out_stride % 8 == 0, 16-byte aligned pointers but an
// 8-byte aligned out; kDSwiGlu: cols % 16 == 0 and every pointer 16-byte aligned) and the
// variants the layers use (kNone with dbias, kGelu, kSwiGlu and
// kDSwiGlu without, kDGelu either way); otherwise it launches nothing and returns
// kUnsupportedShape. `cols` is the output's: half of x's for kSwiGlu, twice x's for kDSwiGlu.
// out_stride as launch_cast_transpose's (kDSwiGlu: cols only).
int launch_cast_transpose_fused(const void* x, const void* gate, InputType type,
                                CastActivation activation, void* out, void* out_t, int64_t rows,
                                int64_t cols, const float* scale, float* scale_inv, float* amax,
                                bool accumulate_amax, bool e5m2, float* part, void* dbias,
                                InputType dbias_type, Stream stream, int64_t out_stride = 0);

// amax ← max|activation(x)| over the values launch_cast_transpose_fused would quantize for the
// same arguments (kGelu, kDGelu, kSwiGlu, kDSwiGlu; any shape), from one read of the inputs and
// nothing else written: current scaling's amax before the fused cast, without the activation
// written in high precision and read back. kNone: kUnsupportedShape (launch_amax measures x).
int launch_activation_amax(const void* x, const void* gate, InputType type,
                           CastActivation activation, int64_t rows, int64_t cols, float* amax,
                           Stream stream);

// out[c] = Σ_p part[p, c] over `parts` rows of float32 partial sums [parts, cols], in a fixed
// order, summed in float32 and rounded once to out_type (column_sum_kernels.cu). With `out2`,
// `part` holds a second [parts, cols] block right after the first, summed into out2 by the same
// launch (LayerNorm's dgamma and dbeta: one launch and one tail instead of two).
int launch_column_sum(const float* part, int parts, int64_t cols, void* out, InputType out_type,
                      Stream stream, void* out2 = nullptr);

int launch_amax(const void* x, InputType type, int64_t n, float* amax, Stream stream);

// scale[i] = the current-scaling scale of amax[i], i < n (detail::scale_from_amax).
int launch_current_scale(const float* amax, float* scale, int64_t n, float fp8_max,
                         float margin_divisor, Stream stream);

struct ScalingGroupPointers {
  float* amax_history;  // [history_len, slots]
  float* scale;         // [slots]
  float* scale_inv;     // [slots]
  int64_t slots;
};

// One launch per 960 groups (their pointers travel as kernel parameters).
int launch_delayed_scaling_update(const ScalingGroupPointers* groups, int num_groups,
                                  int64_t history_len, bool most_recent, float fp8_max,
                                  float margin_divisor, Stream stream);

// ---- LayerNorm (layer_norm_kernels.cu) ----
// The LayerNorm launchers return kUnsupportedShape when the row does not fit in the registers
// of one block: up to 16384 elements forward and 8192 backward when rows are 16-byte aligned,
// 4096 otherwise.

// Threads per row the forward prefers (a multiple of 32, at most 512; more when the row does
// not fit in their registers). Measured: bench/results/layer_norm_bench.jsonl.
inline constexpr int kDefaultLayerNormThreads = 128;

// gamma and beta (and dgamma and dbeta) are in `weight_type`: float32 or x's own type, read and
// written as they are (the kernels compute in float32 either way; any other pairing is
// cudaErrorInvalidValue).

// One row of x [rows, hidden] per block: mean/rstd (float32 [rows]) and the normalized output
// into `out` in x's type (out_fp8 = 0) or FP8 E4M3 (1) / E5M2 (2) with *scale, writing
// 1/scale into scale_inv and max|y| into amax (both required for FP8; amax max-merged with
// accumulate_amax). gamma/beta are [hidden] or null. rms_norm: RMSNorm (the mean is taken as
// 0 and not written: `mean` may be null; beta must be null).
int launch_layer_norm_fwd(const void* x, InputType type, const void* gamma, const void* beta,
                          InputType weight_type, int64_t rows, int64_t hidden, float eps,
                          bool rms_norm, void* out,
                          int out_fp8, float* mean, float* rstd, const float* scale,
                          float* scale_inv, float* amax, bool accumulate_amax, Stream stream,
                          int preferred_threads = kDefaultLayerNormThreads);

// Rows of the float32 partial-sum workspace launch_layer_norm_bwd needs (its `part` holds
// 2 × parts × hidden floats); 0 when the fused kernel does not take this shape.
// The pointers and rms_norm are those launch_layer_norm_bwd will get (their alignment picks the
// plan; rms_norm and whether dresidual is null the kernel instance, whose registers decide how
// many blocks are resident).
int layer_norm_bwd_parts(const void* dy, const void* x, const void* dresidual, const void* dx,
                         const void* gamma, InputType type, InputType weight_type, int64_t rows,
                         int64_t hidden, bool rms_norm);

// dx (x's type) from dy (x's type); dgamma/dbeta ([hidden], either may be null). rms_norm:
// RMSNorm's gradient (mean unread, may be null; dbeta must be null). dresidual (x's type and
// shape, or null) is added to dx in float32 before its rounding.
// `parts` blocks each sum dgamma/dbeta over a grid-strided share of the rows into `part`
// [2, parts, hidden] (float32), then launch_column_sum adds them up. layer_norm_bwd_parts gives
// at most one wave of resident blocks of at least 16 rows each; any parts >= 1 is correct (the
// benchmark sweeps it).
int launch_layer_norm_bwd(const void* dy, const void* x, InputType type, bool rms_norm,
                          const float* mean, const float* rstd, const void* gamma,
                          InputType weight_type, int64_t rows, int64_t hidden,
                          const void* dresidual, void* dx, float* part, int parts,
                          void* dgamma, void* dbeta, Stream stream);

// out [cols, rows] = in [rows, cols]ᵀ, bytes (byte_transpose_kernels.cu).
int launch_byte_transpose(const void* in, void* out, int64_t rows, int64_t cols, Stream stream);

// SwiGLU over gate_up [rows, 2·ffn] (gate first) into out [rows, ffn], and its gradient for
// grad [rows, ffn] into grad_gate_up [rows, 2·ffn]; all of one type, contiguous (ops/swiglu.h).
int launch_swiglu(const void* gate_up, InputType type, void* out, int64_t rows, int64_t ffn,
                  Stream stream);
int launch_swiglu_backward(const void* grad, const void* gate_up, InputType type,
                           void* grad_gate_up, int64_t rows, int64_t ffn, Stream stream);

// Rotary embeddings of x [batch, seq, heads, head_dim] (strides in elements, the last one 1)
// into contiguous out of x's type; cos / sin float32 [seq, head_dim / 2] (ops/rotary.h).
int launch_rotary(const void* x, InputType type, void* out, int64_t batch, int64_t seq,
                  int64_t heads, int64_t head_dim, int64_t stride_batch, int64_t stride_seq,
                  int64_t stride_head, const float* cos, const float* sin, bool inverse,
                  Stream stream);

// ---- Fused Adam / AdamW with FP32 master weights (fused_adam_kernels.cu) ----
// The dtype an Adam moment is stored in (Megatron-Core's exp_avg_dtype / exp_avg_sq_dtype); the
// update itself is float32 either way.
enum class MomentType { kFloat, kBFloat16 };
struct AdamTensorPointers {
  float* param;          // FP32 master, updated in place
  void* exp_avg;         // the launch's exp_avg type, in place
  void* exp_avg_sq;      // the launch's exp_avg_sq type, in place
  const void* grad;      // the launch's grad type
  void* model_copy;      // the launch's copy type, or null
  float* amax;           // max|param| after the step, accumulated (zeroed by the caller), or null
  int64_t numel;
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  // CopyType::kFloat8E4M3: the copy's scale (copy = E4M3(param · *copy_scale), saturated at
  // ±448, as quantize writes it); null otherwise.
  const float* copy_scale;
};
struct AdamScalars {
  float param_decay;      // AdamW: 1 - lr·weight_decay (1 = none)
  float weight_decay_l2;  // Adam: grad += weight_decay_l2·param (0 = none)
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float grad_multiplier;  // every gradient is multiplied by it first
};
// kFloat8E4M3: Adam only (an FP8 weight written in the step's own pass at the scale it has).
enum class CopyType { kNone, kBFloat16, kHalf, kFloat8E4M3 };
// The types every tensor of one fused Adam call has.
struct AdamLaunchTypes {
  InputType grad;
  CopyType copy;
  MomentType exp_avg, exp_avg_sq;
};
// One launch per 128 tensors.
int launch_fused_adam(const AdamTensorPointers* tensors, int num_tensors, const AdamLaunchTypes& types,
                      const AdamScalars& scalars, Stream stream);

// ---- Many tensors quantized in one launch (quantize_kernels.cu, over multi_tensor_apply) ----
struct QuantizeManyTensor {
  const void* x;       // the launch's input type
  uint8_t* out;        // its FP8 codes, numel bytes
  const float* scale;  // its scale (one float32 on the device)
  int64_t numel;
};
struct QuantizeManyScalars {
  bool e5m2;
};
// Each tensor's bytes as launch_quantize writes them (no amax, no scale_inv); one launch per
// 128 tensors.
int launch_quantize_many(const QuantizeManyTensor* tensors, int num_tensors, InputType type,
                         const QuantizeManyScalars& scalars, Stream stream);

// ---- max|x| of many tensors (quantize_kernels.cu, over multi_tensor_apply) ----
struct AmaxManyTensor {
  const void* x;  // the launch's input type
  float* amax;    // zeroed by the caller; max-merged into (NaN wins)
  int64_t numel;
};
struct AmaxManyScalars {};
// One launch per 128 tensors.
int launch_amax_many(const AmaxManyTensor* tensors, int num_tensors, InputType type, Stream stream);

// ---- Σ x² over many tensors (sum_of_squares_kernels.cu, over multi_tensor_apply) ----
// Elements per chunk: each chunk's sum is one float32 partial (multi_tensor::kChunk).
constexpr int64_t kSumOfSquaresChunk = 4096;
struct SumOfSquaresTensor {
  const void* x;    // the launch's input type
  float* partials;  // one per chunk of x, in chunk order
  int64_t numel;
};
struct SumOfSquaresScalars {};
// Each chunk's Σ x² (float32, a fixed order) into its partial; one launch per 128 tensors.
int launch_sum_of_squares(const SumOfSquaresTensor* tensors, int num_tensors, InputType type,
                          Stream stream);

// ---- Float32 sums of many gradients (accumulate_kernels.cu, over multi_tensor_apply) ----
struct AccumulateTensor {
  float* sum;        // float32, in place
  const void* grad;  // the launch's input type
  int64_t numel;
  bool overwrite;    // sum = grad (the sum's first micro-batch) instead of sum += grad
};
struct AccumulateScalars {};
// One launch per 128 tensors.
int launch_accumulate_in_float32(const AccumulateTensor* tensors, int num_tensors, InputType type, Stream stream);

// ---- Fused SGD with FP32 master weights (fused_sgd_kernels.cu) ----
struct SgdTensorPointers {
  float* param;            // FP32 master, updated in place
  float* momentum_buffer;  // FP32, in place; null without momentum
  const void* grad;        // the launch's grad type
  void* model_copy;        // the launch's copy type, or null
  int64_t numel;
  bool first_step;  // the buffer's first step: buffer = d, its contents not read
};
struct SgdScalars {
  float neg_lr;               // param += neg_lr · d
  float momentum;             // 0 = none
  float one_minus_dampening;  // 1 - dampening
  float weight_decay;         // d += weight_decay · param (0 = none)
  float grad_multiplier;      // every gradient is multiplied by it first
  bool nesterov;
};
// One launch per 128 tensors; every tensor of the call has grads of `grad_type` and copies of
// `copy_type`.
int launch_fused_sgd(const SgdTensorPointers* tensors, int num_tensors, InputType grad_type,
                     CopyType copy_type, const SgdScalars& scalars, Stream stream);

// Blockwise FP8 (blockwise_kernels.cu): the tile scales of ops/blockwise.h (blockwise_scale),
// byte for byte as its CPU reference.
struct BlockwiseScaling {
  bool e5m2 = false;
  bool power_of_2 = true;
  float amax_epsilon = 0.0f;
};
// x [rows, cols] in 1×128 row tiles into out [rows, cols] with scale_inv [ceil(cols/128), rows];
// with out_t non-null also xᵀ [cols, rows] in its own 1×128 tiles, scale_inv_t
// [ceil(rows/128), cols].
// With `dbias` non-null also dbias[c] = Σ_r x[r, c] ([cols] in dbias_type, summed in float32)
// from the same read: per-tile column sums into `dbias_part` [quantize_1x128_dbias_parts(rows),
// cols], then launch_column_sum. Only with xᵀ, for bfloat16 or float16 x and the fast shape
// (cols % 8 == 0, rows % 16 == 0, 16-byte aligned x and out_t); otherwise it launches nothing
// and returns kUnsupportedShape.
int launch_quantize_1x128(const void* x, InputType type, int64_t rows, int64_t cols,
                          BlockwiseScaling scaling, void* out, float* scale_inv, void* out_t,
                          float* scale_inv_t, Stream stream, float* dbias_part = nullptr,
                          void* dbias = nullptr, InputType dbias_type = InputType::kFloat);
// launch_quantize_1x128 with xᵀ of activation(x): kGelu gelu(x), kDGelu x · gelu'(gate) (`gate`
// GELU's input, x's shape and type, 16-byte aligned), each value rounded to x's type before it is
// quantized, from one read of x (and gate); dbias (kDGelu only) the column sums of those rounded
// values, as launch_quantize_1x128's. Only where launch_quantize_1x128 sums columns
// (quantize_1x128_sums_columns); otherwise, and for other activations, it launches nothing and
// returns kUnsupportedShape.
int launch_quantize_1x128_activation(const void* x, const void* gate, InputType type,
                                     CastActivation activation, int64_t rows, int64_t cols,
                                     BlockwiseScaling scaling, void* out, float* scale_inv,
                                     void* out_t, float* scale_inv_t, Stream stream,
                                     float* dbias_part = nullptr, void* dbias = nullptr,
                                     InputType dbias_type = InputType::kFloat);
// launch_quantize_1x128 with xᵀ (and dbias) for an x [rows, width] that is `count` column
// pieces, pieces[i] [rows, piece_cols[i]] row-major, side by side: the outputs are x's, each
// piece's tiles written in place by its own launch, so x is never assembled. Only where every
// piece takes the fast shape (quantize_1x128_sums_columns) and every piece but the last has
// piece_cols % 128 == 0 (no tile spans two pieces); otherwise it launches nothing and returns
// kUnsupportedShape.
int launch_quantize_1x128_columns(const void* const* pieces, const int64_t* piece_cols, int count,
                                  InputType type, int64_t rows, BlockwiseScaling scaling,
                                  void* out, float* scale_inv, void* out_t, float* scale_inv_t,
                                  Stream stream, float* dbias_part = nullptr, void* dbias = nullptr,
                                  InputType dbias_type = InputType::kFloat);
// Rows of launch_quantize_1x128's dbias_part: one per 128-row tile.
int64_t quantize_1x128_dbias_parts(int64_t rows);
// Whether launch_quantize_1x128 sums the columns of this x (its dbias shape, above).
bool quantize_1x128_sums_columns(InputType type, int64_t rows, int64_t cols, const void* x,
                                 const void* out_t);
// x in 128×128 blocks: out [rows, cols], scale_inv of block (i, j) at i·scale_ld + j; with out_t
// non-null also xᵀ [cols, rows] with the same scales at j·scale_ld_t + i.
int launch_quantize_128x128(const void* x, InputType type, int64_t rows, int64_t cols,
                            BlockwiseScaling scaling, void* out, float* scale_inv,
                            int64_t scale_ld, void* out_t, float* scale_inv_t, int64_t scale_ld_t,
                            Stream stream);
// A part of a 2-D weight [rows, cols], its row-major elements [offset, offset + numel), for the
// two launchers below: `amax` its [ceil(rows/128), ceil(cols/128)] block amaxes, `out` (numel
// bytes) and `scale_inv` (the weight's 128×128 grid, row stride scale_ld) what quantizing writes.
struct BlockwiseShard {
  const void* values = nullptr;
  int64_t rows = 0, cols = 0, offset = 0, numel = 0;
  float* amax = nullptr;
  void* out = nullptr;
  float* scale_inv = nullptr;
  int64_t scale_ld = 0;
};
// max|x| of each shard's elements in each 128×128 block, maxed into its `amax`; one launch per
// 64 shards (all of one input type).
int launch_blockwise_shard_amax(const BlockwiseShard* shards, int count, InputType type,
                                Stream stream);
// Each shard's elements quantized with its blocks' scales (from `amax`), and every block's
// scale_inv of its weight written.
int launch_quantize_shards_blockwise(const BlockwiseShard* shards, int count, InputType type,
                                     BlockwiseScaling scaling, Stream stream);

}  // namespace amp8::cuda
