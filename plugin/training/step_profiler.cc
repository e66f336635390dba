#include "plugin/training/step_profiler.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <ostream>
#include <sstream>

namespace amp8 {

namespace {

constexpr std::string_view kStepAnnotation = "amp8::step ";

bool contains_any(std::string_view haystack, std::initializer_list<std::string_view> needles) {
  for (auto needle : needles) {
    if (haystack.find(needle) != std::string_view::npos) return true;
  }
  return false;
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  TORCH_CHECK(out.good(), "StepRecorder: could not write ", path);
}

}  // namespace

const char* to_string(KernelCategory category) {
  switch (category) {
    case KernelCategory::kGemm: return "gemm";
    case KernelCategory::kAttention: return "attention";
    case KernelCategory::kNorm: return "norm";
    case KernelCategory::kQuantize: return "quantize_cast";
    case KernelCategory::kOptimizer: return "optimizer";
    case KernelCategory::kCommunication: return "communication";
    case KernelCategory::kMemory: return "memcpy_memset";
    case KernelCategory::kElementwise: return "elementwise_other";
  }
  return "?";
}

KernelCategory categorize_kernel(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  // The order matters: attention kernels are built from CUTLASS GEMM pieces, FP8 GEMMs name
  // their e4m3 operands, and LayerNorm kernels may write FP8.
  if (contains_any(lower, {"nccl"})) return KernelCategory::kCommunication;
  if (lower.rfind("memcpy", 0) == 0 || lower.rfind("memset", 0) == 0) {
    return KernelCategory::kMemory;
  }
  if (contains_any(lower, {"flash", "fmha", "attention", "attn"})) {
    return KernelCategory::kAttention;
  }
  if (contains_any(lower, {"layer_norm", "layernorm", "rms_norm", "rmsnorm"})) {
    return KernelCategory::kNorm;
  }
  // Before the optimizer's names: quantize_many_kernel runs over multi_tensor_apply's tables.
  if (contains_any(lower, {"quantize"})) return KernelCategory::kQuantize;
  if (contains_any(lower, {"adam", "sgd", "multi_tensor", "foreach", "lpnorm", "norm_kernel"})) {
    return KernelCategory::kOptimizer;
  }
  if (contains_any(lower, {"gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "splitk"})) {
    return KernelCategory::kGemm;
  }
  if (contains_any(lower, {"quantize", "cast_transpose", "amax", "scaling_kernel", "fp8", "float8",
                           "e4m3", "e5m2", "byte_transpose", "direct_copy"})) {
    return KernelCategory::kQuantize;
  }
  return KernelCategory::kElementwise;
}

StepProfile summarize_steps(std::vector<DeviceActivity> activities, uint64_t window_start_ns,
                            uint64_t window_end_ns, int64_t steps) {
  TORCH_CHECK(steps >= 1, "summarize_steps: steps must be >= 1, got ", steps);
  TORCH_CHECK(window_end_ns > window_start_ns, "summarize_steps: the window must end after it "
              "starts, got [", window_start_ns, ", ", window_end_ns, ")");
  StepProfile profile;
  profile.steps = steps;
  const double per_step_ms = 1e-6 / static_cast<double>(steps);
  profile.wall_ms = static_cast<double>(window_end_ns - window_start_ns) * per_step_ms;
  for (auto& a : activities) {
    a.start_ns = std::clamp(a.start_ns, window_start_ns, window_end_ns);
    a.end_ns = std::clamp(a.end_ns, a.start_ns, window_end_ns);
  }
  std::sort(activities.begin(), activities.end(),
            [](const DeviceActivity& a, const DeviceActivity& b) { return a.start_ns < b.start_ns; });
  uint64_t busy = 0, covered_until = window_start_ns;
  std::map<std::string, double> by_name;
  int64_t counted = 0;
  for (const auto& a : activities) {
    if (a.end_ns == a.start_ns) continue;  // wholly outside the window
    ++counted;
    const double ms = static_cast<double>(a.end_ns - a.start_ns) * per_step_ms;
    const auto category = a.is_memory ? KernelCategory::kMemory : categorize_kernel(a.name);
    profile.category_ms[static_cast<int>(category)] += ms;
    by_name[a.name] += ms;
    // The union of the intervals, in start order.
    if (a.end_ns > covered_until) {
      busy += a.end_ns - std::max(a.start_ns, covered_until);
      covered_until = a.end_ns;
    }
  }
  profile.kernels = static_cast<double>(counted) / static_cast<double>(steps);
  profile.busy_ms = static_cast<double>(busy) * per_step_ms;
  profile.idle_ms = profile.wall_ms - profile.busy_ms;
  profile.top_kernels.assign(by_name.begin(), by_name.end());
  std::sort(profile.top_kernels.begin(), profile.top_kernels.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  if (profile.top_kernels.size() > 20) profile.top_kernels.resize(20);
  return profile;
}

std::string StepProfile::table() const {
  std::ostringstream out;
  out << std::fixed << std::setprecision(2);
  auto line = [&](const std::string& what, double ms) {
    out << "  " << std::left << std::setw(20) << what << std::right << std::setw(10) << ms
        << " ms " << std::setw(7) << (wall_ms > 0 ? 100.0 * ms / wall_ms : 0.0) << " %\n";
  };
  out << "device time per step (mean of " << steps << " steps; " << std::setprecision(0)
      << kernels << " kernels and copies per step)\n" << std::setprecision(2);
  for (int c = 0; c < kNumKernelCategories; ++c) {
    line(to_string(static_cast<KernelCategory>(c)), category_ms[c]);
  }
  line("busy (union)", busy_ms);
  line("idle", idle_ms);
  line("wall", wall_ms);
  out << "host time per step\n";
  line("host (step)", host_ms);
  line("  waiting (sync)", host_wait_ms);
  line("  working", host_ms - host_wait_ms);
  out << "longest kernels (ms per step):\n";
  for (size_t i = 0; i < top_kernels.size() && i < 10; ++i) {
    std::string name = top_kernels[i].first;
    if (name.size() > 100) name = name.substr(0, 97) + "...";
    out << "  " << std::setw(8) << top_kernels[i].second << "  " << name << "\n";
  }
  return out.str();
}

std::string StepProfile::json() const {
  std::ostringstream out;
  out << std::setprecision(6);
  out << "{\"steps\": " << steps << ", \"wall_ms\": " << wall_ms << ", \"busy_ms\": " << busy_ms
      << ", \"idle_ms\": " << idle_ms << ", \"host_ms\": " << host_ms
      << ", \"host_wait_ms\": " << host_wait_ms << ", \"kernels_per_step\": " << kernels
      << ", \"categories\": {";
  for (int c = 0; c < kNumKernelCategories; ++c) {
    out << (c ? ", " : "") << json_string(to_string(static_cast<KernelCategory>(c))) << ": "
        << category_ms[c];
  }
  out << "}, \"top_kernels\": [";
  for (size_t i = 0; i < top_kernels.size(); ++i) {
    out << (i ? ", " : "") << "{\"name\": " << json_string(top_kernels[i].first)
        << ", \"ms\": " << top_kernels[i].second << "}";
  }
  out << "]}";
  return out.str();
}

StepRecorder::StepRecorder() = default;

StepRecorder::~StepRecorder() {
  if (!recording_) return;
  step_scope_.reset();
  try {
    torch::autograd::profiler::disableProfiler();
  } catch (...) {
    // Nothing to report from a destructor; the recording is lost.
  }
}

void StepRecorder::start() {
  TORCH_CHECK(!recording_, "StepRecorder::start: already recording");
  namespace prof = torch::profiler::impl;
  std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
  if (torch::cuda::is_available()) activities.insert(prof::ActivityType::CUDA);
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  recording_ = true;
  steps_ = 0;
}

void StepRecorder::begin_step(int64_t step) {
  TORCH_CHECK(recording_, "StepRecorder::begin_step: not recording (call start() first)");
  step_scope_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (step_scope_->isActive()) step_scope_->before(std::string(kStepAnnotation) + std::to_string(step));
  ++steps_;
}

void StepRecorder::end_step() { step_scope_.reset(); }

StepProfile StepRecorder::stop(const std::string& dir) {
  TORCH_CHECK(recording_, "StepRecorder::stop: not recording");
  step_scope_.reset();
  if (torch::cuda::is_available()) torch::cuda::synchronize();
  recording_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  TORCH_CHECK(result, "StepRecorder::stop: the profiler returned no result");
  TORCH_CHECK(steps_ >= 1, "StepRecorder::stop: no step was recorded (begin_step)");

  uint64_t window_start = std::numeric_limits<uint64_t>::max(), window_end = 0;
  std::vector<std::pair<uint64_t, uint64_t>> step_intervals;  // the host's, one per step
  std::vector<DeviceActivity> device;
  std::vector<std::pair<uint64_t, uint64_t>> sync_calls;  // host intervals blocked on the GPU
  using libkineto::ActivityType;
  for (const auto& event : result->events()) {
    const auto type = static_cast<ActivityType>(event.activityType());
    if (type == ActivityType::CONCURRENT_KERNEL || type == ActivityType::GPU_MEMCPY ||
        type == ActivityType::GPU_MEMSET) {
      device.push_back({event.name(), event.startNs(), event.endNs(),
                        type != ActivityType::CONCURRENT_KERNEL});
    } else if (type == ActivityType::CUDA_RUNTIME || type == ActivityType::CUDA_DRIVER) {
      const auto& name = event.name();
      if (name.find("Synchronize") != std::string::npos || name == "cudaMemcpy") {
        sync_calls.emplace_back(event.startNs(), event.endNs());
      }
    } else if (type != ActivityType::GPU_USER_ANNOTATION &&
               event.name().rfind(kStepAnnotation, 0) == 0) {
      window_start = std::min(window_start, event.startNs());
      window_end = std::max(window_end, event.endNs());
      step_intervals.emplace_back(event.startNs(), event.endNs());
    }
  }
  TORCH_CHECK(window_end > window_start, "StepRecorder::stop: the trace holds no \"",
              kStepAnnotation, "<n>\" annotation");
  // The last step's device work may finish after its host side returned.
  for (const auto& a : device) {
    if (a.start_ns >= window_start) window_end = std::max(window_end, a.end_ns);
  }
  auto profile = summarize_steps(std::move(device), window_start, window_end, steps_);
  uint64_t host_ns = 0, wait_ns = 0;
  for (const auto& [step_start, step_end] : step_intervals) {
    host_ns += step_end - step_start;
    for (const auto& [start, end] : sync_calls) {
      const uint64_t s = std::max(start, step_start), e = std::min(end, step_end);
      if (e > s) wait_ns += e - s;
    }
  }
  profile.host_ms = host_ns / 1e6 / steps_;
  profile.host_wait_ms = wait_ns / 1e6 / steps_;

  std::filesystem::create_directories(dir);
  result->save((std::filesystem::path(dir) / "trace.json").string());
  write_file((std::filesystem::path(dir) / "step_profile.json").string(), profile.json() + "\n");
  write_file((std::filesystem::path(dir) / "step_profile.txt").string(), profile.table());
  return profile;
}

StepProfiler::StepProfiler(std::string dir, int64_t first_step, int64_t steps)
    : dir_(std::move(dir)), first_step_(first_step), steps_(steps) {
  TORCH_CHECK(!dir_.empty(), "StepProfiler: dir must name a folder");
  TORCH_CHECK(first_step_ >= 0, "StepProfiler: first_step must be >= 0, got ", first_step_);
  TORCH_CHECK(steps_ >= 1, "StepProfiler: steps must be >= 1, got ", steps_);
}

void StepProfiler::on_train_start(Trainer& trainer) {
  TORCH_CHECK(profile_ || first_step_ + steps_ > trainer.global_step(), "StepProfiler: steps [", first_step_, ", ",
              first_step_ + steps_, ") come before this fit's first step ", trainer.global_step(),
              " (it resumed from a checkpoint), so nothing would be recorded; give a first step of at least ",
              trainer.global_step());
}

void StepProfiler::on_train_batch_start(Trainer& trainer, int64_t step) {
  if (profile_ || step < first_step_ || step >= first_step_ + steps_) return;
  if (!recorder_.recording()) {
    recorded_from_ = step;  // first_step_, unless the fit resumed past it
    recorder_.start();
  }
  recorder_.begin_step(step);
}

void StepProfiler::on_train_batch_end(Trainer& trainer, const StepMetrics& metrics) {
  if (!recorder_.recording()) return;
  recorder_.end_step();
  // metrics.step is 1-based: the step that just ran is metrics.step - 1.
  if (metrics.step >= first_step_ + steps_) finish(trainer);
}

void StepProfiler::on_train_end(Trainer& trainer) {
  if (recorder_.recording()) finish(trainer);
}

void StepProfiler::finish(Trainer& trainer) {
  profile_ = recorder_.stop(dir_);
  if (trainer.log) {
    *trainer.log << "profile of steps " << recorded_from_ << ".." << recorded_from_ + profile_->steps - 1
                 << " (0-based) in " << dir_ << " (trace.json: chrome://tracing or "
                 << "ui.perfetto.dev)\n" << profile_->table() << std::flush;
  }
}

}  // namespace amp8
