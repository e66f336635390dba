// Blockwise FP8: argument checks, the CPU reference of the tile quantization and of the
// block-scaled GEMM, and the dispatch to the CUDA paths.
#include "ops/blockwise.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "ops/detail/checks.h"
#include "ops/detail/cuda_ops.h"
#include "ops/detail/fp8_cpu.h"
#include "ops/detail/gelu_values.h"
#include "ops/detail/row_sum.h"

namespace amp8 {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

const char* block_name(Fp8BlockShape block) {
  return block == Fp8BlockShape::k1x128 ? "1x128" : "128x128";
}

void check_blockwise(const Fp8BlockwiseTensor& t, const char* name) {
  TORCH_CHECK(t.data.defined() && t.data.dim() == 2, "fp8_blockwise_gemm: ", name,
              " must be a 2-D blockwise FP8 tensor");
  TORCH_CHECK(t.data.scalar_type() == fp8_dtype(t.format), "fp8_blockwise_gemm: ", name,
              ".data must be ", fp8_dtype(t.format), " (its format), got ", t.data.scalar_type());
  const auto shape = blockwise_scale_shape(t.data.size(0), t.data.size(1), t.block);
  TORCH_CHECK(t.scale_inv.defined() && t.scale_inv.scalar_type() == at::kFloat &&
                  t.scale_inv.sizes() == at::IntArrayRef(shape) && t.scale_inv.is_contiguous(),
              "fp8_blockwise_gemm: ", name, ".scale_inv must be contiguous float32 ",
              at::IntArrayRef(shape), " for ", block_name(t.block), " tiles of ",
              t.data.sizes(), ", got ",
              t.scale_inv.defined() ? t.scale_inv.sizes() : at::IntArrayRef{});
  TORCH_CHECK(t.data.is_contiguous(), "fp8_blockwise_gemm: ", name, ".data must be contiguous");
}

template <typename In, typename Fp8T>
void quantize_tiles_cpu(const In* x, int64_t rows, int64_t cols, int64_t tile_rows,
                        int64_t tile_cols, const BlockwiseQuantizeOptions& options,
                        Fp8T* out, float* scale_inv, int64_t scale_row_stride,
                        int64_t scale_col_stride) {
  const float max = fp8_max(options.format);
  for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
    for (int64_t c0 = 0; c0 < cols; c0 += tile_cols) {
      const int64_t r1 = std::min(rows, r0 + tile_rows), c1 = std::min(cols, c0 + tile_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          amax = std::fmax(amax, std::fabs(static_cast<float>(x[r * cols + c])));
      const float scale = blockwise_scale(amax, options);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          out[r * cols + c] =
              detail::saturating_cast_cpu<Fp8T>(static_cast<float>(x[r * cols + c]), scale, max);
      scale_inv[(r0 / tile_rows) * scale_row_stride + (c0 / tile_cols) * scale_col_stride] =
          1.0f / scale;
    }
  }
}

// x [rows, cols] in `tile_rows` × `tile_cols` tiles; scale_inv of tile (i, j) at
// i·scale_row_stride + j·scale_col_stride.
void quantize_cpu(const at::Tensor& x, int64_t tile_rows, int64_t tile_cols,
                  const BlockwiseQuantizeOptions& options, const at::Tensor& out,
                  const at::Tensor& scale_inv, int64_t scale_row_stride,
                  int64_t scale_col_stride) {
  const int64_t rows = x.size(0), cols = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_blockwise",
                                  [&] {
    const auto* in = x.const_data_ptr<scalar_t>();
    float* s = scale_inv.mutable_data_ptr<float>();
    if (options.format == Fp8Format::kE4M3) {
      quantize_tiles_cpu(in, rows, cols, tile_rows, tile_cols, options,
                         out.mutable_data_ptr<c10::Float8_e4m3fn>(), s, scale_row_stride,
                         scale_col_stride);
    } else {
      quantize_tiles_cpu(in, rows, cols, tile_rows, tile_cols, options,
                         out.mutable_data_ptr<c10::Float8_e5m2>(), s, scale_row_stride,
                         scale_col_stride);
    }
  });
}

}  // namespace

std::vector<int64_t> blockwise_amax_shape(int64_t rows, int64_t cols) {
  return {ceil_div(rows, kFp8BlockLen), ceil_div(cols, kFp8BlockLen)};
}

std::vector<int64_t> blockwise_scale_shape(int64_t rows, int64_t cols, Fp8BlockShape block) {
  if (block == Fp8BlockShape::k1x128) return {ceil_div(cols, kFp8BlockLen), rows};
  return {ceil_div(rows, kFp8BlockLen), round_up(ceil_div(cols, kFp8BlockLen), 4)};
}

float blockwise_scale(float amax, const BlockwiseQuantizeOptions& options) {
  const auto epsilon = static_cast<float>(options.amax_epsilon);
  if (amax < epsilon) amax = epsilon;
  if (amax == 0.0f || !std::isfinite(amax)) return 1.0f;
  float scale = fp8_max(options.format) / amax;
  if (std::isinf(scale)) scale = FLT_MAX;
  if (options.power_of_2_scales) {
    uint32_t bits;
    std::memcpy(&bits, &scale, sizeof(bits));
    bits &= 0xFF800000u;  // sign and exponent: 2^floor(log2(scale))
    std::memcpy(&scale, &bits, sizeof(bits));
  }
  return scale;
}

at::Tensor Fp8BlockwiseTensor::dequantize(at::ScalarType dtype) const {
  TORCH_CHECK(data.defined() && data.dim() == 2,
              "Fp8BlockwiseTensor::dequantize: data must be a 2-D FP8 tensor");
  const int64_t rows = data.size(0), cols = data.size(1);
  // Each element's scale, expanded from the tiles (row r, column c).
  const auto r = at::arange(rows, data.options().dtype(at::kLong)).unsqueeze(1);
  const auto c = at::arange(cols, data.options().dtype(at::kLong)).unsqueeze(0);
  at::Tensor index;
  const auto c_block = at::div(c, kFp8BlockLen, "floor");
  if (block == Fp8BlockShape::k1x128) {
    index = c_block * rows + r;
  } else {
    index = at::div(r, kFp8BlockLen, "floor") * round_up(ceil_div(cols, kFp8BlockLen), 4) +
            c_block;
  }
  const auto scales = scale_inv.reshape({-1}).index_select(0, index.reshape({-1}));
  return (data.to(at::kFloat) * scales.reshape({rows, cols})).to(dtype);
}

namespace {

// `name`: what the caller calls x.
void check_quantize_input(const at::Tensor& x, const BlockwiseQuantizeOptions& options,
                          const at::Tensor& dbias_out, const char* op, const char* name = "x") {
  TORCH_CHECK(x.defined() && x.dim() == 2 && x.size(0) > 0 && x.size(1) > 0, op, ": ", name,
              " must be a non-empty 2-D tensor, got ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              op, ": ", name, " must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(options.amax_epsilon >= 0 && std::isfinite(options.amax_epsilon), op,
              ": amax_epsilon must be finite and >= 0, got ", options.amax_epsilon);
  if (dbias_out.defined()) detail::check_dbias_out(dbias_out, x, op);
}

// The outputs of quantize_blockwise for an x [rows, cols] on `device`, allocated (scale grids
// zeroed: the 128×128 grid's padding columns stay zero).
Fp8BlockwiseCastTranspose empty_result(int64_t rows, int64_t cols, const at::Device& device,
                                       const BlockwiseQuantizeOptions& options, bool transposed) {
  const auto fp8_options = at::TensorOptions(device).dtype(fp8_dtype(options.format));
  const auto float_options = at::TensorOptions(device).dtype(at::kFloat);
  Fp8BlockwiseCastTranspose result;
  result.data = {at::empty({rows, cols}, fp8_options),
                 at::zeros(blockwise_scale_shape(rows, cols, options.block), float_options),
                 options.format, options.block};
  if (transposed) {
    result.transposed = {at::empty({cols, rows}, fp8_options),
                         at::zeros(blockwise_scale_shape(cols, rows, options.block), float_options),
                         options.format, options.block};
  }
  return result;
}

// quantize_blockwise_gelu (gelu_input undefined) and quantize_blockwise_dgelu.
Fp8BlockwiseCastTranspose quantize_gelu_values(const at::Tensor& x, const at::Tensor& gelu_input,
                                               const BlockwiseQuantizeOptions& options,
                                               bool transposed, const at::Tensor& dbias_out,
                                               const char* op) {
  check_quantize_input(x, options, dbias_out, op);
  const auto in = x.contiguous();
  if (gelu_input.defined()) detail::check_gelu_input(in, gelu_input, op);
  if (in.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    auto result = empty_result(in.size(0), in.size(1), in.device(), options, transposed);
    if (detail::quantize_blockwise_gelu_cuda(in, gelu_input, options, result.data.data,
                                             result.data.scale_inv, result.transposed.data,
                                             result.transposed.scale_inv, dbias_out)) {
      return result;
    }
    // A shape the one-read kernel does not take: LibTorch's GELU (tanh computed its own way, so
    // a value may land a float32 ulp apart), written in x's dtype, then quantized.
    const auto values = gelu_input.defined()
                            ? at::gelu_backward(in.to(at::kFloat), gelu_input.to(at::kFloat), "tanh")
                            : at::gelu(in.to(at::kFloat), "tanh");
    return quantize_blockwise(values.to(in.scalar_type()), options, transposed, dbias_out);
#else
    detail::no_cuda(op);
#endif
  }
  return quantize_blockwise(detail::gelu_values_cpu(in, gelu_input).to(in.scalar_type()), options,
                            transposed, dbias_out);
}

}  // namespace

Fp8BlockwiseCastTranspose quantize_blockwise_gelu(const at::Tensor& x,
                                                  const BlockwiseQuantizeOptions& options,
                                                  bool transposed) {
  return quantize_gelu_values(x, {}, options, transposed, {}, "quantize_blockwise_gelu");
}

Fp8BlockwiseCastTranspose quantize_blockwise_dgelu(const at::Tensor& grad,
                                                   const at::Tensor& gelu_input,
                                                   const BlockwiseQuantizeOptions& options,
                                                   bool transposed, const at::Tensor& dbias_out) {
  TORCH_CHECK(gelu_input.defined(), "quantize_blockwise_dgelu: gelu_input must be defined");
  return quantize_gelu_values(grad, gelu_input, options, transposed, dbias_out,
                              "quantize_blockwise_dgelu");
}

Fp8BlockwiseCastTranspose quantize_blockwise(const at::Tensor& x,
                                             const BlockwiseQuantizeOptions& options,
                                             bool transposed, const at::Tensor& dbias_out) {
  check_quantize_input(x, options, dbias_out, "quantize_blockwise");
  const auto in = x.contiguous();
  const int64_t rows = in.size(0), cols = in.size(1);
  auto result = empty_result(in.size(0), in.size(1), in.device(), options, transposed);
  auto& q = result.data;
  auto& t = result.transposed;
  if (in.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::quantize_blockwise_cuda(in, options, q.data, q.scale_inv, t.data, t.scale_inv,
                                    dbias_out);
    return result;
#else
    detail::no_cuda("quantize_blockwise");
#endif
  }
  if (dbias_out.defined()) detail::sum_rows_into(dbias_out, in);
  if (options.block == Fp8BlockShape::k1x128) {
    quantize_cpu(in, 1, kFp8BlockLen, options, q.data, q.scale_inv, 1, rows);
    // xᵀ's tiles: 128 consecutive rows of one column of x, i.e. 1×128 along a row of xᵀ.
    if (transposed)
      quantize_cpu(in.t().contiguous(), 1, kFp8BlockLen, options, t.data, t.scale_inv, 1, cols);
  } else {
    const int64_t padded_blocks = q.scale_inv.size(1);
    quantize_cpu(in, kFp8BlockLen, kFp8BlockLen, options, q.data, q.scale_inv, padded_blocks, 1);
    if (transposed) {
      // The same blocks, so the same scales: the bytes and the scale grid transposed.
      t.data.copy_(q.data.t());
      const int64_t row_blocks = q.scale_inv.size(0), col_blocks = ceil_div(cols, kFp8BlockLen);
      t.scale_inv.narrow(1, 0, row_blocks)
          .copy_(q.scale_inv.narrow(1, 0, col_blocks).t());
    }
  }
  return result;
}

Fp8BlockwiseCastTranspose quantize_blockwise_columns(const std::vector<at::Tensor>& pieces,
                                                     const BlockwiseQuantizeOptions& options,
                                                     bool transposed, const at::Tensor& dbias_out) {
  constexpr const char* op = "quantize_blockwise_columns";
  TORCH_CHECK(!pieces.empty(), op, ": pieces must hold at least one tensor");
  TORCH_CHECK(options.block == Fp8BlockShape::k1x128, op,
              ": options.block must be 1x128 (pieces are column blocks of row tiles), got ",
              block_name(options.block));
  const auto& first = pieces.front();
  TORCH_CHECK(first.defined() && first.dim() == 2, op, ": pieces[0] must be a 2-D tensor, got ",
              first.defined() ? first.sizes() : at::IntArrayRef{});
  int64_t cols = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& piece = pieces[i];
    TORCH_CHECK(piece.defined() && piece.dim() == 2 && piece.size(0) == first.size(0) &&
                    piece.scalar_type() == first.scalar_type() && piece.device() == first.device(),
                op, ": pieces[", i, "] must be 2-D with pieces[0]'s rows, dtype and device (",
                first.sizes(), ", ", first.scalar_type(), ", ", first.device(), "), got ",
                piece.defined() ? piece.sizes() : at::IntArrayRef{}, ", ",
                piece.defined() ? piece.scalar_type() : at::ScalarType::Undefined);
    cols += piece.size(1);
  }
  if (pieces.size() == 1) return quantize_blockwise(first, options, transposed, dbias_out);
  // quantize_blockwise's checks of x on pieces[0] (non-empty, its dtype) and of the options.
  check_quantize_input(first, options, {}, op, "pieces[0]");
  if (dbias_out.defined()) detail::check_dbias_out(dbias_out, cols, first.device(), op);
  if (first.is_cuda() && transposed) {
#ifdef AMP8_WITH_CUDA
    auto result = empty_result(first.size(0), cols, first.device(), options, transposed);
    if (detail::quantize_blockwise_columns_cuda(pieces, options, result.data.data,
                                                result.data.scale_inv, result.transposed.data,
                                                result.transposed.scale_inv, dbias_out)) {
      return result;
    }
#else
    detail::no_cuda(op);
#endif
  }
  return quantize_blockwise(at::cat(pieces, 1), options, transposed, dbias_out);
}

at::Tensor fp8_blockwise_gemm(const Fp8BlockwiseTensor& a, const Fp8BlockwiseTensor& b,
                              at::ScalarType out_dtype, const Fp8GemmOptions& options) {
  const auto& bias = options.bias;
  check_blockwise(a, "a");
  check_blockwise(b, "b");
  TORCH_CHECK(a.block == Fp8BlockShape::k1x128,
              "fp8_blockwise_gemm: a must be in 1x128 tiles (cuBLASLt takes 128x128 tiles only "
              "with a 1x128 partner, as b), got 128x128");
  TORCH_CHECK(!(a.format == Fp8Format::kE5M2 && b.format == Fp8Format::kE5M2),
              "fp8_blockwise_gemm: E5M2 x E5M2 is not supported; one operand must be E4M3");
  const int64_t m = a.data.size(0), k = a.data.size(1), n = b.data.size(0);
  TORCH_CHECK(b.data.size(1) == k, "fp8_blockwise_gemm: a [M, K] and b [N, K] must share K, got ",
              a.data.sizes(), " and ", b.data.sizes());
  TORCH_CHECK(k % 16 == 0 && m % 8 == 0 && n % 8 == 0,
              "fp8_blockwise_gemm: K must be a multiple of 16 and M, N multiples of 8 (cuBLASLt's "
              "block-scaled FP8 GEMMs), got M=", m, " N=", n, " K=", k);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "fp8_blockwise_gemm: out_dtype must be float32 or bfloat16, got ", out_dtype);
  TORCH_CHECK(a.data.device() == b.data.device() && a.scale_inv.device() == a.data.device() &&
                  b.scale_inv.device() == b.data.device(),
              "fp8_blockwise_gemm: a, b and their scales must be on one device");
  TORCH_CHECK(!options.use_fast_accum,
              "fp8_blockwise_gemm: use_fast_accum is not a mode of block-scaled GEMMs (they "
              "accumulate in full)");
  TORCH_CHECK(!options.out_scale.defined() && !options.out_amax.defined(),
              "fp8_blockwise_gemm: out_scale / out_amax are for FP8 outputs, which block-scaled "
              "GEMMs do not write");
  TORCH_CHECK(!options.accumulate || options.out.defined(),
              "fp8_blockwise_gemm: accumulate needs `out`");
  if (options.out.defined()) {
    TORCH_CHECK(options.out.sizes() == at::IntArrayRef({m, n}) &&
                    options.out.scalar_type() == out_dtype && options.out.is_contiguous() &&
                    options.out.device() == a.data.device(),
                "fp8_blockwise_gemm: out must be a contiguous ", out_dtype, " [", m, ", ", n,
                "] on ", a.data.device(), ", got ", options.out.scalar_type(), " ",
                options.out.sizes());
  }
  if (options.residual.defined()) {
    TORCH_CHECK(!options.accumulate,
                "fp8_blockwise_gemm: residual and accumulate are exclusive (both are the GEMM's C)");
    TORCH_CHECK(options.residual.sizes() == at::IntArrayRef({m, n}) &&
                    options.residual.scalar_type() == out_dtype &&
                    options.residual.is_contiguous() &&
                    options.residual.device() == a.data.device(),
                "fp8_blockwise_gemm: residual must be a contiguous ", out_dtype, " [", m, ", ", n,
                "] on ", a.data.device(), ", got ", options.residual.scalar_type(), " ",
                options.residual.sizes());
  }
  Fp8GemmOptions gemm;
  gemm.out = options.out;
  gemm.accumulate = options.accumulate;
  gemm.residual = options.residual;
  if (bias.defined()) {
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n && bias.is_floating_point(),
                "fp8_blockwise_gemm: bias must be a floating-point [", n, "], got ",
                bias.sizes());
    gemm.bias = bias.to(a.data.device(), at::kBFloat16).contiguous();
  }
  if (a.data.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    return detail::fp8_blockwise_gemm_cuda(a, b, out_dtype, gemm);
#else
    detail::no_cuda("fp8_blockwise_gemm");
#endif
  }
  // CPU: exact dequantized operands (an FP8 value times a float32 scale) multiplied in float32.
  auto y = at::matmul(a.dequantize(), b.dequantize().t());
  // cuBLASLt's order: alpha·A·B + beta·C, then the bias epilogue.
  if (gemm.residual.defined()) y = y + gemm.residual.to(at::kFloat);
  if (gemm.bias.defined()) y = y + gemm.bias.to(at::kFloat);
  if (!gemm.out.defined()) return y.to(out_dtype);
  if (gemm.accumulate) y = y + gemm.out.to(at::kFloat);
  gemm.out.copy_(y);
  return gemm.out;
}

namespace {

// The checks both shard functions share; `fn` names the caller.
// Each shard's own fields, and every shard on the first's device (a CPU loop must not read a
// CUDA tensor, nor a launch fail after writing part of the outputs).
void check_shard_values(const char* fn, const std::vector<Fp8WeightShard>& shards) {
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    TORCH_CHECK(s.rows > 0 && s.cols > 0, fn, ": shards[", i, "]: rows and cols must be positive, got ",
                s.rows, " x ", s.cols);
    TORCH_CHECK(s.values.defined() && s.values.dim() == 1 && s.values.is_contiguous(), fn,
                ": shards[", i, "].values must be a contiguous 1-D tensor");
    TORCH_CHECK(s.values.scalar_type() == at::kFloat || s.values.scalar_type() == at::kBFloat16 ||
                    s.values.scalar_type() == at::kHalf,
                fn, ": shards[", i, "].values must be float32, bfloat16 or float16, got ",
                s.values.scalar_type());
    TORCH_CHECK(s.values.device() == shards.front().values.device(), fn, ": shards[", i,
                "].values is on ", s.values.device(), ", shards[0]'s on ", shards.front().values.device(),
                "; every shard must be on one device");
    TORCH_CHECK(s.offset >= 0 && s.offset + s.values.numel() <= s.rows * s.cols, fn, ": shards[", i,
                "]: elements [", s.offset, ", ", s.offset + s.values.numel(),
                ") run past its weight's ", s.rows * s.cols);
  }
}

void check_shards(const char* fn, const std::vector<Fp8WeightShard>& shards,
                  const std::vector<at::Tensor>& amaxes) {
  TORCH_CHECK(amaxes.size() == shards.size(), fn, ": ", shards.size(), " shards but ",
              amaxes.size(), " amaxes");
  check_shard_values(fn, shards);
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    const auto grid = blockwise_amax_shape(s.rows, s.cols);
    TORCH_CHECK(amaxes[i].defined() && amaxes[i].scalar_type() == at::kFloat &&
                    amaxes[i].sizes() == at::IntArrayRef(grid) && amaxes[i].is_contiguous() &&
                    amaxes[i].device() == s.values.device(),
                fn, ": amaxes[", i, "] must be contiguous float32 ", at::IntArrayRef(grid),
                " on ", s.values.device(), ", got ",
                amaxes[i].defined() ? amaxes[i].sizes() : at::IntArrayRef{});
  }
}

// quantize_shards_blockwise's and quantize_whole_weights_blockwise's options and outputs.
void check_shard_outputs(const char* fn, const std::vector<Fp8WeightShard>& shards,
                         const BlockwiseQuantizeOptions& options, const std::vector<at::Tensor>& outs,
                         const std::vector<at::Tensor>& scale_invs) {
  TORCH_CHECK(options.block == Fp8BlockShape::k128x128, fn,
              ": options.block must be 128x128 (a weight's blocks), got 1x128");
  TORCH_CHECK(outs.size() == shards.size() && scale_invs.size() == shards.size(), fn, ": ",
              shards.size(), " shards but ", outs.size(), " outs and ", scale_invs.size(),
              " scale_invs");
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    TORCH_CHECK(outs[i].defined() && outs[i].is_contiguous() &&
                    outs[i].numel() == s.values.numel() &&
                    outs[i].scalar_type() == fp8_dtype(options.format) &&
                    outs[i].device() == s.values.device(),
                fn, ": outs[", i, "] must be contiguous ", fp8_dtype(options.format), " with ",
                s.values.numel(), " elements on ", s.values.device());
    const auto shape = blockwise_scale_shape(s.rows, s.cols, Fp8BlockShape::k128x128);
    TORCH_CHECK(scale_invs[i].defined() && scale_invs[i].scalar_type() == at::kFloat &&
                    scale_invs[i].sizes() == at::IntArrayRef(shape) &&
                    scale_invs[i].is_contiguous() && scale_invs[i].device() == s.values.device(),
                fn, ": scale_invs[", i, "] must be contiguous float32 ", at::IntArrayRef(shape),
                " on ", s.values.device());
  }
}

// Calls f(i, block) for each element i of the shard with the index of its 128×128 block in a
// [ceil(rows/128), ceil(cols/128)] grid.
template <typename F>
void for_each_block_element(const Fp8WeightShard& s, F&& f) {
  const int64_t grid_cols = ceil_div(s.cols, kFp8BlockLen);
  const int64_t n = s.values.numel();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t flat = s.offset + i, r = flat / s.cols, c = flat % s.cols;
    f(i, (r / kFp8BlockLen) * grid_cols + c / kFp8BlockLen);
  }
}

}  // namespace

void blockwise_shard_amax(const std::vector<Fp8WeightShard>& shards,
                          const std::vector<at::Tensor>& amaxes) {
  check_shards("blockwise_shard_amax", shards, amaxes);
  if (shards.empty()) return;
  if (shards.front().values.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::blockwise_shard_amax_cuda(shards, amaxes);
    return;
#else
    detail::no_cuda("blockwise_shard_amax");
#endif
  }
  for (size_t k = 0; k < shards.size(); ++k) {
    const auto values = shards[k].values.to(at::kFloat);
    const float* v = values.const_data_ptr<float>();
    float* amax = amaxes[k].mutable_data_ptr<float>();
    for_each_block_element(shards[k], [&](int64_t i, int64_t block) {
      amax[block] = std::fmax(amax[block], std::fabs(v[i]));
    });
  }
}

void quantize_shards_blockwise(const std::vector<Fp8WeightShard>& shards,
                               const std::vector<at::Tensor>& amaxes,
                               const BlockwiseQuantizeOptions& options,
                               const std::vector<at::Tensor>& outs,
                               const std::vector<at::Tensor>& scale_invs) {
  const char* fn = "quantize_shards_blockwise";
  check_shards(fn, shards, amaxes);
  check_shard_outputs(fn, shards, options, outs, scale_invs);
  if (shards.empty()) return;
  if (shards.front().values.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::quantize_shards_blockwise_cuda(shards, amaxes, options, outs, scale_invs);
    return;
#else
    detail::no_cuda("quantize_shards_blockwise");
#endif
  }
  const float max = fp8_max(options.format);
  for (size_t k = 0; k < shards.size(); ++k) {
    const auto amax = amaxes[k].contiguous();
    const float* a = amax.const_data_ptr<float>();
    std::vector<float> scales(static_cast<size_t>(amax.numel()));
    const int64_t grid_rows = amax.size(0), grid_cols = amax.size(1);
    float* scale_inv = scale_invs[k].mutable_data_ptr<float>();
    const int64_t ld = scale_invs[k].size(1);
    for (int64_t r = 0; r < grid_rows; ++r) {
      for (int64_t c = 0; c < grid_cols; ++c) {
        const float scale = blockwise_scale(a[r * grid_cols + c], options);
        scales[static_cast<size_t>(r * grid_cols + c)] = scale;
        scale_inv[r * ld + c] = 1.0f / scale;
      }
    }
    const auto values = shards[k].values.to(at::kFloat);
    const float* v = values.const_data_ptr<float>();
    const auto write = [&](auto* out) {
      using Fp8T = std::remove_pointer_t<decltype(out)>;
      for_each_block_element(shards[k], [&](int64_t i, int64_t block) {
        out[i] = detail::saturating_cast_cpu<Fp8T>(v[i], scales[static_cast<size_t>(block)], max);
      });
    };
    if (options.format == Fp8Format::kE4M3) {
      write(outs[k].mutable_data_ptr<c10::Float8_e4m3fn>());
    } else {
      write(outs[k].mutable_data_ptr<c10::Float8_e5m2>());
    }
  }
}

void quantize_whole_weights_blockwise(const std::vector<Fp8WeightShard>& shards,
                                      const BlockwiseQuantizeOptions& options,
                                      const std::vector<at::Tensor>& outs,
                                      const std::vector<at::Tensor>& scale_invs) {
  const char* fn = "quantize_whole_weights_blockwise";
  check_shard_values(fn, shards);
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    TORCH_CHECK(s.offset == 0 && s.values.numel() == s.rows * s.cols, fn, ": shards[", i,
                "] holds elements [", s.offset, ", ", s.offset + s.values.numel(), ") of a ", s.rows,
                " x ", s.cols, " weight; it must hold all of it (a part needs the other parts' block "
                "amaxes: blockwise_shard_amax, an all-reduce, then quantize_shards_blockwise)");
  }
  check_shard_outputs(fn, shards, options, outs, scale_invs);
  if (shards.empty()) return;
  if (shards.front().values.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::quantize_whole_weights_blockwise_cuda(shards, options, outs, scale_invs);
    return;
#else
    detail::no_cuda(fn);
#endif
  }
  std::vector<at::Tensor> amaxes;
  amaxes.reserve(shards.size());
  for (const auto& s : shards) amaxes.push_back(at::zeros(blockwise_amax_shape(s.rows, s.cols), at::kFloat));
  blockwise_shard_amax(shards, amaxes);
  quantize_shards_blockwise(shards, amaxes, options, outs, scale_invs);
}

Fp8BlockwiseTensor transpose_blocks(const Fp8BlockwiseTensor& w) {
  TORCH_CHECK(w.defined() && w.data.dim() == 2 && w.block == Fp8BlockShape::k128x128,
              "transpose_blocks: w must be a 2-D FP8 tensor in 128x128 blocks");
  const int64_t rows = w.data.size(0), cols = w.data.size(1);
  const auto shape = blockwise_scale_shape(rows, cols, Fp8BlockShape::k128x128);
  TORCH_CHECK(w.scale_inv.defined() && w.scale_inv.sizes() == at::IntArrayRef(shape),
              "transpose_blocks: w.scale_inv must be ", at::IntArrayRef(shape), " for ",
              w.data.sizes(), ", got ", w.scale_inv.defined() ? w.scale_inv.sizes() : at::IntArrayRef{});
  Fp8BlockwiseTensor t;
  t.format = w.format;
  t.block = w.block;
  const auto data = w.data.contiguous();
  if (data.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    t.data = at::empty({cols, rows}, data.options());
    detail::byte_transpose_cuda(data, t.data);
#else
    detail::no_cuda("transpose_blocks");
#endif
  } else {
    t.data = data.t().contiguous();
  }
  t.scale_inv = at::zeros(blockwise_scale_shape(cols, rows, Fp8BlockShape::k128x128), w.scale_inv.options());
  t.scale_inv.narrow(1, 0, shape[0]).copy_(w.scale_inv.narrow(1, 0, ceil_div(cols, kFp8BlockLen)).t());
  return t;
}

}  // namespace amp8
