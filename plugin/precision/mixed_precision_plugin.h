#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "plugin/modules/convert_module.h"
#include "plugin/distributed/distributed_optimizer.h"
#include "plugin/fp8/fp8_recipe.h"
#include "plugin/optim/fused_optimizer.h"
#include "plugin/precision/loss_scaler.h"
#include "plugin/precision/precision_plugin.h"

namespace amp8 {

class Fp8LinearImpl;

/// NeMo's MegatronMixedPrecision knobs, under NeMo's names. The presets in recipes/precision.h
/// (bf16_mixed(), fp16_mixed(), bf16_with_fp8_mixed(), fp16_with_fp8_mixed()) return these with
/// NeMo's values; override any field by chaining:
///   amp8::MixedPrecisionPlugin plugin = amp8::recipes::bf16_with_fp8_mixed().fp8_params(false);
struct MixedPrecisionOptions {
  /* implicit */ MixedPrecisionOptions(std::string precision = "bf16-mixed")
      : precision_(std::move(precision)) {}

  /// "32" (alias "32-true"), "16-mixed" (alias "fp16-mixed") or "bf16-mixed". Default:
  /// "bf16-mixed".
  TORCH_ARG(std::string, precision);
  /// dtype of the model's parameters and gradients; the optimizer steps FP32 master copies of
  /// those that are not float32. Default: unset = the precision's dtype (float16 / bfloat16 /
  /// float32), as NeMo's presets set it.
  TORCH_ARG(std::optional<c10::ScalarType>, params_dtype) = std::nullopt;
  /// Run the forward pass under at::autocast with the precision's dtype (for models whose
  /// parameters stay float32); an error under precision "32". Default: false (NeMo's presets:
  /// the parameters are half).
  TORCH_ARG(bool, autocast_enabled) = false;
  /// Sum gradients in float32, as Megatron's float32 main_grad: across data-parallel ranks (the
  /// reduce-scatter) and across a step's micro-batches, on one rank too (from the first
  /// set_gradient_sync(false); DistributedOptimizer::take_gradients: the plugin holds the sum,
  /// .grad only the last micro-batch's part until the step). false: in the parameters' dtype.
  /// Default: true (NeMo: true for bf16_mixed, false for fp16_mixed).
  TORCH_ARG(bool, grad_reduce_in_fp32) = true;
  /// Step a torch::optim::Adam / AdamW (without amsgrad) or SGD whose masters are on a GPU with
  /// amp8's multi-tensor kernels (fused_optimizer_step, TE's FusedAdam / FusedSGD with master
  /// weights): one pass per element reads the model's half gradient where it is (no FP32
  /// gradient copy), unscales and clips it on the fly, updates the FP32 master and the optimizer
  /// state (moments, momentum buffer) and writes the model's
  /// half parameter (no copy-back). The masters' .grad() then stays undefined. Other
  /// optimizers, the CPU, or false: the optimizer's own step(). Default: true.
  TORCH_ARG(bool, fused_optimizer) = true;
  /// The dtype of an Adam / AdamW optimizer's first and second moments (Megatron-Core's
  /// precision-aware optimizer, `--exp-avg-dtype` / `--exp-avg-sq-dtype`; TE FusedAdam's
  /// exp_avg_dtype / exp_avg_sq_dtype): float32, or bfloat16 for half the optimizer state's
  /// bytes (the update is still computed in float32; DeepSeek-V3 trains with both in bfloat16).
  /// bfloat16 needs a torch::optim::Adam or AdamW without amsgrad and the fused step (on the
  /// CPU too: the CPU reference); any other optimizer is an error at convert_optimizer, never a
  /// silent float32. Default: float32 (torch::optim's own state).
  TORCH_ARG(c10::ScalarType, exp_avg_dtype) = c10::kFloat;
  TORCH_ARG(c10::ScalarType, exp_avg_sq_dtype) = c10::kFloat;

  // ---- FP8 (Transformer Engine's DelayedScaling; see Fp8RecipeOptions) ----
  /// "none", "hybrid" or "e4m3". Default: "none".
  TORCH_ARG(std::string, fp8) = "none";
  /// "delayed", "tensorwise" or "blockwise" (see Fp8RecipeOptions::fp8_recipe; blockwise with
  /// fp8_params stores the weights in 128x128 blocks). Default: "delayed".
  TORCH_ARG(std::string, fp8_recipe) = "delayed";
  /// Default: 0.
  TORCH_ARG(int, fp8_margin) = 0;
  /// Default: 1024.
  TORCH_ARG(int64_t, fp8_amax_history_len) = 1024;
  /// "max" or "most_recent". Default: "max".
  TORCH_ARG(std::string, fp8_amax_compute_algo) = "max";
  /// Keep linear weights only in FP8 (TE's fp8_model_init); the masters are seeded from the
  /// high-precision values. Default: false (the FP8 presets set true, as NeMo's).
  TORCH_ARG(bool, fp8_params) = false;
  /// Under fp8_params with one scale per weight: the scale an FP8 weight is written at after an
  /// optimizer step. "current": from the updated master's own amax (exact; a second read of
  /// every master after the step). "delayed": from the amax after the previous step, so that a
  /// fused Adam step writes the FP8 weight in its own pass, as TE's FusedAdam does for
  /// Float8Tensor params (values beyond that scale's range saturate for one step). Default:
  /// "current".
  TORCH_ARG(std::string, fp8_params_scaling) = "current";
  /// As Fp8LinearOptions::fp8_min_gemm_size, for every Fp8Linear of the model (those
  /// convert_module swaps in and those the model already has). Default: kDefaultFp8MinGemmSize
  /// (per shape, where FP8 was measured faster; plugin/fp8/fp8_gemm_choice.h).
  TORCH_ARG(int64_t, fp8_min_gemm_size) = kDefaultFp8MinGemmSize;
  /// Layers at the start / end of the model kept out of FP8 (their Fp8Linear modules, swapped
  /// in or already there, compute in high precision). Default: 0.
  TORCH_ARG(int64_t, num_layers_at_start_in_bf16) = 0;
  /// Default: 0.
  TORCH_ARG(int64_t, num_layers_at_end_in_bf16) = 0;
  /// convert_module fuses a torch::nn::Sequential's LayerNorm → Linear (→ GELU(tanh) → Linear)
  /// into an Fp8LayerNormLinear (Fp8LayerNormMLP), as Fp8ConversionOptions::fuse_modules.
  /// Default: true.
  TORCH_ARG(bool, fp8_fuse_modules) = true;

  // ---- fp16 loss scaling (Megatron's DynamicGradScaler; see LossScalerOptions) ----
  /// Static loss scale (> 0); unset = dynamic. Default: unset.
  TORCH_ARG(std::optional<double>, fp16_loss_scale) = std::nullopt;
  /// Default: 2^32.
  TORCH_ARG(double, fp16_initial_loss_scale) = 4294967296.0;
  /// Default: 1.
  TORCH_ARG(double, fp16_min_loss_scale) = 1.0;
  /// Clean steps before the scale doubles. Default: 1000.
  TORCH_ARG(int64_t, fp16_loss_scale_window) = 1000;
  /// Default: 2.
  TORCH_ARG(int64_t, fp16_hysteresis) = 2;

 public:
  /// Throws c10::Error naming the first bad knob and the values it accepts.
  void validate() const;
  /// The canonical precision: "32", "16-mixed" or "bf16-mixed".
  std::string canonical_precision() const;
  /// float32, float16 or bfloat16.
  c10::ScalarType compute_dtype() const;
  c10::ScalarType resolved_params_dtype() const;
  bool fp8_enabled() const { return fp8_ != "none"; }
  Fp8RecipeOptions fp8_recipe_options() const;
  /// The fp16_* knobs as the loss scaler's options (used under "16-mixed").
  LossScalerOptions loss_scaler_options() const;
};

/// Megatron's mixed precision for any LibTorch model and torch::optim optimizer.
///
/// connect(model, optimizer):
///   - with FP8 on, swaps torch::nn::Linear / LayerNorm for Fp8Linear / Fp8LayerNorm
///     (convert_to_fp8), keeping num_layers_at_start/end_in_bf16 layers as they are;
///   - casts the model's floating-point parameters to params_dtype (buffers are left alone);
///   - points the optimizer at FP32 master copies of every parameter that is not float32,
///     seeded from the values before the cast (under fp8_params: from the high-precision
///     initial values), so the optimizer and its state only ever see float32.
/// Each step: backward() scales the loss (fp16); optimizer_step() copies the half gradients into
/// the masters' (float32), unscales them and checks for inf/NaN (all-reduced over the process
/// group when one is set), skips the step on overflow (loss scaler update), else steps and
/// copies the masters back into the model (re-quantizing FP8 weights). forward_context() opens
/// at::autocast (autocast_enabled) and the FP8 region (Fp8Autocast) with the recipe.
///
/// A module swap reaches what the model's forward calls when the parent dispatches through its
/// registry (Sequential, ModuleList, ModuleDict). A typed member (`torch::nn::Linear fc1;`)
/// cannot be re-pointed in C++; the first optimizer_step() throws, naming the module, if a
/// swapped module never ran. Such models declare amp8::Fp8Linear / Fp8LayerNorm members
/// instead (drop-ins that compute in high precision outside an FP8 region).
///
/// Under loss scaling (16-mixed) the gradients between backward() and the step are still
/// multiplied by the loss scale, and once micro-batches are summed in float32
/// (grad_reduce_in_fp32 on one rank) the parameters' .grad holds only the last micro-batch's
/// part: anything that changes them there (torch::nn::utils::clip_grad_norm_) is an error at
/// that step's clip_gradients() / optimizer_step(), checked until one step has compared finite
/// gradients, on a world of one without static gradients (the gradients' norm after each
/// backward() against the norm when the step begins: one more read of the gradients per
/// micro-batch, on the first step checked only). A backward outside backward() after it looks
/// the same and is named too.
///
/// A backward() with gradient sync on (the default) ends a step's gradients: another backward()
/// before optimizer_step() or discard_gradients() is an error. It catches a loop that steps with
/// optimizer.step() (which steps the masters without gradients, so the model would not train; in
/// "32", where params are their own masters, it would bypass the plugin's step) and
/// accumulation that does not call set_gradient_sync(false) before every micro-batch's backward
/// but the last, which data parallelism needs anyway.
class MixedPrecisionPlugin : public PrecisionPlugin {
 public:
  /* implicit */ MixedPrecisionPlugin(const MixedPrecisionOptions& options = {});

  std::string name() const override;
  void convert_module(torch::nn::Module& model) override;
  void convert_optimizer(torch::optim::Optimizer& optimizer) override;
  ForwardContext forward_context() override;
  /// A float32 input as the params dtype (Megatron's Float16Module); any other dtype unchanged.
  torch::Tensor convert_input(const torch::Tensor& input) override;
  /// A bfloat16 / float16 output as float32; any other dtype unchanged.
  torch::Tensor convert_output(const torch::Tensor& output) override;
  void backward(const torch::Tensor& loss) override;
  void unscale_gradients(torch::optim::Optimizer& optimizer) override;
  torch::Tensor gradient_norm(torch::optim::Optimizer& optimizer) override;
  void clip_gradients_to(torch::optim::Optimizer& optimizer, double max_norm, double norm) override;
  bool optimizer_step(torch::optim::Optimizer& optimizer) override;
  /// Clears every gradient (model, masters, FP8 main_grad) and counts the step as skipped.
  void discard_gradients(torch::optim::Optimizer& optimizer) override;
  /// "" where a CUDA graph can capture and replay the forward and backward pass: one rank
  /// (several: the gradient buffer's reduce-scatter hooks run on the host), no loss scaling
  /// (16-mixed: the captured loss scale would stay fixed while the scaler changes it).
  std::string cuda_graph_problem() const override;
  /// DistributedOptimizer::use_static_gradients.
  void use_static_gradients() override;
  void backward_replayed() override;
  double loss_scale() const override;
  bool skips_nonfinite_gradients() const override { return scaler_.has_value(); }
  int64_t skipped_steps() const override { return skipped_steps_; }
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  int checkpoint_world_size(torch::serialize::InputArchive& archive) const override;
  /// A checkpoint of N ranks into this run's M (DistributedOptimizer::load_resharded): the masters
  /// and the optimizer state cut again; the loss scaler and the skipped-step count of rank 0.
  void load_resharded(std::vector<torch::serialize::InputArchive>& archives,
                      std::vector<torch::serialize::InputArchive>& optimizer_archives,
                      torch::optim::Optimizer& optimizer) override;

  /// Data-parallel training over `group` (before connect): the FP32 master params and the
  /// optimizer state are sharded over the ranks (DistributedOptimizer, ZeRO-1: gradients
  /// reduce-scattered in the grad_reduce_in_fp32 dtype while the backward pass runs, params
  /// all-gathered, FP8 weights as FP8); found_inf, the gradient norm and the FP8 amaxes are
  /// all-reduced over it. Without a group, the same code runs as a world of one.
  void set_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                         DistributedOptimizerOptions options = {});
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return group_; }
  /// The FP32 masters and the optimizer they feed, for any world size (null before connect).
  const DistributedOptimizer* distributed_optimizer() const { return optimizer_.get(); }
  DistributedOptimizer* distributed_optimizer() { return optimizer_.get(); }
  void set_gradient_sync(bool enabled) override;
  torch::Tensor data_parallel_mean(const torch::Tensor& value) override;
  void finish_param_gather() override;
  int data_parallel_rank() const override { return group_ ? group_->getRank() : 0; }
  int data_parallel_size() const override { return group_ ? group_->getSize() : 1; }
  const MixedPrecisionOptions& options() const { return options_; }
  /// What convert_module swapped (empty without FP8); replaced_params is emptied by
  /// convert_optimizer, which releases the old parameters.
  const Fp8Conversion& conversion() const { return conversion_; }
  /// The loss scaler (fp16 only).
  const std::optional<LossScaler>& scaler() const { return scaler_; }
  /// The FP32 masters the optimizer steps on this rank (with several ranks, its shards), in the
  /// optimizer's parameter order.
  std::vector<torch::Tensor> master_params() const;
  /// A copy of `param`'s FP32 master (the parameter itself, cast, when it has none). Throws
  /// with several ranks: the masters are sharded over them.
  at::Tensor fp32_value(const at::Tensor& param) const override;

 private:
  void clear_gradients();
  // What every rank's checkpoint file holds alike, read and checked (the precision must be this
  // plugin's) without changing anything: the steps skipped so far and the loss scaler, if any.
  struct CommonState {
    int64_t skipped_steps = 0;
    std::optional<LossScaler> scaler;
  };
  CommonState read_common_state(torch::serialize::InputArchive& archive, const std::string& caller,
                                const std::string& file) const;
  void check_swapped_modules_ran();
  // backward()'s check that no backward with gradient sync on ran since the last step, and its
  // bookkeeping after one (also for backward_replayed).
  void check_backward_allowed() const;
  void note_backward_done();
  // The check of gradients changed between backward() and the step, loss-scaled or partly
  // summed (see the class comment): whether it still runs, the norm it compares, and the
  // comparison.
  bool checks_gradients_unchanged() const;
  double model_gradient_norm() const;
  void check_gradients_unchanged();
  bool use_fused_step(const torch::optim::Optimizer& optimizer) const;
  AdamMomentDtypes moment_dtypes() const;

  MixedPrecisionOptions options_;
  std::optional<LossScaler> scaler_;
  Fp8Recipe fp8_recipe_;  // resolved once, from options_
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  DistributedOptimizerOptions distributed_options_;
  std::unique_ptr<DistributedOptimizer> optimizer_;  // made by convert_optimizer
  torch::nn::Module* model_ = nullptr;
  Fp8Conversion conversion_;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> master_seeds_;  // (param, float32 value)
  // This step's gradients, one per master (unscale_gradients): float32 and unscaled for the
  // optimizer's own step(); as reduced, with what the fused step multiplies them by (1/loss
  // scale × the clipping coefficient), for the fused step (fused_step_).
  std::vector<torch::Tensor> grads_;
  bool fused_step_ = false;
  double grad_multiplier_ = 1.0;
  bool gradients_ready_ = false;
  bool found_inf_ = false;
  bool scaled_backward_since_step_ = false;  // plugin.backward() ran under loss scaling since the last step
  // set_gradient_sync's flag, and whether a backward with it on ran since the last step.
  bool gradient_sync_ = true;
  bool synced_backward_since_step_ = false;
  bool swapped_modules_checked_ = false;
  // The gradients' norm after the last backward() (NaN before one since the step), while they
  // are loss-scaled or partly in the float32 micro-batch sums, until unscale_gradients has
  // compared it once with finite gradients (gradients_checked_unchanged_).
  double grad_norm_after_backward_ = std::numeric_limits<double>::quiet_NaN();
  bool gradients_checked_unchanged_ = false;
  int64_t skipped_steps_ = 0;
};

}  // namespace amp8
