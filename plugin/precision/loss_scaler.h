#pragma once

#include <torch/arg.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace amp8 {

/// Loss scaling for fp16 training, with Megatron's DynamicGradScaler semantics (NeMo's
/// fp16_mixed defaults):
///   - a step whose gradients hold an inf or NaN is skipped; the growth counter restarts and the
///     hysteresis counter drops by one; when it reaches 0 the scale is multiplied by
///     backoff_factor (never below min_scale) — so with hysteresis 2, the first overflow after a
///     growth only skips the step, the second also halves the scale;
///   - after growth_interval clean steps in a row the scale is multiplied by growth_factor and
///     the hysteresis counter is refilled.
/// With `loss_scale` set the scale is static (Megatron's ConstantGradScaler): steps with
/// non-finite gradients are still skipped, the scale never changes.
struct LossScalerOptions {
  /// Static loss scale (> 0); unset means dynamic. Default: unset.
  TORCH_ARG(std::optional<double>, loss_scale) = std::nullopt;
  /// First dynamic scale. Default: 2^32.
  TORCH_ARG(double, initial_scale) = 4294967296.0;
  /// Smallest dynamic scale. Default: 1.
  TORCH_ARG(double, min_scale) = 1.0;
  /// Clean steps in a row before the scale grows. Default: 1000.
  TORCH_ARG(int64_t, growth_interval) = 1000;
  /// Overflowing steps (since the last growth) before the scale backs off. Default: 2.
  TORCH_ARG(int64_t, hysteresis) = 2;
  /// Default: 2.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Default: 0.5.
  TORCH_ARG(double, backoff_factor) = 0.5;

 public:
  /// Throws c10::Error naming the first bad knob and what it accepts, by Megatron's name
  /// (initial_loss_scale, min_loss_scale, loss_scale_window, ...) after `knob_prefix` (the
  /// plugin's options pass "fp16_": their own names).
  void validate(const std::string& knob_prefix = "") const;
};

/// The loss scaler state machine. The scale is kept as a float32 value (as Megatron's), so every
/// scale it reaches is exactly representable and save/load round-trips it exactly.
class LossScaler {
 public:
  explicit LossScaler(const LossScalerOptions& options = {});

  /// The current scale.
  double scale() const { return scale_; }
  bool dynamic() const { return !options_.loss_scale().has_value(); }
  /// Multiplies every gradient by 1/scale in place (at::_amp_foreach_non_finite_check_and_unscale_,
  /// grouped by device) and returns a float32 tensor [1] on the first gradient's device that is
  /// 1 when any of them holds an inf or NaN, else 0. Undefined tensors are ignored.
  torch::Tensor unscale_(const std::vector<torch::Tensor>& grads) const;
  /// The same flag without unscaling: the gradients are left as they are (for a fused optimizer
  /// step that unscales as it reads them, e.g. fp16 gradients that 1/scale would underflow).
  torch::Tensor find_non_finite(const std::vector<torch::Tensor>& grads) const;
  /// Advances the state machine after a step; `found_inf` says whether its gradients overflowed.
  void update(bool found_inf);

  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t hysteresis_tracker() const { return hysteresis_tracker_; }
  const LossScalerOptions& options() const { return options_; }

  void save(torch::serialize::OutputArchive& archive) const;
  /// Throws when the archive holds no loss-scaler state or a malformed one.
  void load(torch::serialize::InputArchive& archive);

 private:
  torch::Tensor check_and_multiply(const std::vector<torch::Tensor>& grads, double multiplier) const;
  LossScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_;
};

}  // namespace amp8
