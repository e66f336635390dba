#pragma once
// Shared helpers of the GPU benchmarks: CUDA-event timing (median of many repetitions after a
// warm-up) and one JSON object per case on stdout, with the fields of docs/benchmarks.md ("Result rows").

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace amp8::bench {

// Median milliseconds of `fn` over `reps` timed runs after `warmup` untimed ones. Each run is
// bracketed by its own pair of CUDA events; the host does not wait between runs (it syncs once
// at the end), so host-side launch overhead overlaps earlier GPU work, as in a training loop.
inline double median_ms(const std::function<void()>& fn, int warmup = 10, int reps = 50) {
  for (int i = 0; i < warmup; ++i) fn();
  auto stream = at::cuda::getCurrentCUDAStream();
  std::vector<at::cuda::CUDAEvent> starts(reps), stops(reps);
  for (int i = 0; i < reps; ++i) {
    starts[i] = at::cuda::CUDAEvent(cudaEventDefault);
    stops[i] = at::cuda::CUDAEvent(cudaEventDefault);
  }
  for (int i = 0; i < reps; ++i) {
    starts[i].record(stream);
    fn();
    stops[i].record(stream);
  }
  stream.synchronize();
  std::vector<double> times;
  times.reserve(reps);
  for (int i = 0; i < reps; ++i) times.push_back(starts[i].elapsed_time(stops[i]));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// CUDA autocast to bf16 for a scope (the baselines' mixed precision), cast cache cleared at exit.
struct Bf16Autocast {
  Bf16Autocast() {
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  }
  ~Bf16Autocast() {
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
  }
};

inline std::string command_line(int argc, char** argv) {
  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += (i ? " " : "") + std::string(argv[i]);
  return cmd;
}

inline std::string today() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

inline std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

// One case's JSON line. Strings and numbers are kept apart so numbers print unquoted.
class Record {
 public:
  Record(std::string name, std::string shape, std::string command) {
    set("case", std::move(name));
    set("shape", std::move(shape));
    set("device", at::cuda::getCurrentDeviceProperties()->name);
    set("torch", TORCH_VERSION);
    set("date", today());
    set("command", std::move(command));
  }
  Record& set(const std::string& key, const std::string& value) {
    fields_.emplace_back(key, "\"" + json_escape(value) + "\"");
    return *this;
  }
  Record& set(const std::string& key, const char* value) { return set(key, std::string(value)); }
  Record& set(const std::string& key, double value) {
    std::ostringstream os;
    os << std::setprecision(6) << value;
    fields_.emplace_back(key, os.str());
    return *this;
  }
  // ours_ms, baseline, baseline_ms and speedup = baseline_ms / ours_ms.
  Record& timing(double ours_ms, const std::string& baseline, double baseline_ms) {
    set("ours_ms", ours_ms);
    set("baseline", baseline);
    set("baseline_ms", baseline_ms);
    set("speedup", baseline_ms / ours_ms);
    return *this;
  }
  void print() const {
    std::cout << "{";
    for (size_t i = 0; i < fields_.size(); ++i) {
      std::cout << (i ? ", " : "") << "\"" << fields_[i].first << "\": " << fields_[i].second;
    }
    std::cout << "}" << std::endl;
  }

 private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

}  // namespace amp8::bench
