#include "plugin/precision/loss_scaler.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace amp8 {
namespace {

// Scales live in float32 (as Megatron's scale tensor): every value the state machine reaches is
// rounded to float once, so a saved and reloaded scaler continues bit for bit.
double to_float32(double value) { return static_cast<double>(static_cast<float>(value)); }

bool positive_finite(double value) { return value > 0.0 && std::isfinite(value); }

}  // namespace

void LossScalerOptions::validate(const std::string& knob_prefix) const {
  const auto& p = knob_prefix;
  TORCH_CHECK(!loss_scale_ || (positive_finite(*loss_scale_) &&
                               std::isfinite(static_cast<float>(*loss_scale_))),
              p, "loss_scale must be positive and finite (static scaling) or unset (dynamic), got ",
              loss_scale_ ? *loss_scale_ : 0.0);
  TORCH_CHECK(positive_finite(initial_scale_) && std::isfinite(static_cast<float>(initial_scale_)),
              p, "initial_loss_scale must be positive and finite in float32, got ", initial_scale_);
  TORCH_CHECK(positive_finite(min_scale_) && min_scale_ <= initial_scale_,
              p, "min_loss_scale must be positive and <= ", p, "initial_loss_scale (", initial_scale_,
              "), got ", min_scale_);
  TORCH_CHECK(growth_interval_ >= 1, p, "loss_scale_window", p.empty() ? " (growth_interval)" : "",
              " must be >= 1, got ", growth_interval_);
  TORCH_CHECK(hysteresis_ >= 1, p, "hysteresis must be >= 1, got ", hysteresis_);
  TORCH_CHECK(growth_factor_ > 1.0 && std::isfinite(growth_factor_),
              "growth_factor must be > 1, got ", growth_factor_);
  TORCH_CHECK(backoff_factor_ > 0.0 && backoff_factor_ < 1.0,
              "backoff_factor must be in (0, 1), got ", backoff_factor_);
  if (loss_scale_) {
    // A static scale never grows, backs off or reaches a floor: those settings would be dropped.
    const LossScalerOptions defaults;
    std::string unused;
    const auto note = [&](bool changed, const std::string& knob) {
      if (changed) unused += (unused.empty() ? "" : ", ") + knob;
    };
    // Named as the caller knows them: the scaler's own setters, or the prefixed precision knobs.
    note(initial_scale_ != defaults.initial_scale_, p.empty() ? "initial_scale" : p + "initial_loss_scale");
    note(min_scale_ != defaults.min_scale_, p.empty() ? "min_scale" : p + "min_loss_scale");
    note(growth_interval_ != defaults.growth_interval_, p.empty() ? "growth_interval" : p + "loss_scale_window");
    note(hysteresis_ != defaults.hysteresis_, p + "hysteresis");
    note(growth_factor_ != defaults.growth_factor_, "growth_factor");
    note(backoff_factor_ != defaults.backoff_factor_, "backoff_factor");
    TORCH_CHECK(unused.empty(), "the dynamic loss-scaling settings ", unused, " do not apply with a static ",
                p, "loss_scale (", *loss_scale_, "): they would be ignored");
  }
}

LossScaler::LossScaler(const LossScalerOptions& options)
    : options_(options), hysteresis_tracker_(options.hysteresis()) {
  options_.validate();
  scale_ = to_float32(dynamic() ? options_.initial_scale() : *options_.loss_scale());
}

torch::Tensor LossScaler::unscale_(const std::vector<torch::Tensor>& grads) const {
  return check_and_multiply(grads, 1.0 / scale_);
}

torch::Tensor LossScaler::find_non_finite(const std::vector<torch::Tensor>& grads) const {
  return check_and_multiply(grads, 1.0);  // × 1: the values stay exactly as they are
}

torch::Tensor LossScaler::check_and_multiply(const std::vector<torch::Tensor>& grads,
                                             double multiplier) const {
  // The ATen kernel takes tensors of one device; group by device, OR the flags together.
  std::map<std::string, std::vector<torch::Tensor>> by_device;
  c10::optional<c10::Device> first_device;
  for (const auto& grad : grads) {
    if (!grad.defined()) continue;
    TORCH_CHECK(grad.is_floating_point(), "LossScaler::unscale_: gradients must be floating point, got ",
                grad.scalar_type());
    if (!first_device) first_device = grad.device();
    by_device[grad.device().str()].push_back(grad);
  }
  const auto flag_options = torch::TensorOptions().dtype(at::kFloat);
  if (!first_device) return torch::zeros({1}, flag_options);
  auto found_inf = torch::zeros({1}, flag_options.device(*first_device));
  for (auto& [device, tensors] : by_device) {
    const auto device_options = flag_options.device(tensors.front().device());
    auto device_found = torch::zeros({1}, device_options);
    const auto inv_scale = torch::full({1}, multiplier, device_options);
    at::_amp_foreach_non_finite_check_and_unscale_(tensors, device_found, inv_scale);
    found_inf = torch::maximum(found_inf, device_found.to(found_inf.device()));
  }
  return found_inf;
}

void LossScaler::update(bool found_inf) {
  if (!dynamic()) return;
  if (found_inf) {
    growth_tracker_ = 0;
    hysteresis_tracker_ -= 1;
    if (hysteresis_tracker_ <= 0) {
      scale_ = std::max(to_float32(scale_ * options_.backoff_factor()), to_float32(options_.min_scale()));
    }
    return;
  }
  growth_tracker_ += 1;
  if (growth_tracker_ == options_.growth_interval()) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = options_.hysteresis();
    const double grown = to_float32(scale_ * options_.growth_factor());
    if (std::isfinite(grown)) scale_ = grown;
  }
}

void LossScaler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("loss_scale", torch::tensor({scale_}, at::kDouble));
  archive.write("growth_tracker", torch::tensor({growth_tracker_}, at::kLong));
  archive.write("hysteresis_tracker", torch::tensor({hysteresis_tracker_}, at::kLong));
}

void LossScaler::load(torch::serialize::InputArchive& archive) {
  torch::Tensor scale, growth, hysteresis;
  const bool found = archive.try_read("loss_scale", scale) &&
                     archive.try_read("growth_tracker", growth) &&
                     archive.try_read("hysteresis_tracker", hysteresis);
  TORCH_CHECK(found, "LossScaler::load: the checkpoint holds no loss-scaler state "
                     "(loss_scale, growth_tracker, hysteresis_tracker)");
  TORCH_CHECK(scale.numel() == 1 && growth.numel() == 1 && hysteresis.numel() == 1,
              "LossScaler::load: malformed loss-scaler state (expected one value per field)");
  const double loaded_scale = scale.item<double>();
  const int64_t loaded_growth = growth.item<int64_t>();
  const int64_t loaded_hysteresis = hysteresis.item<int64_t>();
  TORCH_CHECK(positive_finite(loaded_scale),
              "LossScaler::load: loss_scale must be positive and finite, got ", loaded_scale);
  TORCH_CHECK(loaded_growth >= 0 && loaded_growth < options_.growth_interval(),
              "LossScaler::load: growth_tracker must be in [0, ", options_.growth_interval(),
              "), got ", loaded_growth);
  TORCH_CHECK(loaded_hysteresis <= options_.hysteresis(),
              "LossScaler::load: hysteresis_tracker must be <= ", options_.hysteresis(), ", got ",
              loaded_hysteresis);
  scale_ = dynamic() ? loaded_scale : to_float32(*options_.loss_scale());
  growth_tracker_ = loaded_growth;
  hysteresis_tracker_ = loaded_hysteresis;
}

}  // namespace amp8
