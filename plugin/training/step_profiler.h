#pragma once
// Where a training step's time goes: a few steps recorded with LibTorch's Kineto profiler (the
// C++ side of torch.profiler), written as a Chrome / Perfetto trace and summarised as device
// time by category.

#include <array>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "plugin/training/trainer.h"

namespace at {
class RecordFunction;
}  // namespace at

namespace amp8 {

/// What a device kernel (or copy) is for, from its name.
enum class KernelCategory {
  kGemm,           ///< cuBLAS / cuBLASLt / CUTLASS matrix multiplies, FP8 included
  kAttention,      ///< flash / memory-efficient / cuDNN attention
  kNorm,           ///< LayerNorm, RMSNorm (amp8's and ATen's), forward and backward
  kQuantize,       ///< FP8 quantize / cast-transpose / amax / scale updates
  kOptimizer,      ///< Adam, AdamW, SGD, multi-tensor kernels, gradient norms
  kCommunication,  ///< NCCL
  kMemory,         ///< memcpy, memset
  kElementwise,    ///< the rest: bias, activations, residuals, casts, softmax, loss, reductions
};
inline constexpr int kNumKernelCategories = 8;
const char* to_string(KernelCategory category);
/// The category of a kernel named `name` (a CUDA kernel's demangled name as Kineto reports it).
KernelCategory categorize_kernel(std::string_view name);

/// One device activity of a recorded window: a kernel, memcpy or memset.
struct DeviceActivity {
  std::string name;
  uint64_t start_ns = 0, end_ns = 0;
  bool is_memory = false;  ///< memcpy / memset (categorized as kMemory whatever the name)
};

/// Device time of `steps` recorded steps, per step (every *_ms field is a per-step mean).
struct StepProfile {
  int64_t steps = 0;
  double wall_ms = 0;  ///< from the first step's start to the end of its last device work
  double busy_ms = 0;  ///< time at least one kernel or copy ran (the union of their intervals)
  double idle_ms = 0;  ///< wall_ms - busy_ms: the device waited (for the host, mostly)
  /// Summed durations by KernelCategory. Work on concurrent streams (NCCL beside compute)
  /// overlaps, so the sum can exceed busy_ms.
  std::array<double, kNumKernelCategories> category_ms{};
  double kernels = 0;  ///< activities per step
  /// Host side (StepRecorder fills these; summarize_steps leaves them 0): how long the host
  /// took to run a step (its "amp8::step" annotation), and how much of that it spent blocked in
  /// CUDA synchronizing calls (cudaStreamSynchronize, cudaDeviceSynchronize,
  /// cudaEventSynchronize, cudaMemcpy: e.g. an item() on a device value). host_ms - host_wait_ms
  /// is the host's own work; when it is close to wall_ms while the device idles, the step waits
  /// for the host (launches, autograd, LibTorch's dispatch), not the other way round.
  double host_ms = 0;
  double host_wait_ms = 0;
  /// The kernels that took the most time (per step), longest first, at most 20.
  std::vector<std::pair<std::string, double>> top_kernels;

  /// A table for a terminal: one line per category with ms/step and % of wall time.
  std::string table() const;
  /// One JSON object (steps, wall_ms, busy_ms, idle_ms, host_ms, host_wait_ms,
  /// kernels_per_step, a "categories"
  /// object of ms per step, and "top_kernels": [{"name", "ms"}]).
  std::string json() const;
};

/// Summarises the activities of a window [window_start_ns, window_end_ns) that ran `steps`
/// steps (activities outside the window are clipped to it).
StepProfile summarize_steps(std::vector<DeviceActivity> activities, uint64_t window_start_ns,
                            uint64_t window_end_ns, int64_t steps);

/// Records steps with Kineto: CPU ops always, CUDA kernels and copies when a GPU is present.
/// Each step between begin_step and end_step is a user annotation "amp8::step <n>" in the
/// trace; the profile's window runs from the first step's start to the end of the last step's
/// device work (stop() synchronizes the device). One recording per process at a time (Kineto's
/// rule).
class StepRecorder {
 public:
  StepRecorder();
  ~StepRecorder();
  StepRecorder(const StepRecorder&) = delete;
  StepRecorder& operator=(const StepRecorder&) = delete;

  void start();
  void begin_step(int64_t step);
  void end_step();
  /// Stops recording; writes `dir`/trace.json (chrome://tracing, ui.perfetto.dev),
  /// `dir`/step_profile.json and `dir`/step_profile.txt (creating `dir`), and returns the
  /// summary.
  StepProfile stop(const std::string& dir);
  bool recording() const { return recording_; }

 private:
  bool recording_ = false;
  int64_t steps_ = 0;
  std::unique_ptr<at::RecordFunction> step_scope_;
};

/// Trainer callback (Lightning's PyTorchProfiler): records the optimizer steps
/// [first_step, first_step + steps) (0-based; the first steps are slower: allocation, cuBLAS
/// plans), then writes `dir`/trace.json, step_profile.json and step_profile.txt and prints the
/// table to the trainer's log. A run shorter than first_step + steps records what it reaches.
class StepProfiler : public Callback {
 public:
  explicit StepProfiler(std::string dir, int64_t first_step = 10, int64_t steps = 3);
  /// A fit that resumes past the recorded steps is an error: it would record nothing.
  void on_train_start(Trainer& trainer) override;
  void on_train_batch_start(Trainer& trainer, int64_t step) override;
  void on_train_batch_end(Trainer& trainer, const StepMetrics& metrics) override;
  void on_train_end(Trainer& trainer) override;
  /// The summary, once the recorded steps are done.
  const std::optional<StepProfile>& profile() const { return profile_; }

 private:
  void finish(Trainer& trainer);

  std::string dir_;
  int64_t first_step_, steps_;
  int64_t recorded_from_ = 0;  // the first step recorded
  StepRecorder recorder_;
  std::optional<StepProfile> profile_;
};

}  // namespace amp8
