#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <string>
#include <vector>

namespace amp8 {

/// Whether fused_optimizer_step can step `optimizer`: a torch::optim::Adam or AdamW (FusedAdam
/// and FusedAdamW included) without amsgrad, or a torch::optim::SGD (FusedSGD included). These
/// classes exactly: another subclass may override step(), so it steps itself.
bool is_fusable(const torch::optim::Optimizer& optimizer);

/// is_fusable, and an Adam or AdamW (whose moments AdamMomentDtypes can keep in bfloat16).
bool is_fusable_adam(const torch::optim::Optimizer& optimizer);

/// The dtypes an Adam / AdamW optimizer keeps its moments in (Megatron-Core's exp_avg_dtype /
/// exp_avg_sq_dtype, TE FusedAdam's): float32 (torch::optim's) or bfloat16 (half the bytes, the
/// update still float32; DeepSeek-V3 trains with both in bfloat16).
struct AdamMomentDtypes {
  c10::ScalarType exp_avg = c10::kFloat;
  c10::ScalarType exp_avg_sq = c10::kFloat;
  /// Both float32: torch::optim's own state.
  bool is_float32() const { return exp_avg == c10::kFloat && exp_avg_sq == c10::kFloat; }
  /// Throws unless each is float32 or bfloat16; errors start with `who` and name the field.
  void check(const std::string& who) const;
};

/// Steps a fusable `optimizer` through fused_adam_step / fused_sgd_step (ops/fused_adam.h,
/// ops/fused_sgd.h): multi-tensor kernels on CUDA, torch::optim's own operations on the CPU.
/// Each parameter's state is torch::optim's (AdamParamState / AdamWParamState: step, exp_avg,
/// exp_avg_sq; SGDParamState: momentum_buffer, with momentum only; created when torch::optim
/// creates them), so checkpoints of the fused and the unfused optimizer load into each other.
///
/// `grad_of(param)`: the gradient to read (any float dtype: e.g. the model's bf16 gradient of a
/// master param, read in place); an undefined tensor skips the param, as torch::optim skips
/// params without a gradient. `copy_of(param)`: a bf16 / fp16 tensor that receives the updated
/// param (the model's half copy), or undefined. Every gradient is multiplied by
/// `grad_multiplier` first (1/loss scale × the clipping coefficient).
///
/// `moment_dtypes`: what an Adam / AdamW param's exp_avg and exp_avg_sq are created in; a state
/// of another dtype (a checkpoint written with other dtypes) is converted at its next step. SGD
/// takes float32 only (an error otherwise: its momentum buffer is float32).
///
/// `amax_of(param)`: for Adam / AdamW, asked for each param the step updates; a defined result
/// (one float32 element, zeroed by the caller) becomes max(amax, max|param|) over the updated
/// param, measured by the step's own pass (AdamStepTensor::amax). SGD steps measure nothing and
/// never ask: the caller measures what it was not asked for.
///
/// `copy_scale_of(param)`: for Adam / AdamW, asked where copy_of gave a float8_e4m3fn copy (an
/// FP8 weight): the scale (one float32 element) the copy is written at in the step's own pass
/// (AdamStepTensor::model_copy_scale). SGD takes no FP8 copy.
void fused_optimizer_step(torch::optim::Optimizer& optimizer, double grad_multiplier,
                          const std::function<torch::Tensor(const torch::Tensor&)>& grad_of,
                          const std::function<torch::Tensor(const torch::Tensor&)>& copy_of = {},
                          const AdamMomentDtypes& moment_dtypes = {},
                          const std::function<torch::Tensor(const torch::Tensor&)>& amax_of = {},
                          const std::function<torch::Tensor(const torch::Tensor&)>& copy_scale_of = {});

/// Converts an Adam / AdamW optimizer's moments that are not in `moment_dtypes` (a checkpoint
/// written with other dtypes) to them; other optimizers are left alone. For a step that is not
/// fused_optimizer_step (which converts by itself): torch::optim's own step would otherwise
/// update bfloat16 moments in bfloat16 arithmetic.
void convert_adam_moments(torch::optim::Optimizer& optimizer, const AdamMomentDtypes& moment_dtypes);

/// torch::optim::AdamW stepped by the multi-tensor CUDA kernels (TE's FusedAdam, Apex's
/// multi_tensor_adam): same options, state, results (within float rounding on CUDA; bit for bit
/// on the CPU) and checkpoints. MixedPrecisionPlugin steps a plain torch::optim::AdamW the same
/// way by itself; this class is for loops without the plugin.
class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// The moments' dtypes (TE FusedAdam's exp_avg_dtype / exp_avg_sq_dtype); default float32.
  /// State of other dtypes is converted at its next step. Throws unless float32 or bfloat16.
  void set_moment_dtypes(const AdamMomentDtypes& moment_dtypes);
  const AdamMomentDtypes& moment_dtypes() const { return moment_dtypes_; }

 private:
  AdamMomentDtypes moment_dtypes_;
};

/// torch::optim::SGD (momentum, dampening, nesterov, weight decay) stepped by the multi-tensor
/// CUDA kernels (Apex's multi_tensor_sgd); see FusedAdamW.
class FusedSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// torch::optim::Adam stepped by the multi-tensor CUDA kernels; see FusedAdamW.
class FusedAdam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// See FusedAdamW::set_moment_dtypes.
  void set_moment_dtypes(const AdamMomentDtypes& moment_dtypes);
  const AdamMomentDtypes& moment_dtypes() const { return moment_dtypes_; }

 private:
  AdamMomentDtypes moment_dtypes_;
};

}  // namespace amp8
