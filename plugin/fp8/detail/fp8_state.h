#pragma once
// Bookkeeping between FP8 modules and the Fp8Autocast regions / backward passes they run in.

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ops/scaling.h"
#include "plugin/fp8/fp8_autocast.h"
#include "plugin/fp8/fp8_recipe.h"

namespace amp8::detail {

// Adds `group` (a module's forward metadata) to the innermost region's bulk update, once per
// owner per region (no-op outside a region), and to every ForwardGroupRecorder alive on this
// thread.
void register_forward_group(const void* owner, const DelayedScalingGroup& group);

// Called from a backward function after its gradient amax was recorded: adds `group` to the
// bulk update that runs when the current backward pass ends (queued on the autograd engine).
void register_backward_group(const void* owner, const DelayedScalingGroup& group,
                             const Fp8Recipe& recipe,
                             const c10::intrusive_ptr<c10d::ProcessGroup>& group_to_reduce_over);

// One all-reduce MAX over `group` of row 0 (this step's amaxes) of every history in `groups`,
// packed into one buffer.
void reduce_amaxes(const std::vector<DelayedScalingGroup>& groups, c10d::ProcessGroup& group);

// ---- for an activation recompute (plugin/modules/recompute.h), which runs a forward pass
// again in the backward pass, where no region is open: as it ran the first time ----

// The innermost region on this thread: FP8 on or off, its recipe and its amax reduction group.
struct RegionSetting {
  bool enabled = false;
  Fp8Recipe recipe;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
};
// std::nullopt outside every region.
std::optional<RegionSetting> current_region_setting();

// Opens a region with `setting` (none: no region) for as long as it lives. Its end updates no
// scales: the forward groups registered in it belong to the region of the first run, which
// updated them. Nor does the end of any Fp8Autocast the replayed forward pass opens itself on
// this thread meanwhile (its first run's end did).
class ReplayedRegion {
 public:
  explicit ReplayedRegion(const std::optional<RegionSetting>& setting);
  ~ReplayedRegion();
  ReplayedRegion(const ReplayedRegion&) = delete;
  ReplayedRegion& operator=(const ReplayedRegion&) = delete;

 private:
  std::unique_ptr<Fp8Autocast::Region> region_;
};

// For as long as it lives, collects every forward group registered on this thread, once per
// owner, with a copy of its scale and scale_inv as they were then: the delayed-scaling state a
// forward pass quantized with (before any region it opens itself updates them). Recorders nest;
// each collects.
class ForwardGroupRecorder {
 public:
  ForwardGroupRecorder();
  ~ForwardGroupRecorder();
  ForwardGroupRecorder(const ForwardGroupRecorder&) = delete;
  ForwardGroupRecorder& operator=(const ForwardGroupRecorder&) = delete;
  const std::vector<DelayedScalingGroup>& groups() const { return groups_; }
  /// (scale, scale_inv) of groups()[i] when it was first registered.
  const std::vector<std::pair<at::Tensor, at::Tensor>>& scales() const { return scales_; }
  void add(const void* owner, const DelayedScalingGroup& group);

 private:
  std::vector<DelayedScalingGroup> groups_;
  std::vector<std::pair<at::Tensor, at::Tensor>> scales_;
  std::unordered_set<const void*> owners_;
};

}  // namespace amp8::detail
