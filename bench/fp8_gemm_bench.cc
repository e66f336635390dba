// fp8_gemm (cuBLASLt, TN) against at::_scaled_mm on the same FP8 operands, and against a bf16
// GEMM of the same shape, all in one run; and the blockwise FP8 GEMMs (1×128 × 128×128 and
// 1×128 × 1×128 tiles) against the same bf16 GEMM; then each algorithm choice against the other
// (algo_selection_rows; `fp8_gemm_bench algo` runs only those). y[M,N] = x[M,K]·W[N,K]ᵀ.

#include <ATen/ATen.h>

#include "bench/bench_util.h"
#include "ops/blockwise.h"
#include "ops/fp8_gemm.h"
#include "ops/quantize.h"

namespace {

// The fastest measured cuBLASLt algorithm (Fp8GemmAlgoSelection::kFastestMeasured) against the
// heuristic's first, at the GEMMs of the 1b GPT step (16384 tokens, hidden 2048, QKV 6144, FFN
// 8192) as its FP8 layers call them: the forward in E4M3 with fast accumulation into bf16, dgrad
// E5M2 × E4M3 into bf16, wgrad E5M2 × E4M3 accumulated into a float32 main_grad; tensorwise and
// blockwise (1×128 activations and gradients, 128×128 weights; wgrad 1×128 × 1×128).
void algo_selection_rows(const std::string& cmd) {
  using namespace amp8;
  struct Gemm {
    const char* name;
    int64_t m, k, n;
  };
  const std::vector<Gemm> gemms = {
      {"fwd_qkv", 16384, 2048, 6144},  {"fwd_fc1", 16384, 2048, 8192},    {"fwd_fc2", 16384, 8192, 2048},
      {"dgrad_fc1", 16384, 8192, 2048}, {"dgrad_fc2", 16384, 2048, 8192}, {"wgrad_qkv", 6144, 16384, 2048},
      {"wgrad_fc1", 8192, 16384, 2048}, {"wgrad_fc2", 2048, 16384, 8192}};
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (const auto& g : gemms) {
    const std::string role = std::string(g.name).substr(0, std::string(g.name).find('_'));
    const bool forward = role == "fwd", wgrad = role == "wgrad";
    const auto a_format = forward ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
    auto x = at::randn({g.m, g.k}, cuda.dtype(at::kBFloat16));
    auto w = at::randn({g.n, g.k}, cuda.dtype(at::kBFloat16));
    Fp8GemmOptions options;
    options.use_fast_accum = forward;
    const auto out_dtype = wgrad ? at::kFloat : at::kBFloat16;
    if (wgrad) {
      options.out = at::zeros({g.m, g.n}, cuda.dtype(at::kFloat));
      options.accumulate = true;
    }
    const auto xq = quantize_current_scaling(x, a_format);
    const auto wq = quantize_current_scaling(w, Fp8Format::kE4M3);
    BlockwiseQuantizeOptions x_tiles, w_tiles;
    x_tiles.format = a_format;
    w_tiles.block = wgrad ? Fp8BlockShape::k1x128 : Fp8BlockShape::k128x128;
    const auto xb = quantize_blockwise(x, x_tiles).data;
    const auto wb = quantize_blockwise(w, w_tiles).data;
    const double flops = 2.0 * g.m * g.n * g.k;
    for (const bool blockwise : {false, true}) {
      auto gemm = [&] {
        if (blockwise) {
          Fp8GemmOptions block_scaled = options;
          block_scaled.use_fast_accum = false;  // block-scaled GEMMs accumulate in full
          fp8_blockwise_gemm(xb, wb, out_dtype, block_scaled);
        } else {
          fp8_gemm(xq, wq, out_dtype, options);
        }
      };
      double heuristic = 0, measured = 0;
      {
        const Fp8GemmAlgoSelectionGuard choice(Fp8GemmAlgoSelection::kHeuristic);
        heuristic = bench::median_ms(gemm);
      }
      {
        const Fp8GemmAlgoSelectionGuard choice(Fp8GemmAlgoSelection::kFastestMeasured);
        measured = bench::median_ms(gemm);
      }
      bench::Record("fp8_gemm_algo_selection",
                    std::to_string(g.m) + "x" + std::to_string(g.k) + "x" + std::to_string(g.n), cmd)
          .timing(measured, "the same GEMM with cuBLASLt's first heuristic algorithm", heuristic)
          .set("gemm", g.name)
          .set("recipe", blockwise ? "blockwise" : "tensorwise")
          .set("tflops", flops / measured / 1e9)
          .print();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace amp8;
  const std::string cmd = bench::command_line(argc, argv);
  at::manual_seed(0);
  if (argc > 1 && std::string(argv[1]) == "algo") {  // only the algorithm choices' rows
    algo_selection_rows(cmd);
    return 0;
  }
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
  algo_selection_rows(cmd);
  return 0;
}
