#include "plugin/fp8/fp8_autocast.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "plugin/fp8/detail/fp8_state.h"
#include "plugin/compat/torch_internals.h"

namespace amp8 {

struct Fp8Autocast::Region {
  bool enabled;
  Fp8Recipe recipe;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::vector<DelayedScalingGroup> forward_groups;
  std::unordered_set<const void*> owners;
  int uncaught_exceptions_at_open;  // more at destruction: an exception is unwinding
  bool closed;
};

namespace {

thread_local std::vector<Fp8Autocast::Region*> region_stack;
thread_local std::vector<detail::ForwardGroupRecorder*> recorders;
// ReplayedRegions alive on this thread: a forward pass run again, whose regions update nothing.
thread_local int replays = 0;

// Backward groups wait here, per backward pass (autograd graph task) and per (format, margin,
// algo, reduction group), until that backward pass ends. The autograd engine may run backward
// functions on its own threads, and several threads may run backward passes at once (e.g.
// data-parallel ranks in one process), hence a mutex and one entry per graph task.
using PendingKey = std::tuple<int, int, int, c10d::ProcessGroup*>;
struct PendingBackward {
  std::map<PendingKey, std::vector<DelayedScalingGroup>> groups;
  std::map<PendingKey, c10::intrusive_ptr<c10d::ProcessGroup>> process_groups;
  std::unordered_set<const void*> owners;
};
struct PendingBackwards {
  std::mutex mutex;
  std::unordered_map<int, PendingBackward> by_graph_task;
};

PendingBackwards& pending_backwards() {
  static PendingBackwards pending;
  return pending;
}

void run_backward_updates(int graph_task) {
  PendingBackward pending;
  {
    auto& all = pending_backwards();
    std::lock_guard<std::mutex> lock(all.mutex);
    auto it = all.by_graph_task.find(graph_task);
    if (it == all.by_graph_task.end()) return;
    pending = std::move(it->second);
    all.by_graph_task.erase(it);
  }
  for (auto& [key, list] : pending.groups) {
    const auto [format, margin, algo, process_group] = key;
    if (process_group != nullptr) detail::reduce_amaxes(list, *process_group);
    delayed_scaling_update(
        list, {static_cast<Fp8Format>(format), margin, static_cast<AmaxComputeAlgo>(algo)});
  }
}

}  // namespace

namespace {
// A scale update that failed in a destructor (which may not throw), rethrown by the next region
// this thread opens.
thread_local std::exception_ptr deferred_close_error;
}  // namespace

Fp8Autocast::Fp8Autocast(const Fp8RecipeOptions& recipe, bool enabled,
                         c10::intrusive_ptr<c10d::ProcessGroup> amax_reduction_group)
    : Fp8Autocast(enabled ? recipe.resolve() : Fp8Recipe{}, enabled, std::move(amax_reduction_group)) {}

Fp8Autocast::Fp8Autocast(const Fp8Recipe& recipe, bool enabled,
                         c10::intrusive_ptr<c10d::ProcessGroup> amax_reduction_group) {
  if (deferred_close_error) std::rethrow_exception(std::exchange(deferred_close_error, nullptr));
  region_ = std::make_unique<Region>(Region{enabled, recipe, std::move(amax_reduction_group), {}, {},
                                            std::uncaught_exceptions(), false});
  region_stack.push_back(region_.get());
}

Fp8Autocast::~Fp8Autocast() {
  if (region_->closed) return;
  if (std::uncaught_exceptions() > region_->uncaught_exceptions_at_open) {
    // Unwinding: leave the region without a collective the other ranks may never enter.
    pop_region();
    return;
  }
  try {
    close();
  } catch (const std::exception& e) {
    TORCH_WARN("Fp8Autocast: the forward-scale update at the end of the region failed; the next "
               "Fp8Autocast on this thread rethrows it (call close() to get it at once): ",
               e.what());
    deferred_close_error = std::current_exception();
  }
}

void Fp8Autocast::pop_region() {
  TORCH_INTERNAL_ASSERT(!region_stack.empty() && region_stack.back() == region_.get(),
                        "Fp8Autocast regions must close in reverse order of opening");
  region_stack.pop_back();
  region_->closed = true;
}

void Fp8Autocast::close() {
  if (region_->closed) return;
  pop_region();
  if (replays > 0) return;  // the forward pass's first run updated these scales
  if (!region_->enabled || region_->forward_groups.empty() || !region_->recipe.delayed()) return;
  const auto& r = region_->recipe;
  if (region_->group) detail::reduce_amaxes(region_->forward_groups, *region_->group);
  delayed_scaling_update(region_->forward_groups,
                         {r.forward_format, r.margin, r.amax_compute_algo});
}

bool Fp8Autocast::is_enabled() { return !region_stack.empty() && region_stack.back()->enabled; }

const Fp8Recipe& Fp8Autocast::current_recipe() {
  TORCH_CHECK(is_enabled(), "Fp8Autocast::current_recipe: no enabled Fp8Autocast region");
  return region_stack.back()->recipe;
}

c10::intrusive_ptr<c10d::ProcessGroup> Fp8Autocast::current_group() {
  TORCH_CHECK(is_enabled(), "Fp8Autocast::current_group: no enabled Fp8Autocast region");
  return region_stack.back()->group;
}

namespace detail {

void reduce_amaxes(const std::vector<DelayedScalingGroup>& groups, c10d::ProcessGroup& group) {
  if (groups.empty()) return;
  std::vector<at::Tensor> rows;
  rows.reserve(groups.size());
  for (const auto& g : groups) rows.push_back(g.amax_history[0]);
  std::vector<at::Tensor> buffer{at::cat(rows)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  group.allreduce(buffer, options)->wait();
  int64_t offset = 0;
  for (auto& row : rows) {
    row.copy_(buffer[0].narrow(0, offset, row.numel()));
    offset += row.numel();
  }
}

void register_forward_group(const void* owner, const DelayedScalingGroup& group) {
  for (auto* recorder : recorders) recorder->add(owner, group);
  if (region_stack.empty()) return;
  auto* region = region_stack.back();
  if (region->owners.insert(owner).second) region->forward_groups.push_back(group);
}

void register_backward_group(const void* owner, const DelayedScalingGroup& group,
                             const Fp8Recipe& recipe,
                             const c10::intrusive_ptr<c10d::ProcessGroup>& process_group) {
  const int graph_task = current_backward_pass();
  bool queue = false;
  {
    auto& all = pending_backwards();
    std::lock_guard<std::mutex> lock(all.mutex);
    auto [it, first] = all.by_graph_task.try_emplace(graph_task);
    auto& pending = it->second;
    if (pending.owners.insert(owner).second) {
      const PendingKey key{static_cast<int>(recipe.backward_format), recipe.margin,
                           static_cast<int>(recipe.amax_compute_algo), process_group.get()};
      pending.groups[key].push_back(group);
      if (process_group) pending.process_groups[key] = process_group;
    }
    queue = first;
  }
  if (queue) {
    at_end_of_backward_pass([graph_task] { run_backward_updates(graph_task); });
  }
}

std::optional<RegionSetting> current_region_setting() {
  if (region_stack.empty()) return std::nullopt;
  const auto* region = region_stack.back();
  return RegionSetting{region->enabled, region->recipe, region->group};
}

ReplayedRegion::ReplayedRegion(const std::optional<RegionSetting>& setting) {
  ++replays;
  if (!setting) return;
  region_ = std::make_unique<Fp8Autocast::Region>(Fp8Autocast::Region{
      setting->enabled, setting->recipe, setting->group, {}, {}, std::uncaught_exceptions(), false});
  region_stack.push_back(region_.get());
}

ReplayedRegion::~ReplayedRegion() {
  --replays;
  if (!region_) return;
  // Regions nest (RAII); a destructor may not throw, so a region left open inside is dropped
  // with this one rather than left on the stack.
  const auto it = std::find(region_stack.begin(), region_stack.end(), region_.get());
  if (it != region_stack.end()) region_stack.erase(it, region_stack.end());
}

ForwardGroupRecorder::ForwardGroupRecorder() { recorders.push_back(this); }

ForwardGroupRecorder::~ForwardGroupRecorder() {
  const auto it = std::find(recorders.begin(), recorders.end(), this);
  if (it != recorders.end()) recorders.erase(it);
}

void ForwardGroupRecorder::add(const void* owner, const DelayedScalingGroup& group) {
  if (!owners_.insert(owner).second) return;
  groups_.push_back(group);
  scales_.emplace_back(group.scale.clone(), group.scale_inv.clone());
}

}  // namespace detail
}  // namespace amp8
