#pragma once
// Bookkeeping between FP8 modules and the Fp8Autocast regions / backward passes they run in.

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ops/scaling.h"
#include "plugin/fp8/fp8_recipe.h"

namespace amp8::detail {

// Adds `group` (a module's forward metadata) to the innermost region's bulk update, once per
// owner per region. No-op outside a region.
void register_forward_group(const void* owner, const DelayedScalingGroup& group);

// Called from a backward function after its gradient amax was recorded: adds `group` to the
// bulk update that runs when the current backward pass ends (queued on the autograd engine).
void register_backward_group(const void* owner, const DelayedScalingGroup& group,
                             const Fp8Recipe& recipe,
                             const c10::intrusive_ptr<c10d::ProcessGroup>& group_to_reduce_over);

// One all-reduce MAX over `group` of row 0 (this step's amaxes) of every history in `groups`,
// packed into one buffer.
void reduce_amaxes(const std::vector<DelayedScalingGroup>& groups, c10d::ProcessGroup& group);

}  // namespace amp8::detail
