#pragma once

#include <memory>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "plugin/fp8/fp8_recipe.h"

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
///     fp8.close();   // the forward-scale update (and its all-reduce); errors surface here
///   }
///   loss.backward();
///
/// Closing: close() ends the region and runs the update; it may throw (a failed collective).
/// The destructor closes a region that is still open, but never throws: while an exception
/// unwinds through it, it runs no collective and no update (the peers may never join it; the
/// recorded amaxes stay in row 0 of their histories); at a normal scope exit, an update that
/// fails is reported as a warning and rethrown by the next Fp8Autocast opened on this thread.
class Fp8Autocast {
 public:
  explicit Fp8Autocast(const Fp8RecipeOptions& recipe = {}, bool enabled = true,
                       c10::intrusive_ptr<c10d::ProcessGroup> amax_reduction_group = {});
  /// With a recipe resolved beforehand (Fp8RecipeOptions::resolve), as MixedPrecisionPlugin
  /// opens one region per step.
  explicit Fp8Autocast(const Fp8Recipe& recipe, bool enabled = true,
                       c10::intrusive_ptr<c10d::ProcessGroup> amax_reduction_group = {});
  ~Fp8Autocast();
  /// Ends the region: pops it, then (delayed scaling, FP8 on) all-reduces the forward amaxes
  /// over the group and updates the forward scales. Throws what they throw; the region is
  /// closed either way. Idempotent. Regions must close in reverse order of opening.
  void close();
  Fp8Autocast(const Fp8Autocast&) = delete;
  Fp8Autocast& operator=(const Fp8Autocast&) = delete;

  /// Whether FP8 is on for modules running now on this thread.
  static bool is_enabled();
  /// The recipe of the innermost enabled region; throws outside one.
  static const Fp8Recipe& current_recipe();
  /// The amax reduction group of the innermost enabled region (null when none was given).
  static c10::intrusive_ptr<c10d::ProcessGroup> current_group();

  struct Region;

 private:
  void pop_region();
  std::unique_ptr<Region> region_;
};

}  // namespace amp8
