// Fp8Linear forward + backward against torch::nn::Linear under bf16 autocast (the baseline),
// and against the obvious eager FP8 layer (separate amax / scale / cast / transpose ops, then
// at::_scaled_mm for the three GEMMs), all in one run on the same shapes.

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bench/bench_util.h"
#include "plugin/fp8/fp8_autocast.h"
#include "plugin/modules/fp8_linear.h"

namespace {

at::Tensor scale_for(const at::Tensor& x, double fp8_max) {
  return (fp8_max / x.abs().amax().to(at::kFloat)).reshape({});
}

at::Tensor cast(const at::Tensor& x, const at::Tensor& scale, double fp8_max, at::ScalarType t) {
  return (x.to(at::kFloat) * scale).clamp(-fp8_max, fp8_max).to(t);
}

// The eager FP8 layer: y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x, each operand made by separate ops.
void eager_fp8_step(const at::Tensor& x, const at::Tensor& w, const at::Tensor& g) {
  auto sx = scale_for(x, 448), sw = scale_for(w, 448), sg = scale_for(g, 57344);
  auto xq = cast(x, sx, 448, at::kFloat8_e4m3fn), wq = cast(w, sw, 448, at::kFloat8_e4m3fn);
  auto one = at::ones({}, x.options().dtype(at::kFloat));
  auto y = at::_scaled_mm(xq, wq.t(), one / sx, one / sw, std::nullopt, std::nullopt, at::kBFloat16,
                          true);
  auto gq = cast(g, sg, 57344, at::kFloat8_e5m2);
  auto w_t = wq.t().contiguous(), g_t = gq.t().contiguous(), x_t = xq.t().contiguous();
  auto dx = at::_scaled_mm(gq, w_t.t(), one / sg, one / sw, std::nullopt, std::nullopt,
                           at::kBFloat16, false);
  auto dw = at::_scaled_mm(g_t, x_t.t(), one / sg, one / sx, std::nullopt, std::nullopt, at::kFloat,
                           false);
}

// Host time to issue one forward call (CPU wall clock; the GPU is synchronized before and after
// each call, outside the timing), each call in its own autocast (+ FP8) region as in a training
// step, so the baseline pays its autocast weight cast and ours its quantization launches.
void host_time_case(const std::string& cmd) {
  using namespace amp8;
  const int64_t m = 4096, k = 4096, n = 4096;
  torch::nn::Linear reference(k, n);
  Fp8Linear fp8(Fp8LinearOptions(k, n).fp8_min_gemm_size(0));
  reference->to(torch::kCUDA);
  fp8->to(torch::kCUDA);
  auto x = torch::randn({m, k}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16))
               .requires_grad_(true);
  auto host_us = [&](bool use_fp8) {
    std::vector<double> times;
    for (int i = 0; i < 220; ++i) {
      bench::Bf16Autocast autocast;
      Fp8Autocast region(Fp8RecipeOptions(), use_fp8);
      torch::cuda::synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      auto y = use_fp8 ? fp8->forward(x) : reference->forward(x);
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= 20) times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    torch::cuda::synchronize();
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  const double bf16_us = host_us(false);
  const double fp8_us = host_us(true);
  bench::Record("fp8_linear_forward_host_time", "4096x4096x4096", cmd)
      .timing(fp8_us / 1000, "torch::nn::Linear under bf16 autocast (host time)", bf16_us / 1000)
      .set("ours_host_us", fp8_us)
      .set("baseline_host_us", bf16_us)
      .set("host_time_ratio", fp8_us / bf16_us)
      .print();
}

size_t parameter_bytes(torch::nn::Module& module) {
  size_t bytes = 0;
  for (const auto& p : module.parameters()) bytes += p.numel() * p.element_size();
  return bytes;
}

// With AMP8_MEMORY_TRACE=FILE, the caching allocator's history of `step` is appended to FILE:
// every allocation and completed free of 1 MiB or more, with the bytes allocated after it, so
// that a peak can be read as the list of tensors alive at that moment.
void trace_step(const std::string& label, const std::function<void()>& step) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const char* path = std::getenv("AMP8_MEMORY_TRACE");
  if (path == nullptr || *path == '\0') {
    step();
    return;
  }
  const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const double start =
      static_cast<double>(alloc::getDeviceStats(0).allocated_bytes[aggregate].current);
  auto no_context = []() -> std::shared_ptr<c10::GatheredContext> { return nullptr; };
  alloc::recordHistory(true, no_context, 1 << 20, c10::CachingDeviceAllocator::RecordContext::STATE,
                       /*clearHistory=*/true, {});
  step();
  torch::cuda::synchronize();
  const auto snapshot = alloc::snapshot();
  alloc::recordHistory(false, nullptr, 0, c10::CachingDeviceAllocator::RecordContext::NEVER,
                       /*clearHistory=*/true, {});
  std::FILE* file = std::fopen(path, "a");
  if (file == nullptr) return;
  std::fprintf(file, "== %s: %.2f MB allocated before the step\n", label.c_str(), start / 1e6);
  double current = start;
  using Entry = c10::CachingDeviceAllocator::TraceEntry;
  for (const auto& entry : snapshot.device_traces.at(0)) {
    const char* action = nullptr;
    if (entry.action_ == Entry::ALLOC) {
      current += static_cast<double>(entry.size_);
      action = "alloc";
    } else if (entry.action_ == Entry::FREE_COMPLETED) {
      current -= static_cast<double>(entry.size_);
      action = "free";
    }
    if (action != nullptr && entry.size_ >= (size_t{1} << 20)) {
      std::fprintf(file, "%-5s %9.2f MB -> %9.2f MB\n", action, entry.size_ / 1e6, current / 1e6);
    }
  }
  std::fclose(file);
}

// Parameter bytes of a 4096×4096 layer under Fp8ModelInit against a bf16 torch::nn::Linear, and
// the peak memory of a forward + backward (second step, so gradients exist) of each.
void memory_case(const std::string& cmd) {
  using namespace amp8;
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const int64_t m = 16384, k = 4096, n = 4096;
  const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  // Peak allocated bytes of the second step; `resident` gets what was allocated when it began
  // (parameters, gradients, inputs, and whatever the first step left behind).
  double resident = 0;
  auto peak_step_bytes = [&](const std::function<void()>& step, const std::string& label) {
    step();
    torch::cuda::synchronize();
    alloc::resetPeakStats(0);
    resident = static_cast<double>(alloc::getDeviceStats(0).allocated_bytes[aggregate].current);
    trace_step(label, step);
    torch::cuda::synchronize();
    return static_cast<double>(alloc::getDeviceStats(0).allocated_bytes[aggregate].peak);
  };
  auto bf16_opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  double bf16_params = 0, fp8_params = 0, bf16_peak = 0, fp8_peak = 0;
  double bf16_resident = 0, fp8_resident = 0;
  {
    torch::nn::Linear reference(k, n);
    reference->to(torch::kCUDA, torch::kBFloat16);
    bf16_params = parameter_bytes(*reference);
    auto x = torch::randn({m, k}, bf16_opts).requires_grad_(true);
    auto g = torch::randn({m, n}, bf16_opts);
    bf16_peak = peak_step_bytes([&] {
      x.mutable_grad() = torch::Tensor();
      reference->forward(x).backward(g);
    }, "bf16 torch::nn::Linear");
    bf16_resident = resident;
  }
  {
    Fp8Linear fp8{nullptr};
    {
      Fp8ModelInit init(true, /*preserve_high_precision_init_val=*/false);
      fp8 = Fp8Linear(Fp8LinearOptions(k, n));
    }
    fp8->to(torch::kCUDA);
    fp8->bias.set_data(fp8->bias.to(torch::kBFloat16));
    fp8_params = parameter_bytes(*fp8) + fp8->weight_scale_inv.numel() * 4;
    auto x = torch::randn({m, k}, bf16_opts).requires_grad_(true);
    auto g = torch::randn({m, n}, bf16_opts);
    fp8_peak = peak_step_bytes([&] {
      x.mutable_grad() = torch::Tensor();
      torch::Tensor y;
      {
        Fp8Autocast region;
        y = fp8->forward(x);
      }
      y.backward(g);
    }, "Fp8Linear under Fp8ModelInit");
    fp8_resident = resident;
  }
  // A stack of four such layers (ReLU between them): the saved activations are the FP8
  // transposes (1 byte per element) instead of the bf16 inputs.
  double bf16_stack_peak = 0, fp8_stack_peak = 0;
  {
    torch::nn::Sequential reference;
    for (int i = 0; i < 4; ++i) {
      reference->push_back(torch::nn::Linear(k, n));
      if (i < 3) reference->push_back(torch::nn::ReLU());
    }
    reference->to(torch::kCUDA, torch::kBFloat16);
    auto x = torch::randn({m, k}, bf16_opts);
    auto g = torch::randn({m, n}, bf16_opts);
    bf16_stack_peak =
        peak_step_bytes([&] { reference->forward(x).backward(g); }, "4 bf16 torch::nn::Linear");
  }
  {
    torch::nn::Sequential stack;
    {
      Fp8ModelInit init(true, /*preserve_high_precision_init_val=*/false);
      for (int i = 0; i < 4; ++i) {
        stack->push_back(Fp8Linear(Fp8LinearOptions(k, n)));
        if (i < 3) stack->push_back(torch::nn::ReLU());
      }
    }
    stack->to(torch::kCUDA);
    for (auto& p : stack->named_parameters()) {
      if (p.key().find("bias") != std::string::npos)
        p.value().set_data(p.value().to(torch::kBFloat16));
    }
    auto x = torch::randn({m, k}, bf16_opts);
    auto g = torch::randn({m, n}, bf16_opts);
    fp8_stack_peak = peak_step_bytes([&] {
      torch::Tensor y;
      {
        Fp8Autocast region;
        y = stack->forward(x);
      }
      y.backward(g);
    }, "4 Fp8Linear under Fp8ModelInit");
  }
  bench::Record("fp8_params_memory_4_layer_stack", "4 x 16384x4096x4096", cmd)
      .set("baseline", "4 torch::nn::Linear in bf16")
      .set("ours_peak_bytes", fp8_stack_peak)
      .set("baseline_peak_bytes", bf16_stack_peak)
      .set("peak_ratio", fp8_stack_peak / bf16_stack_peak)
      .print();
  bench::Record("fp8_params_memory", "16384x4096x4096", cmd)
      .set("ours_param_bytes", fp8_params)
      .set("baseline", "torch::nn::Linear in bf16")
      .set("baseline_param_bytes", bf16_params)
      .set("param_bytes_ratio", fp8_params / bf16_params)
      .set("ours_peak_bytes", fp8_peak)
      .set("baseline_peak_bytes", bf16_peak)
      .set("peak_ratio", fp8_peak / bf16_peak)
      .set("ours_resident_bytes", fp8_resident)
      .set("baseline_resident_bytes", bf16_resident)
      .print();
}

// Forward + backward of the two ways a GEMM of [m, k] x [k, n] can run, timed in one place:
//  * without fp8_params: torch::nn::Linear under bf16 autocast against an Fp8Linear with every
//    GEMM in FP8 (fp8_min_gemm_size 0) under `recipe`;
//  * with fp8_params (weights held only in FP8, built under Fp8ModelInit): the same Fp8Linear
//    kept in high precision (its FP8 weight dequantized each call, what fp8_min_gemm_size's
//    fallback costs there) against it in FP8.
struct PairTiming {
  double high_precision_ms, fp8_ms;
};

PairTiming time_pair(int64_t m, int64_t k, int64_t n, const amp8::Fp8RecipeOptions& recipe,
                     bool fp8_params, int reps) {
  using namespace amp8;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  auto x = torch::randn({m, k}, cuda.dtype(torch::kBFloat16)).requires_grad_(true);
  auto g = torch::randn({m, n}, cuda.dtype(torch::kBFloat16));
  auto fp8_step = [&](Fp8Linear& layer) {
    return [&] {
      torch::Tensor y;
      {
        bench::Bf16Autocast autocast;
        Fp8Autocast region(recipe);
        y = layer->forward(x);
      }
      y.backward(g);
    };
  };
  auto make = [&](int64_t min_gemm_size) {
    std::optional<Fp8ModelInit> init;
    if (fp8_params) init.emplace(true, /*preserve_high_precision_init_val=*/false);
    Fp8Linear layer(Fp8LinearOptions(k, n).fp8_min_gemm_size(min_gemm_size));
    init.reset();
    layer->to(torch::kCUDA);
    if (fp8_params) layer->bias.set_data(layer->bias.to(torch::kBFloat16));
    return layer;
  };
  Fp8Linear fp8 = make(0);
  const double fp8_ms = bench::median_ms(fp8_step(fp8), 5, reps);
  double high_ms = 0;
  if (fp8_params) {
    Fp8Linear fallback = make(std::numeric_limits<int64_t>::max());
    high_ms = bench::median_ms(fp8_step(fallback), 5, reps);
  } else {
    torch::nn::Linear reference(k, n);
    reference->to(torch::kCUDA);
    high_ms = bench::median_ms([&] {
      torch::Tensor y;
      {
        bench::Bf16Autocast autocast;
        y = reference->forward(x);
      }
      y.backward(g);
    }, 5, reps);
  }
  return {high_ms, fp8_ms};
}

std::string shape_name(int64_t m, int64_t k, int64_t n) {
  return std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
}

// `fp8_linear_bench grid`: FP8 (delayed scaling, every GEMM in FP8) against high precision over
// a grid of (rows, in, out), with and without fp8_params: the measurement behind the per-shape
// fp8_min_gemm_size default (plugin/fp8/fp8_gemm_choice.h). Then the three FP8 recipes against
// bf16 on a few shapes.
void grid_cases(const std::string& cmd) {
  using namespace amp8;
  const std::vector<int64_t> rows = {1024, 2048, 4096, 8192, 16384};
  const std::vector<int64_t> dims = {1024, 2048, 4096, 8192};
  for (const bool fp8_params : {false, true}) {
    for (const int64_t m : rows) {
      for (const int64_t k : dims) {
        for (const int64_t n : dims) {
          const auto t = time_pair(m, k, n, Fp8RecipeOptions(), fp8_params, 20);
          bench::Record("fp8_linear_gemm_grid", shape_name(m, k, n), cmd)
              .timing(t.fp8_ms,
                      fp8_params ? "the same Fp8Linear (fp8_params) kept in high precision"
                                 : "torch::nn::Linear under bf16 autocast",
                      t.high_precision_ms)
              .set("recipe", "delayed")
              .set("fp8_params", fp8_params ? "true" : "false")
              .set("rows", m)
              .set("in_features", k)
              .set("out_features", n)
              .print();
        }
      }
    }
  }
  for (const auto& [m, k, n] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {8192, 8192, 8192}, {16384, 4096, 14336}, {8192, 2048, 8192}, {4096, 4096, 4096}}) {
    for (const std::string recipe : {"delayed", "tensorwise", "blockwise"}) {
      const auto t = time_pair(m, k, n, Fp8RecipeOptions().fp8_recipe(recipe), false, 30);
      bench::Record("fp8_linear_recipe", shape_name(m, k, n), cmd)
          .timing(t.fp8_ms, "torch::nn::Linear under bf16 autocast", t.high_precision_ms)
          .set("recipe", recipe)
          .set("tflops", 3 * 2.0 * m * n * k / t.fp8_ms / 1e9)
          .set("baseline_tflops", 3 * 2.0 * m * n * k / t.high_precision_ms / 1e9)
          .print();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace amp8;
  const std::string cmd = bench::command_line(argc, argv);
  torch::manual_seed(0);
  if (argc > 1 && std::string(argv[1]) == "grid") {
    grid_cases(cmd);
    return 0;
  }
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {8192, 8192, 8192}, {16384, 4096, 14336}, {16384, 14336, 4096},
      {4096, 4096, 4096}, {2048, 2048, 2048},   {1024, 1024, 1024}};
  for (auto [m, k, n] : shapes) {
    torch::nn::Linear reference(k, n);
    Fp8Linear fp8(Fp8LinearOptions(k, n));  // the defaults a user gets
    reference->to(torch::kCUDA);
    fp8->to(torch::kCUDA);
    {
      torch::NoGradGuard no_grad;
      fp8->weight.copy_(reference->weight);
      fp8->bias.copy_(reference->bias);
    }
    auto x = torch::randn({m, k}, cuda.dtype(torch::kBFloat16)).requires_grad_(true);
    auto g = torch::randn({m, n}, cuda.dtype(torch::kBFloat16));
    const double flops = 3 * 2.0 * m * n * k;

    const double bf16_ms = bench::median_ms([&] {
      torch::Tensor y;
      {
        bench::Bf16Autocast autocast;
        y = reference->forward(x);
      }
      y.backward(g);
    });
    const double fp8_ms = bench::median_ms([&] {
      torch::Tensor y;
      {
        bench::Bf16Autocast autocast;
        Fp8Autocast region;
        y = fp8->forward(x);
      }
      y.backward(g);
    });
    auto w_bf16 = reference->weight.detach().to(torch::kBFloat16);
    auto x_plain = x.detach();
    const double eager_ms = bench::median_ms([&] { eager_fp8_step(x_plain, w_bf16, g); });
    const std::string shape = std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
    bench::Record("fp8_linear_fwd_bwd", shape, cmd)
        .timing(fp8_ms, "torch::nn::Linear under bf16 autocast", bf16_ms)
        .set("tflops", flops / fp8_ms / 1e9)
        .set("baseline_tflops", flops / bf16_ms / 1e9)
        .set("eager_fp8_ms", eager_ms)
        .set("speedup_vs_eager_fp8", eager_ms / fp8_ms)
        .set("eager_fp8_vs_bf16", bf16_ms / eager_ms)
        .set("path", m * k * n >= fp8->options.fp8_min_gemm_size()
                         ? "fp8"
                         : "high precision (below fp8_min_gemm_size)")
        .print();
  }
  host_time_case(cmd);
  memory_case(cmd);
  return 0;
}
