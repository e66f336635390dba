#pragma once

#include <memory>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "plugin/fp8_recipe.h"

namespace amp8 {

/// An FP8 region (TE's fp8_autocast), RAII. Inside it, FP8 modules (Fp8Linear) compute their
/// GEMMs in FP8 with `recipe`; outside it they compute in high precision. Regions nest; the
/// innermost decides.
///
/// Delayed scaling: every FP8 tensor records its amax into row 0 of its history while the
/// region runs. When the region closes, one bulk update refreshes the forward scales of every
/// module that ran in it; when a backward pass through those modules ends, one bulk update
/// refreshes their gradient scales (queued on the autograd engine). The modules' FP8 metadata
/// are buffers, so they are saved with the module.
///
/// With `amax_reduction_group` (the data-parallel group), the amaxes of all slots are reduced
/// across it before each bulk update — one all-reduce MAX over one buffer, not one per tensor —
/// so every rank computes the same scales.
///
///   {
///     amp8::Fp8Autocast fp8(amp8::Fp8RecipeOptions().fp8("hybrid"));
///     loss = criterion(model->forward(x), y);
///   }
///   loss.backward();
class Fp8Autocast {
 public:
  explicit Fp8Autocast(const Fp8RecipeOptions& recipe = {}, bool enabled = true,
                       c10::intrusive_ptr<c10d::ProcessGroup> amax_reduction_group = {});
  ~Fp8Autocast();
  Fp8Autocast(const Fp8Autocast&) = delete;
  Fp8Autocast& operator=(const Fp8Autocast&) = delete;

  /// Whether FP8 is on for modules running now on this thread.
  static bool is_enabled();
  /// The recipe of the innermost enabled region; throws outside one.
  static const Fp8RecipeOptions& current_recipe();
  /// The amax reduction group of the innermost enabled region (null when none was given).
  static c10::intrusive_ptr<c10d::ProcessGroup> current_group();

  struct Region;

 private:
  std::unique_ptr<Region> region_;
};

}  // namespace amp8
