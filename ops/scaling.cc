#include "ops/scaling.h"

#include <cmath>
#include <string>

#include "ops/detail/cuda_ops.h"
#include "ops/detail/scale_formula.h"
#include "ops/detail/strings.h"

namespace amp8 {
namespace {

constexpr std::string_view kOp = "delayed_scaling_update";

void check_group(const DelayedScalingGroup& g, size_t index, int64_t history_len,
                 at::Device device) {
  auto name = [&](const char* field) {
    return std::string("groups[") + std::to_string(index) + "]." + field;
  };
  for (auto [tensor, field] :
       {std::pair{&g.amax_history, "amax_history"}, std::pair{&g.scale, "scale"},
        std::pair{&g.scale_inv, "scale_inv"}}) {
    TORCH_CHECK(tensor->defined(), kOp, ": ", name(field), " must be a defined tensor");
    TORCH_CHECK(tensor->scalar_type() == at::kFloat, kOp, ": ", name(field),
                " must be float32, got ", tensor->scalar_type());
    TORCH_CHECK(tensor->is_contiguous(), kOp, ": ", name(field), " must be contiguous");
    TORCH_CHECK(tensor->device() == device, kOp, ": ", name(field), " must be on ", device,
                " like groups[0].amax_history, got ", tensor->device());
  }
  TORCH_CHECK(g.amax_history.dim() == 2, kOp, ": ", name("amax_history"),
              " must be 2-D [history_len, slots], got shape ", g.amax_history.sizes());
  TORCH_CHECK(g.amax_history.size(0) == history_len, kOp, ": ", name("amax_history"),
              " must have history_len ", history_len, " like groups[0], got ",
              g.amax_history.size(0));
  const int64_t slots = g.amax_history.size(1);
  TORCH_CHECK(g.scale.dim() == 1 && g.scale.size(0) == slots, kOp, ": ", name("scale"),
              " must have shape [", slots, "], got ", g.scale.sizes());
  TORCH_CHECK(g.scale_inv.dim() == 1 && g.scale_inv.size(0) == slots, kOp, ": ", name("scale_inv"),
              " must have shape [", slots, "], got ", g.scale_inv.sizes());
}

void update_group_cpu(const DelayedScalingGroup& g, float fp8_max, float margin_divisor,
                      AmaxComputeAlgo algo) {
  const int64_t history_len = g.amax_history.size(0);
  const int64_t slots = g.amax_history.size(1);
  float* history = g.amax_history.mutable_data_ptr<float>();
  float* scale = g.scale.mutable_data_ptr<float>();
  float* scale_inv = g.scale_inv.mutable_data_ptr<float>();
  for (int64_t s = 0; s < slots; ++s) {
    const float newest = history[s];
    float amax = newest;
    if (algo == AmaxComputeAlgo::kMax) {
      for (int64_t r = 1; r < history_len; ++r) {
        amax = detail::nan_max(amax, history[r * slots + s]);
      }
    }
    for (int64_t r = 0; r + 1 < history_len; ++r) {
      history[r * slots + s] = history[(r + 1) * slots + s];
    }
    history[(history_len - 1) * slots + s] = newest;
    history[s] = 0.0f;
    const float next = detail::scale_from_amax(amax, scale[s], fp8_max, margin_divisor);
    scale[s] = next;
    scale_inv[s] = 1.0f / next;
  }
}

}  // namespace

AmaxComputeAlgo amax_compute_algo_from_string(std::string_view name, std::string_view param) {
  const std::string lower = detail::to_lower(name);
  if (lower == "max") return AmaxComputeAlgo::kMax;
  if (lower == "most_recent") return AmaxComputeAlgo::kMostRecent;
  TORCH_CHECK(false, param, " must be \"max\" or \"most_recent\", got \"", name, "\"");
}

const char* amax_compute_algo_name(AmaxComputeAlgo algo) {
  return algo == AmaxComputeAlgo::kMax ? "max" : "most_recent";
}

float compute_scale(float amax, float fallback, float fp8_max, int margin) {
  TORCH_CHECK(margin >= 0 && margin < 127, "compute_scale: margin must be in [0, 126], got ",
              margin);
  return detail::scale_from_amax(amax, fallback, fp8_max, std::ldexp(1.0f, margin));
}

void delayed_scaling_update(const std::vector<DelayedScalingGroup>& groups,
                            const DelayedScalingUpdateOptions& options) {
  TORCH_CHECK(options.margin >= 0 && options.margin < 127, kOp,
              ": fp8_margin must be in [0, 126], got ", options.margin);
  if (groups.empty()) return;
  TORCH_CHECK(groups[0].amax_history.defined(), kOp,
              ": groups[0].amax_history must be a defined tensor");
  const at::Device device = groups[0].amax_history.device();
  const int64_t history_len =
      groups[0].amax_history.dim() == 2 ? groups[0].amax_history.size(0) : -1;
  TORCH_CHECK(history_len >= 1, kOp,
              ": groups[0].amax_history must be 2-D [history_len >= 1, slots], got shape ",
              groups[0].amax_history.sizes());
  for (size_t i = 0; i < groups.size(); ++i) check_group(groups[i], i, history_len, device);

  const float max_value = fp8_max(options.format);
  const float margin_divisor = std::ldexp(1.0f, options.margin);
  if (device.is_cuda()) {
#ifdef AMP8_WITH_CUDA
    detail::delayed_scaling_update_cuda(groups, max_value, margin_divisor, options.algo);
#else
    TORCH_CHECK(false, kOp, ": got CUDA tensors but amp8 was built without CUDA");
#endif
    return;
  }
  TORCH_CHECK(device.is_cpu(), kOp, ": tensors must be on CPU or CUDA, got ", device);
  for (const auto& g : groups) update_group_cpu(g, max_value, margin_divisor, options.algo);
}

}  // namespace amp8
