// fp8_gemm (cuBLASLt, TN) against at::_scaled_mm on the same FP8 operands, and against a bf16
// GEMM of the same shape, all in one run; and the blockwise FP8 GEMMs (1×128 × 128×128 and
// 1×128 × 1×128 tiles) against the same bf16 GEMM. y[M,N] = x[M,K]·W[N,K]ᵀ.

#include <ATen/ATen.h>

#include "bench/bench_util.h"
#include "ops/blockwise.h"
#include "ops/fp8_gemm.h"
#include "ops/quantize.h"

int main(int argc, char** argv) {
  using namespace amp8;
  const std::string cmd = bench::command_line(argc, argv);
  at::manual_seed(0);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {8192, 8192, 8192}, {16384, 4096, 14336}, {16384, 14336, 4096},
      {4096, 4096, 4096}, {2048, 2048, 2048},   {1024, 1024, 1024}};
  for (auto [m, k, n] : shapes) {
    auto x = at::randn({m, k}, cuda.dtype(at::kBFloat16));
    auto w = at::randn({n, k}, cuda.dtype(at::kBFloat16));
    auto xq = quantize_current_scaling(x, Fp8Format::kE4M3);
    auto wq = quantize_current_scaling(w, Fp8Format::kE4M3);
    const double flops = 2.0 * m * n * k;
    const std::string shape = std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
    for (bool fast : {true, false}) {
      Fp8GemmOptions options;
      options.use_fast_accum = fast;
      const double ours = bench::median_ms([&] { fp8_gemm(xq, wq, at::kBFloat16, options); });
      const double scaled_mm = bench::median_ms([&] {
        at::_scaled_mm(xq.data, wq.data.t(), xq.scale_inv, wq.scale_inv, std::nullopt, std::nullopt,
                       at::kBFloat16, fast);
      });
      bench::Record(fast ? "fp8_gemm_fast_accum" : "fp8_gemm", shape + " e4m3 -> bf16", cmd)
          .timing(ours, "at::_scaled_mm, same operands", scaled_mm)
          .set("tflops", flops / ours / 1e9)
          .set("baseline_tflops", flops / scaled_mm / 1e9)
          .print();
    }
    const double bf16 = bench::median_ms([&] { at::matmul(x, w.t()); });
    const double ours_fast = bench::median_ms([&] {
      Fp8GemmOptions options;
      options.use_fast_accum = true;
      fp8_gemm(xq, wq, at::kBFloat16, options);
    });
    bench::Record("fp8_gemm_vs_bf16", shape, cmd)
        .timing(ours_fast, "bf16 at::matmul (x·Wᵀ)", bf16)
        .set("tflops", flops / ours_fast / 1e9)
        .set("baseline_tflops", flops / bf16 / 1e9)
        .print();
    // Blockwise (DeepSeek-V3's recipe): x in 1×128 tiles, W in 128×128 blocks (the forward and
    // dgrad GEMMs), or both in 1×128 tiles (wgrad's); full accumulation, the only mode.
    for (const auto w_block : {Fp8BlockShape::k128x128, Fp8BlockShape::k1x128}) {
      BlockwiseQuantizeOptions x_tiles, w_tiles;
      w_tiles.block = w_block;
      const auto xb = quantize_blockwise(x, x_tiles).data;
      const auto wb = quantize_blockwise(w, w_tiles).data;
      const double ms = bench::median_ms([&] { fp8_blockwise_gemm(xb, wb, at::kBFloat16); });
      bench::Record(w_block == Fp8BlockShape::k128x128 ? "fp8_blockwise_gemm_1x128_128x128"
                                                       : "fp8_blockwise_gemm_1x128_1x128",
                    shape, cmd)
          .timing(ms, "bf16 at::matmul (x·Wᵀ)", bf16)
          .set("tflops", flops / ms / 1e9)
          .set("baseline_tflops", flops / bf16 / 1e9)
          .set("tensorwise_fast_accum_ms", ours_fast)
          .print();
    }
  }
  return 0;
}
