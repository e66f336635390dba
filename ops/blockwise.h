#pragma once
// Blockwise FP8 (Transformer Engine's Float8BlockScaling, DeepSeek-V3's recipe): one float32
// scale per tile of 1×128 elements (activations, gradients) or 128×128 elements (weights), and
// the GEMM that reads two such tensors through cuBLASLt's block-scaled modes (sm_90, cuBLAS ≥
// 12.9).

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "ops/fp8_format.h"
#include "ops/fp8_gemm.h"

namespace amp8 {

/// The elements one scale covers: 1×128 along a row, or a 128×128 block.
enum class Fp8BlockShape { k1x128, k128x128 };

/// Tile edge of the block shapes.
inline constexpr int64_t kFp8BlockLen = 128;

/// How tiles are scaled; defaults are TE's Float8BlockScaling.
struct BlockwiseQuantizeOptions {
  Fp8BlockShape block = Fp8BlockShape::k1x128;
  Fp8Format format = Fp8Format::kE4M3;
  /// Round each scale down to a power of two (its mantissa bits cleared), so that scaling and
  /// unscaling are exact. Default: true.
  bool power_of_2_scales = true;
  /// A tile's amax is at least this (≥ 0). Default: 0.
  double amax_epsilon = 0.0;
};

/// An FP8 tensor [rows, cols] with one scale_inv per tile (x ≈ float(data) · scale_inv of its
/// tile), laid out as cuBLASLt's block-scaled modes read it:
///   1×128:   scale_inv [ceil(cols/128), rows], float32, rows contiguous (VEC128_32F);
///   128×128: scale_inv [ceil(rows/128), round_up(ceil(cols/128), 4)], float32, the padding
///            columns zero (BLK128x128_32F).
struct Fp8BlockwiseTensor {
  at::Tensor data;
  at::Tensor scale_inv;
  Fp8Format format = Fp8Format::kE4M3;
  Fp8BlockShape block = Fp8BlockShape::k1x128;

  bool defined() const { return data.defined(); }
  /// float(data) · scale_inv of each element's tile, in float32, returned as `dtype`.
  at::Tensor dequantize(at::ScalarType dtype = at::kFloat) const;
};

/// How the blockwise recipe quantizes a weight (TE's Float8BlockScaling): 128×128 blocks in
/// `format` (E4M3, the forward format of "hybrid" and "e4m3"), power-of-two scales.
inline BlockwiseQuantizeOptions weight_block_options(Fp8Format format = Fp8Format::kE4M3) {
  BlockwiseQuantizeOptions options;
  options.block = Fp8BlockShape::k128x128;
  options.format = format;
  return options;
}

/// scale_inv's shape for a [rows, cols] tensor in `block` tiles.
std::vector<int64_t> blockwise_scale_shape(int64_t rows, int64_t cols, Fp8BlockShape block);

/// [ceil(rows/128), ceil(cols/128)]: one amax per 128×128 block of a rows × cols weight, the
/// grid blockwise_shard_amax fills and quantize_shards_blockwise reads.
std::vector<int64_t> blockwise_amax_shape(int64_t rows, int64_t cols);

/// A tile's scale from its amax (TE's compute_scale_from_amax): amax raised to `amax_epsilon`;
/// scale = fp8_max / amax (float32, rounded to nearest); 1 where amax is 0, infinite or NaN;
/// float32's largest value where the quotient overflows; then, with power_of_2_scales, the
/// mantissa cleared. The CUDA kernels compute exactly this.
float blockwise_scale(float amax, const BlockwiseQuantizeOptions& options);

/// x and xᵀ, each quantized from x's values (never one from the other's FP8 bytes).
struct Fp8BlockwiseCastTranspose {
  Fp8BlockwiseTensor data;        ///< [rows, cols]
  Fp8BlockwiseTensor transposed;  ///< [cols, rows]; undefined unless asked for
};

/// Quantizes a 2-D x [rows, cols] (float32, bfloat16 or float16) tile by tile: a tile's amax is
/// max|x| over its elements (a NaN does not count, as fmaxf's; partial tiles at the edges cover
/// what is there), its scale blockwise_scale(amax), each element fp8(clamp(x · scale)) (NaN
/// stays NaN). With `transposed`, also xᵀ [cols, rows]: for 1×128 tiles quantized in its own
/// tiles (128 consecutive rows of one column of x); for 128×128 tiles the same blocks, so the
/// same scales, transposed. rows and cols may be any positive size.
/// CUDA and CPU give the same bytes.
/// `dbias_out`, when defined (a contiguous [cols] tensor on x's device, float32, bfloat16 or
/// float16: the bias's own dtype), receives Σ_rows x, summed in float32 and rounded once: a
/// layer's bias gradient from the read that quantizes its output gradient (TE's
/// cast_transpose_dbias). On the GPU the quantizing kernel sums where it can (1×128 tiles with
/// the transpose, bfloat16 or float16 x, rows % 16 == 0, cols % 8 == 0, x's data 16-byte
/// aligned), in its own order; elsewhere LibTorch's column sum does.
Fp8BlockwiseCastTranspose quantize_blockwise(const at::Tensor& x,
                                             const BlockwiseQuantizeOptions& options,
                                             bool transposed = false,
                                             const at::Tensor& dbias_out = {});

/// quantize_blockwise in 1×128 tiles of the column-wise concatenation [x_0 | x_1 | …] of
/// `pieces` (2-D, one row count, dtype and device; float32, bfloat16 or float16) without writing
/// the concatenation where it can: the same bytes, scales and dbias_out ([Σ cols_i]) as
/// quantize_blockwise(at::cat(pieces, 1), options, transposed, dbias_out). A layer's output
/// gradient that arrives in pieces (attention's dq, dk and dv, for the QKV projection) goes into
/// the block-scaled GEMMs without a concatenating copy. options.block must be 1×128. CUDA: each
/// piece's tiles by their own launch of the staged kernel, written in place, where `transposed`
/// is asked for and every piece takes that kernel (bfloat16 or float16, contiguous, 16-byte
/// aligned, rows % 16 == 0, cols % 8 == 0) and every piece but the last has cols % 128 == 0, so
/// that no tile spans two pieces; elsewhere the concatenation, then quantize_blockwise.
Fp8BlockwiseCastTranspose quantize_blockwise_columns(const std::vector<at::Tensor>& pieces,
                                                     const BlockwiseQuantizeOptions& options,
                                                     bool transposed = false,
                                                     const at::Tensor& dbias_out = {});

/// quantize_blockwise of gelu(x), GELU's tanh approximation (ops/detail/gelu_formula.h) computed
/// in float32 and rounded to x's dtype: the bytes of writing the activation in x's precision and
/// then quantizing it, which is how TE quantizes an activation for its blockwise recipe, but from
/// one read of x, with nothing written in high precision: the FP8 input of an MLP's second GEMM
/// (and with `transposed` its weight gradient's operand) from the first GEMM's output.
/// CUDA: one kernel for 1×128 tiles with the transpose, bfloat16 or float16 x, rows % 16 == 0,
/// cols % 8 == 0 and 16-byte aligned data; elsewhere LibTorch's GELU written in x's dtype, then
/// quantize_blockwise (its tanh is computed another way: a value may round differently).
Fp8BlockwiseCastTranspose quantize_blockwise_gelu(const at::Tensor& x,
                                                  const BlockwiseQuantizeOptions& options,
                                                  bool transposed = false);

/// quantize_blockwise of grad · gelu'(gelu_input) (the tanh approximation's derivative, float32,
/// rounded to grad's dtype): the FP8 gradient of an MLP's first GEMM output from one read of
/// `grad` (the gradient of GELU's output) and `gelu_input` (GELU's input: grad's shape and dtype,
/// contiguous). `dbias_out` as quantize_blockwise's: the column sums of those rounded values (the
/// first GEMM's bias gradient), from the same read where the kernel runs. CUDA: as
/// quantize_blockwise_gelu, with gelu_input 16-byte aligned too; elsewhere LibTorch's GELU
/// backward written in grad's dtype, then quantize_blockwise.
Fp8BlockwiseCastTranspose quantize_blockwise_dgelu(const at::Tensor& grad,
                                                   const at::Tensor& gelu_input,
                                                   const BlockwiseQuantizeOptions& options,
                                                   bool transposed = false,
                                                   const at::Tensor& dbias_out = {});

/// A part of a 2-D weight [rows, cols]: its row-major elements [offset, offset + numel), e.g.
/// the shard of it one data-parallel rank holds (Megatron's distributed optimizer cuts the
/// flattened weights anywhere); all of it is offset 0 and rows · cols elements.
struct Fp8WeightShard {
  at::Tensor values;  ///< 1-D, contiguous; float32, bfloat16 or float16
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t offset = 0;
};

/// For each shard, max|x| over its elements in every 128×128 block of its weight, maxed into
/// amaxes[i] (float32 [ceil(rows/128), ceil(cols/128)], contiguous, on the shard's device;
/// blocks it does not reach keep what they hold; a NaN does not count, as in
/// quantize_blockwise). Zeros, this on every rank and an all-reduce MAX give each block's amax
/// over the whole weight. CUDA: one launch per 64 shards.
void blockwise_shard_amax(const std::vector<Fp8WeightShard>& shards,
                          const std::vector<at::Tensor>& amaxes);

/// The shards quantized in 128×128 blocks, each block scaled by blockwise_scale(amaxes[i] of
/// the block, options) (options.block must be 128×128): outs[i] (1-D, the shard's numel,
/// options.format's dtype) receives the bytes quantize_blockwise(weight, options) writes at the
/// shard's positions when amaxes[i] are the whole weight's block amaxes, and scale_invs[i] (the
/// weight's 128×128 scale_inv, blockwise_scale_shape(rows, cols)) every block's 1/scale (its
/// padding columns are not written). CUDA and CPU give the same bytes.
void quantize_shards_blockwise(const std::vector<Fp8WeightShard>& shards,
                               const std::vector<at::Tensor>& amaxes,
                               const BlockwiseQuantizeOptions& options,
                               const std::vector<at::Tensor>& outs,
                               const std::vector<at::Tensor>& scale_invs);

/// blockwise_shard_amax into zeroed amaxes, then quantize_shards_blockwise, for shards that each
/// hold a whole weight (offset 0, rows · cols elements), whose blocks need no other rank's amax:
/// the same bytes in outs and scale_invs. A part of a weight is an error. CUDA: one read of each
/// weight (the 128×128 kernel of quantize_blockwise, writing into outs), where the two calls
/// read it twice; one launch per weight.
void quantize_whole_weights_blockwise(const std::vector<Fp8WeightShard>& shards,
                                      const BlockwiseQuantizeOptions& options,
                                      const std::vector<at::Tensor>& outs,
                                      const std::vector<at::Tensor>& scale_invs);

/// A weight in 128×128 blocks, transposed: the bytes (a byte transpose) and the scale grid, so
/// Wᵀ [cols, rows] has exactly W's blocks (what dgrad reads of a weight stored in blocks).
Fp8BlockwiseTensor transpose_blocks(const Fp8BlockwiseTensor& w);

/// y [M, N] = a [M, K] · b [N, K]ᵀ with each operand's tile scales (the TN GEMM of
/// fp8_gemm): a in 1×128 tiles, b in 1×128 or 128×128 tiles (two 128×128 operands are not a
/// mode of cuBLASLt); E5M2 × E5M2 is not supported. out_dtype float32 or bfloat16. Of
/// Fp8GemmOptions: `bias` [N] (any float dtype, added in bfloat16 as fp8_gemm adds it), `out`
/// and `accumulate` (out += a·bᵀ), `residual` (as fp8_gemm's); not use_fast_accum (the
/// block-scaled modes accumulate in full) nor an FP8 output.
/// CUDA: cuBLASLt's block-scaled modes (sm_90 and cuBLAS ≥ 12.9); K a multiple of 16, M and N
/// multiples of 8. CPU: the tiles dequantized exactly and multiplied in float32, with the same
/// shape rules.
at::Tensor fp8_blockwise_gemm(const Fp8BlockwiseTensor& a, const Fp8BlockwiseTensor& b,
                              at::ScalarType out_dtype, const Fp8GemmOptions& options = {});

}  // namespace amp8
