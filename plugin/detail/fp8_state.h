#pragma once
// Bookkeeping between FP8 modules and the Fp8Autocast regions / backward passes they run in.

#include "ops/scaling.h"
#include "plugin/fp8_recipe.h"

namespace amp8::detail {

// Adds `group` (a module's forward metadata) to the innermost region's bulk update, once per
// owner per region. No-op outside a region.
void register_forward_group(const void* owner, const DelayedScalingGroup& group);

// Called from a backward function after its gradient amax was recorded: adds `group` to the
// bulk update that runs when the current backward pass ends (queued on the autograd engine).
void register_backward_group(const void* owner, const DelayedScalingGroup& group,
                             const Fp8RecipeOptions& recipe);

}  // namespace amp8::detail
