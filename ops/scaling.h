#pragma once

#include <ATen/ATen.h>

#include <string_view>
#include <vector>

#include "ops/fp8_format.h"

namespace amp8 {

/// How the amax that sets the next scale is taken from an amax history.
enum class AmaxComputeAlgo {
  kMax,         ///< "max": the largest amax in the whole history.
  kMostRecent,  ///< "most_recent": the amax recorded in the step just finished (row 0).
};

/// Parses "max" / "most_recent"; throws naming `param` and the accepted values otherwise.
AmaxComputeAlgo amax_compute_algo_from_string(std::string_view name,
                                              std::string_view param = "fp8_amax_compute_algo");
const char* amax_compute_algo_name(AmaxComputeAlgo algo);

/// The scale formula (TE's delayed scaling), one float32 value:
///   scale = (fp8_max / amax) / 2^margin,
///   `fallback` when amax is 0, negative or not finite, FLT_MAX when the quotient is infinite.
/// Host code; the CUDA kernels evaluate the very same expression (ops/detail/scale_formula.h).
float compute_scale(float amax, float fallback, float fp8_max, int margin);

/// One group of delayed-scaling state (e.g. the forward tensors of one module):
///   amax_history [history_len, slots] float32, row 0 being the amax of the step just done;
///   scale [slots] and scale_inv [slots] float32. All contiguous, on one device.
struct DelayedScalingGroup {
  at::Tensor amax_history;
  at::Tensor scale;
  at::Tensor scale_inv;
};

/// Options of the bulk update; names and defaults are TE's DelayedScaling.
struct DelayedScalingUpdateOptions {
  Fp8Format format = Fp8Format::kE4M3;  ///< gives fp8_max
  int margin = 0;                       ///< fp8_margin, >= 0
  AmaxComputeAlgo algo = AmaxComputeAlgo::kMax;
};

/// The delayed-scaling update over every slot of every group at once (one kernel launch on
/// CUDA for up to 960 groups). For each slot:
///   amax  = max over the history column ("max") or its row 0 ("most_recent");
///   the history is rolled one row towards the front (row 0 moves to the last row) and row 0
///   is zeroed, ready for the next step's amax;
///   scale = compute_scale(amax, previous scale, fp8_max, margin); scale_inv = 1 / scale.
/// All groups must share a device and a history length. Updates the tensors in place.
void delayed_scaling_update(const std::vector<DelayedScalingGroup>& groups,
                            const DelayedScalingUpdateOptions& options);

}  // namespace amp8
