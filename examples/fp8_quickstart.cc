// fp8_quickstart: FP8 delayed scaling on one activation stream, step by step.
//
// Each step quantizes a fresh activation tensor (whose magnitude drifts over time) with the
// scale chosen from the amax history, records its amax into history row 0, and runs the bulk
// scale update, exactly as an FP8 training step does for every tensor it quantizes. A line
// per step shows the amax, the scale in use, how many values saturated and the quantization
// error; a final cast_transpose shows the fused op Hopper's backward GEMMs need.
//
//   ./bazelw run //examples:fp8_quickstart -- [--steps N] [--history H] [--algo max|most_recent]
//                                              [--format e4m3|e5m2] [--margin M] [--device cpu|cuda]

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <string>

#include "ops/quantize.h"
#include "ops/scaling.h"

int main(int argc, char** argv) {
  CLI::App app{"amp8 FP8 quickstart: delayed scaling step by step"};
  int steps = 12;
  int64_t history_len = 4;
  std::string algo_name = "max", format_name = "e4m3", device_name = "auto";
  int margin = 0;
  app.add_option("--steps", steps, "training steps to simulate")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--history", history_len, "fp8_amax_history_len")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--algo", algo_name, "fp8_amax_compute_algo: max | most_recent")->capture_default_str();
  app.add_option("--format", format_name, "FP8 format: e4m3 | e5m2")->capture_default_str();
  app.add_option("--margin", margin, "fp8_margin")->check(CLI::Range(0, 126))->capture_default_str();
  app.add_option("--device", device_name, "cpu | cuda | auto")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    const amp8::Fp8Format format = amp8::fp8_format_from_string(format_name, "--format");
    const amp8::AmaxComputeAlgo algo = amp8::amax_compute_algo_from_string(algo_name, "--algo");
    TORCH_CHECK(device_name == "cpu" || device_name == "cuda" || device_name == "auto",
                "--device must be \"cpu\", \"cuda\" or \"auto\", got \"", device_name, "\"");
    const bool use_cuda = device_name == "cuda" || (device_name == "auto" && torch::cuda::is_available());
    TORCH_CHECK(!use_cuda || torch::cuda::is_available(), "--device cuda: no CUDA device available");
    const auto options = at::TensorOptions().device(use_cuda ? at::kCUDA : at::kCPU);

    // One tensor slot: history [H, 1], scale [1], scale_inv [1].
    amp8::DelayedScalingGroup meta{at::zeros({history_len, 1}, options.dtype(at::kFloat)),
                                   at::ones({1}, options.dtype(at::kFloat)),
                                   at::ones({1}, options.dtype(at::kFloat))};
    std::printf("amp8 fp8_quickstart on %s: format=%s history=%lld algo=%s margin=%d\n",
                use_cuda ? "cuda" : "cpu", amp8::fp8_format_name(format),
                static_cast<long long>(history_len), amp8::amax_compute_algo_name(algo), margin);
    std::printf("%5s %10s %12s %10s %12s\n", "step", "amax", "scale_used", "saturated", "rel_error");
    at::manual_seed(0);
    for (int step = 0; step < steps; ++step) {
      // Activations whose magnitude doubles every step for 8 steps, then drops back: delayed
      // scaling lags a growing tensor (values saturate) and keeps a small scale for as long as
      // the large amaxes stay in the history.
      const double magnitude = std::pow(2.0, step % 8 - 3);
      auto x = (at::randn({256, 1024}, options.dtype(at::kFloat)) * magnitude).to(at::kBFloat16);
      const float scale_used = meta.scale.item<float>();
      auto q = amp8::quantize(x, meta.scale, format, meta.amax_history[0][0]);
      const float amax = meta.amax_history[0][0].item<float>();
      auto xf = x.to(at::kFloat);
      const int64_t saturated = (xf.abs() * scale_used > amp8::fp8_max(format)).sum().item<int64_t>();
      const double rel_error = ((q.dequantize() - xf).norm() / xf.norm()).item<double>();
      std::printf("%5d %10.4f %12.4f %10lld %12.2e\n", step + 1, amax, scale_used,
                  static_cast<long long>(saturated), rel_error);
      amp8::delayed_scaling_update({meta}, {format, margin, algo});
    }
    auto x = at::randn({1481, 677}, options.dtype(at::kBFloat16));
    auto amax = at::zeros({1}, options.dtype(at::kFloat));
    auto ct = amp8::cast_transpose(x, meta.scale, format, amax);
    std::printf("cast_transpose %s -> data %s + transposed %s, amax %.4f\n", "[1481, 677] bf16",
                c10::str(ct.data.sizes()).c_str(), c10::str(ct.transposed.sizes()).c_str(),
                amax.item<float>());
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what_without_backtrace());
    return 2;
  }
  return 0;
}
