// Training step of a 12-layer GPT block stack (hidden 2048, sequence 2048, micro-batch 8) built
// from torch::nn modules, in each precision the plugin offers: fp32 (TF32 off), bf16-mixed,
// fp16-mixed, bf16 + FP8 (hybrid, delayed; with and without fp8_params; with the modules fused
// and each on its own), plus a bare bf16 loop
// without the plugin (bf16 params stepped by AdamW directly) to bound the plugin's overhead.
// One JSON line per case: step time, tokens/s, peak memory, speedup against fp32 and bf16-mixed.
// AMP8_PROFILE_DIR=DIR also records three steps of the bf16-mixed and FP8 cases with the Kineto
// profiler (amp8::StepRecorder) into DIR/stack_<case>/: trace.json and the device time by
// category (step_profile.txt / .json).
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <ATen/cuda/CUDAEvent.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <vector>
#include <string>

#include "bench/bench_util.h"
#include "plugin/precision/mixed_precision_plugin.h"
#include "plugin/training/step_profiler.h"
#include "recipes/precision.h"

namespace {

constexpr int64_t kLayers = 12, kHidden = 2048, kHeads = 16, kSeq = 2048, kMicroBatch = 8;

// Pre-LayerNorm block; the layers sit in Sequential containers, in the order they run, so the
// plugin can swap them and fuse LayerNorm → QKV and the MLP (convert_to_fp8's fuse_modules).
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    using namespace torch::nn;
    ln_qkv = register_module("ln_qkv", Sequential(LayerNorm(LayerNormOptions({kHidden})),
                                                  Linear(kHidden, 3 * kHidden)));
    proj = register_module("proj", Sequential(Linear(kHidden, kHidden)));
    mlp = register_module("mlp", Sequential(LayerNorm(LayerNormOptions({kHidden})), Linear(kHidden, 4 * kHidden),
                                            GELU(GELUOptions().approximate("tanh")), Linear(4 * kHidden, kHidden)));
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1);
    auto parts = ln_qkv->forward(x).view({b, t, 3, kHeads, kHidden / kHeads}).unbind(2);
    auto attn = at::scaled_dot_product_attention(parts[0].transpose(1, 2), parts[1].transpose(1, 2),
                                                 parts[2].transpose(1, 2), {}, 0.0, /*is_causal=*/true);
    x = x + proj->forward(attn.transpose(1, 2).reshape({b, t, kHidden}));
    return x + mlp->forward(x);
  }
  torch::nn::Sequential ln_qkv{nullptr}, proj{nullptr}, mlp{nullptr};
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < kLayers; ++i) blocks->push_back(Block());
    final_ln = register_module("final_ln", torch::nn::Sequential(torch::nn::LayerNorm(
                                               torch::nn::LayerNormOptions({kHidden}))));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& block : *blocks) x = block->as<BlockImpl>()->forward(x);
    return final_ln->forward(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Sequential final_ln{nullptr};
};
TORCH_MODULE(Stack);

Stack make_stack() {
  torch::manual_seed(0);
  Stack stack;
  stack->to(torch::kCUDA);
  return stack;
}

struct Measured {
  double step_ms = 0, peak_bytes = 0, loss = 0;
  int64_t settle_skipped = 0, skipped_while_timed = 0;
};

// Median step time over `reps` steps after `warmup`, and the peak allocated bytes of one step.
Measured measure(const std::function<torch::Tensor()>& step, int warmup, int reps) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  Measured m;
  m.loss = step().item<double>();
  torch::cuda::synchronize();
  alloc::resetPeakStats(0);
  step();
  torch::cuda::synchronize();
  m.peak_bytes = static_cast<double>(alloc::getDeviceStats(0).allocated_bytes[aggregate].peak);
  m.step_ms = amp8::bench::median_ms([&] { step(); }, warmup, reps);
  return m;
}

// Forward (in the plugin's context), MSE loss and backward through the plugin.
torch::Tensor forward_backward(amp8::MixedPrecisionPlugin& plugin, Stack& model,
                               const torch::Tensor& x, const torch::Tensor& y) {
  torch::Tensor loss;
  {
    auto context = plugin.forward_context();
    loss = torch::mse_loss(plugin.convert_output(model->forward(plugin.convert_input(x))), y);
  }
  plugin.backward(loss);
  return loss.detach();
}

// With AMP8_PROFILE_DIR set: three steps recorded into $AMP8_PROFILE_DIR/stack_<name>/, the
// table printed to stderr (stdout carries the JSON rows).
void profile_steps(const std::string& name, const std::function<torch::Tensor()>& step) {
  const char* dir = std::getenv("AMP8_PROFILE_DIR");
  if (dir == nullptr || name.empty()) return;
  amp8::StepRecorder recorder;
  recorder.start();
  for (int64_t i = 0; i < 3; ++i) {
    recorder.begin_step(i);
    step();
    recorder.end_step();
  }
  const auto profile = recorder.stop(std::string(dir) + "/stack_" + name);
  std::cerr << "gpt_stack_bench " << name << ": " << profile.table();
}

Measured plugin_case(const amp8::MixedPrecisionOptions& precision, const torch::Tensor& x,
                     const torch::Tensor& y, int warmup, int reps, const std::string& profile_name = "") {
  auto model = make_stack();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4));
  amp8::MixedPrecisionPlugin plugin = precision;
  plugin.connect(*model, optimizer);
  auto step = [&] {
    auto loss = forward_backward(plugin, model, x, y);
    plugin.optimizer_step(optimizer);
    return loss;
  };
  // fp16 starts at a loss scale of 2^32: its first steps overflow and are skipped (no optimizer
  // step, no optimizer state). Time only steps that step: run until three in a row are taken.
  int64_t taken_in_a_row = 0;
  for (int i = 0; i < 64 && taken_in_a_row < 3; ++i) {
    const auto skipped = plugin.skipped_steps();
    step();
    taken_in_a_row = plugin.skipped_steps() == skipped ? taken_in_a_row + 1 : 0;
  }
  const auto skipped_before = plugin.skipped_steps();
  auto result = measure(step, warmup, reps);
  profile_steps(profile_name, step);
  result.settle_skipped = skipped_before;
  result.skipped_while_timed = plugin.skipped_steps() - skipped_before;
  return result;
}

// What the plugin itself adds to a bf16-mixed step, measured with CUDA events inside real steps:
// unscale_gradients (unfused: the half gradients copied into FP32 master gradients; fused:
// nothing to copy) and optimizer_step (unfused: AdamW's own step, then the masters copied back
// into the bf16 parameters; fused: one multi-tensor pass). The hooks around forward and
// backward launch no kernels under bf16.
struct Overhead {
  double grad_copy_ms = 0, optimizer_step_ms = 0, plugin_step_ms = 0;
  double params = 0;
};

// `sgd`: torch::optim::SGD with nesterov momentum instead of AdamW; `bf16_moments`: AdamW's
// moments in bfloat16 (exp_avg_dtype / exp_avg_sq_dtype).
Overhead overhead_case(const torch::Tensor& x, const torch::Tensor& y, int reps, bool fused,
                       bool sgd = false, bool bf16_moments = false) {
  auto model = make_stack();
  std::unique_ptr<torch::optim::Optimizer> owned;
  if (sgd) {
    owned = std::make_unique<torch::optim::SGD>(
        model->parameters(), torch::optim::SGDOptions(1e-4).momentum(0.9).nesterov(true));
  } else {
    owned = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-4));
  }
  auto& optimizer = *owned;
  auto options = amp8::recipes::bf16_mixed().fused_optimizer(fused);
  if (bf16_moments) options.exp_avg_dtype(at::kBFloat16).exp_avg_sq_dtype(at::kBFloat16);
  amp8::MixedPrecisionPlugin plugin = options;
  plugin.connect(*model, optimizer);
  double params = 0;
  for (const auto& p : model->parameters()) params += static_cast<double>(p.numel());

  auto stream = at::cuda::getCurrentCUDAStream();
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<double> unscale, step;
  for (int i = 0; i < reps + 2; ++i) {
    forward_backward(plugin, model, x, y);
    at::cuda::CUDAEvent a(cudaEventDefault), b(cudaEventDefault), c(cudaEventDefault);
    a.record(stream);
    plugin.unscale_gradients(optimizer);
    b.record(stream);
    plugin.optimizer_step(optimizer);
    c.record(stream);
    stream.synchronize();
    if (i >= 2) {
      unscale.push_back(a.elapsed_time(b));
      step.push_back(b.elapsed_time(c));
    }
  }
  if (fused) return {median(unscale), median(step), median(step), params};
  // The optimizer's own step on the FP32 masters (gradients in place from unscale_gradients).
  forward_backward(plugin, model, x, y);
  plugin.unscale_gradients(optimizer);
  const double optimizer_ms = amp8::bench::median_ms([&] { optimizer.step(); }, 2, reps);
  plugin.optimizer_step(optimizer);
  return {median(unscale), optimizer_ms, median(step), params};
}

// Device-to-device copy rate (bytes read + written per second) of a 1 GiB buffer: the floor
// that the optimizer step's bytes are measured against.
double copy_bytes_per_s() {
  auto src = torch::empty({int64_t{1} << 30}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA));
  auto dst = torch::empty_like(src);
  const double ms = amp8::bench::median_ms([&] { dst.copy_(src); }, 3, 20);
  return 2.0 * static_cast<double>(src.numel()) / (ms / 1000.0);
}

Measured bare_bf16_case(const torch::Tensor& x, const torch::Tensor& y, int warmup, int reps) {
  auto model = make_stack();
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.set_data(p.to(torch::kBFloat16));
  }
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const auto x16 = x.to(torch::kBFloat16);
  return measure(
      [&] {
        auto loss = torch::mse_loss(model->forward(x16).to(torch::kFloat), y);
        loss.backward();
        optimizer.step();
        optimizer.zero_grad();
        return loss.detach();
      },
      warmup, reps);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = amp8::bench::command_line(argc, argv);
  const std::string shape = std::to_string(kLayers) + " layers x hidden " + std::to_string(kHidden) +
                            " x seq " + std::to_string(kSeq) + " x batch " + std::to_string(kMicroBatch);
  const double tokens = static_cast<double>(kSeq * kMicroBatch);
  torch::manual_seed(1);
  const auto options = torch::TensorOptions().device(torch::kCUDA);
  const auto x = torch::randn({kMicroBatch, kSeq, kHidden}, options);
  const auto y = torch::randn({kMicroBatch, kSeq, kHidden}, options);

  // fp32 with TF32 off: the reference every mixed precision is measured against.
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  const auto fp32 = plugin_case(amp8::MixedPrecisionOptions("32"), x, y, 2, 5);
  c10::cuda::CUDACachingAllocator::emptyCache();
  const auto bf16 = plugin_case(amp8::recipes::bf16_mixed(), x, y, 3, 10, "bf16_mixed");
  c10::cuda::CUDACachingAllocator::emptyCache();

  auto emit = [&](const std::string& name, const Measured& m, const std::string& baseline,
                  double baseline_ms) {
    amp8::bench::Record(name, shape, cmd)
        .timing(m.step_ms, baseline, baseline_ms)
        .set("tokens_per_s", tokens / (m.step_ms / 1000.0))
        .set("peak_mem_bytes", m.peak_bytes)
        .set("first_loss", m.loss)
        .set("skipped_before_timing", static_cast<double>(m.settle_skipped))
        .set("skipped_while_timed", static_cast<double>(m.skipped_while_timed))
        .print();
  };
  emit("gpt_stack_step_fp32", fp32, "fp32 (TF32 off)", fp32.step_ms);
  emit("gpt_stack_step_bf16_mixed", bf16, "fp32 (TF32 off)", fp32.step_ms);

  const auto fp16 = plugin_case(amp8::recipes::fp16_mixed(), x, y, 3, 10);
  c10::cuda::CUDACachingAllocator::emptyCache();
  emit("gpt_stack_step_fp16_mixed", fp16, "bf16-mixed", bf16.step_ms);

  const auto fp8 = plugin_case(amp8::recipes::bf16_with_fp8_mixed(), x, y, 3, 10, "bf16_fp8_params");
  c10::cuda::CUDACachingAllocator::emptyCache();
  emit("gpt_stack_step_bf16_fp8_params", fp8, "bf16-mixed", bf16.step_ms);

  const auto fp8_no_params = plugin_case(amp8::recipes::bf16_with_fp8_mixed().fp8_params(false), x, y, 3, 10);
  c10::cuda::CUDACachingAllocator::emptyCache();
  emit("gpt_stack_step_bf16_fp8", fp8_no_params, "bf16-mixed", bf16.step_ms);

  // The same FP8 step with every LayerNorm, Linear and GELU converted on its own (no
  // Fp8LayerNormLinear / Fp8LayerNormMLP): what fusing the modules gains.
  const auto fp8_modules_unfused =
      plugin_case(amp8::recipes::bf16_with_fp8_mixed().fp8_fuse_modules(false), x, y, 3, 10);
  c10::cuda::CUDACachingAllocator::emptyCache();
  emit("gpt_stack_step_bf16_fp8_params_unfused_modules", fp8_modules_unfused,
       "bf16 + FP8 fp8_params (fused modules)", fp8.step_ms);

  const auto bf16_unfused = plugin_case(amp8::recipes::bf16_mixed().fused_optimizer(false), x, y, 3, 10);
  c10::cuda::CUDACachingAllocator::emptyCache();
  emit("gpt_stack_step_bf16_mixed_unfused_optimizer", bf16_unfused, "bf16-mixed (fused optimizer)", bf16.step_ms);

  const auto fp8_unfused = plugin_case(amp8::recipes::bf16_with_fp8_mixed().fused_optimizer(false), x, y, 3, 10);
  c10::cuda::CUDACachingAllocator::emptyCache();
  emit("gpt_stack_step_bf16_fp8_params_unfused_optimizer", fp8_unfused, "bf16 + FP8 fp8_params (fused optimizer)", fp8.step_ms);

  // The optimizer step with master weights against its bytes-moved floor, fused and unfused
  // (grad copy + the torch::optim step + copy-back), at the copy rate measured here. Returns the
  // unfused case's measurements.
  const double copy_rate = copy_bytes_per_s();
  auto optimizer_step_row = [&](const char* name, bool sgd, double bytes_per_param,
                                const char* baseline) {
    const auto fused = overhead_case(x, y, 10, /*fused=*/true, sgd);
    c10::cuda::CUDACachingAllocator::emptyCache();
    const auto unfused = overhead_case(x, y, 10, /*fused=*/false, sgd);
    c10::cuda::CUDACachingAllocator::emptyCache();
    const double floor_ms = bytes_per_param * fused.params / copy_rate * 1000.0;
    const double fused_ms = fused.grad_copy_ms + fused.plugin_step_ms;
    const double unfused_ms = unfused.grad_copy_ms + unfused.plugin_step_ms;
    amp8::bench::Record(name, shape, cmd)
        .timing(fused_ms, baseline, unfused_ms)
        .set("params", fused.params)
        .set("copy_rate_bytes_per_s", copy_rate)
        .set("floor_ms", floor_ms)
        .set("fraction_of_floor", fused_ms / floor_ms)
        .set("unfused_fraction_of_floor", unfused_ms / floor_ms)
        .print();
    return unfused;
  };
  // AdamW: the FP32 master and both moments read and written (24 B), the bf16 gradient read and
  // the bf16 parameter written (4 B).
  const auto overhead = optimizer_step_row(
      "gpt_stack_optimizer_step", /*sgd=*/false, 28.0,
      "unfused (grad copy + torch::optim::AdamW + copy-back)");
  // SGD with nesterov momentum: the master and the momentum buffer read and written (16 B), the
  // gradient read and the parameter written (4 B).
  optimizer_step_row("gpt_stack_optimizer_step_sgd", /*sgd=*/true, 20.0,
                     "unfused (grad copy + torch::optim::SGD + copy-back)");
  {
    // AdamW with bfloat16 moments (fused only) against the float32-moment fused step: the master
    // read and written (8 B), both moments read and written in bf16 (8 B), the gradient read and
    // the parameter written (4 B).
    const auto float32_moments = overhead_case(x, y, 10, /*fused=*/true);
    c10::cuda::CUDACachingAllocator::emptyCache();
    const auto bf16_moments = overhead_case(x, y, 10, /*fused=*/true, /*sgd=*/false, /*bf16_moments=*/true);
    c10::cuda::CUDACachingAllocator::emptyCache();
    const double floor_ms = 20.0 * bf16_moments.params / copy_rate * 1000.0;
    const double ours_ms = bf16_moments.grad_copy_ms + bf16_moments.plugin_step_ms;
    amp8::bench::Record("gpt_stack_optimizer_step_bf16_moments", shape, cmd)
        .timing(ours_ms, "fused AdamW step with float32 moments",
                float32_moments.grad_copy_ms + float32_moments.plugin_step_ms)
        .set("params", bf16_moments.params)
        .set("copy_rate_bytes_per_s", copy_rate)
        .set("floor_ms", floor_ms)
        .set("fraction_of_floor", ours_ms / floor_ms)
        .print();
  }
  const double copy_back_ms = overhead.plugin_step_ms - overhead.optimizer_step_ms;
  const double overhead_ms = overhead.grad_copy_ms + copy_back_ms;
  // For scale: a bf16 loop with no FP32 masters at all (bf16 params stepped by AdamW directly).
  // Its difference to bf16-mixed also contains the FP32 optimizer's extra bytes, which are the
  // point of master weights rather than plugin overhead.
  const auto bare = bare_bf16_case(x, y, 3, 10);
  amp8::bench::Record("gpt_stack_step_plugin_overhead", shape, cmd)
      .set("ours_ms", overhead_ms)
      .set("baseline", "bf16-mixed step")
      .set("baseline_ms", bf16.step_ms)
      .set("overhead_fraction_of_bf16_step", overhead_ms / bf16.step_ms)
      .set("grad_copy_ms", overhead.grad_copy_ms)
      .set("copy_back_ms", copy_back_ms)
      .set("optimizer_step_ms", overhead.optimizer_step_ms)
      .set("bare_bf16_loop_ms", bare.step_ms)
      .set("bare_bf16_loop_peak_mem_bytes", bare.peak_bytes)
      .print();
  return 0;
}
