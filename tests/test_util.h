#pragma once
// Shared helpers of the amp8 test suites.

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <ftw.h>
#include <unistd.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// Defined in a build with AddressSanitizer (gcc's and clang's spellings), for the few tests whose
// subject ASan changes: resident memory, address-space limits.
#if defined(__SANITIZE_ADDRESS__)
#define AMP8_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define AMP8_UNDER_ASAN 1
#endif
#endif

namespace amp8::testing {

// Removes a folder and everything in it (a missing one is fine). Not std::filesystem::remove_all:
// the torch 2.11 wheel's libtorch.so exports its own copy of that symbol, which the dynamic
// linker picks and which crashes on a non-empty folder.
inline void remove_tree(const std::string& path) {
  ::nftw(
      path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
      16, FTW_DEPTH | FTW_PHYS);
}

// The folders scratch_path made, removed with everything in them when the process exits (a
// run's scratch files do not pile up in /tmp); each only by the process that made it: a forked
// child inherits this object and must not remove its parent's files (nor leave its own).
class ScratchFolders {
 public:
  void add(const std::filesystem::path& folder) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const std::pair<pid_t, std::string> entry{::getpid(), folder.string()};
    if (std::find(folders_.begin(), folders_.end(), entry) == folders_.end()) folders_.push_back(entry);
  }
  ~ScratchFolders() {
    for (const auto& [owner, folder] : folders_) {
      if (owner == ::getpid()) remove_tree(folder);
    }
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<pid_t, std::string>> folders_;
};

inline ScratchFolders& scratch_folders() {
  static ScratchFolders folders;
  return folders;
}

// A path for a test's files, <TEST_TMPDIR or /tmp>/amp8_<suite>_<pid>/<name>, emptied; its
// parent exists, the path itself does not. The parent is removed when the process exits.
inline std::filesystem::path scratch_path(const std::string& suite, const std::string& name) {
  // An absolute name would replace the whole path, and its parent would be removed at exit.
  if (!std::filesystem::path(name).is_relative()) throw std::invalid_argument("scratch_path: name must be relative, got " + name);
  const char* base = std::getenv("TEST_TMPDIR");
  auto path = std::filesystem::path(base ? base : std::filesystem::temp_directory_path().string()) /
              ("amp8_" + suite + "_" + std::to_string(::getpid())) / name;
  remove_tree(path.string());
  std::filesystem::create_directories(path.parent_path());
  scratch_folders().add(path.parent_path());
  return path;
}

inline bool cuda_available() { return torch::cuda::is_available(); }

#define AMP8_REQUIRE_CUDA()                                                   \
  do {                                                                        \
    if (!::amp8::testing::cuda_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// A seeded fixture: every test draws its own random data from a fixed seed.
class SeededTest : public ::testing::Test {
 protected:
  void SetUp() override { at::manual_seed(20261129); }
};

// Byte-for-byte equality of two tensors of the same dtype and shape (FP8 or float). On a
// mismatch reports the count, the first index and both values.
inline ::testing::AssertionResult BytesEqual(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.sizes() != expected.sizes() || actual.scalar_type() != expected.scalar_type()) {
    return ::testing::AssertionFailure()
           << "shape/dtype differ: " << actual.sizes() << " " << actual.scalar_type() << " vs "
           << expected.sizes() << " " << expected.scalar_type();
  }
  auto a = actual.cpu().contiguous();
  auto e = expected.cpu().contiguous();
  const auto* pa = static_cast<const uint8_t*>(a.const_data_ptr());
  const auto* pe = static_cast<const uint8_t*>(e.const_data_ptr());
  const int64_t item = a.element_size();
  const int64_t n = a.numel();
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(pa + i * item, pe + i * item, item) != 0) {
      if (first < 0) first = i;
      ++mismatches;
    }
  }
  if (mismatches == 0) return ::testing::AssertionSuccess();
  auto af = a.reshape({-1}).to(at::kFloat), ef = e.reshape({-1}).to(at::kFloat);
  uint32_t ab = 0, eb = 0;
  std::memcpy(&ab, pa + first * item, item);
  std::memcpy(&eb, pe + first * item, item);
  return ::testing::AssertionFailure()
         << mismatches << " of " << n << " elements differ; first at flat index " << first
         << ": actual " << af[first].item<float>() << " (0x" << std::hex << ab << ") vs expected "
         << ef[first].item<float>() << " (0x" << eb << ")" << std::dec;
}

// Float equality where NaN equals NaN (amax and scales can legitimately be NaN).
inline ::testing::AssertionResult SameFloat(float actual, float expected) {
  if ((std::isnan(actual) && std::isnan(expected)) ||
      std::memcmp(&actual, &expected, sizeof(float)) == 0) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "actual " << actual << " vs expected " << expected;
}

// A float32 matrix from rows written inline: matrix({{1, 2}, {3, 4}}).
inline at::Tensor matrix(std::initializer_list<std::initializer_list<float>> rows) {
  const int64_t r = static_cast<int64_t>(rows.size());
  const int64_t c = r ? static_cast<int64_t>(rows.begin()->size()) : 0;
  auto out = at::empty({r, c}, at::kFloat);
  int64_t i = 0;
  for (const auto& row : rows) {
    TORCH_CHECK(static_cast<int64_t>(row.size()) == c, "matrix: ragged rows");
    int64_t j = 0;
    for (float v : row) out[i][j++] = v;
    ++i;
  }
  return out;
}

// Runs `fn` and checks that it throws a c10::Error whose message contains `text`.
template <typename Fn>
void ExpectErrorContaining(Fn&& fn, const std::string& text) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing: " << text;
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find(text), std::string::npos)
        << "error message: " << message << "\nexpected to contain: " << text;
  }
}

// The message of the c10::Error `fn` throws, "" when it throws none: for checks on what a
// message says and what it does not.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

inline float item(const at::Tensor& t) { return t.cpu().reshape({}).item<float>(); }

// Random, non-zero data with a wide dynamic range: normal values times powers of two in
// [2^-8, 2^8], plus a sign; no element is zero.
inline at::Tensor random_wide(at::IntArrayRef shape, at::ScalarType dtype) {
  auto normal = at::randn(shape, at::kFloat);
  auto exponent = at::randint(-8, 9, shape, at::kFloat);
  auto x = normal * at::pow(2.0, exponent);
  x = at::where(x == 0, at::full_like(x, 0.5f), x);
  return x.to(dtype);
}

// ‖actual − expected‖ / ‖expected‖ (Frobenius), computed in float64 on the CPU.
inline double relative_error(const at::Tensor& actual, const at::Tensor& expected) {
  auto a = actual.detach().cpu().to(at::kDouble);
  auto e = expected.detach().cpu().to(at::kDouble);
  return ((a - e).norm() / e.norm()).item<double>();
}

// Error bounds of one FP8 GEMM against fp64, relative in the Frobenius norm. Rounding to a
// format with m mantissa bits leaves a relative error uniform within half a spacing, and the
// spacing is at most 2^-m of the value: an RMS relative error of at most 2^-(m+1)/√3 per
// element (E4M3: 0.036, E5M2: 0.072), with delayed scaling keeping values out of the
// subnormal range. For random data the relative error of a product of two independently
// rounded operands is the root-sum-square of the two:
//   forward (E4M3 × E4M3):                √2 · 0.036          = 0.051
//   dgrad/wgrad, "hybrid" (E5M2 × E4M3):  √(0.072² + 0.036²)  = 0.081
//   dgrad/wgrad, "e4m3":                                        0.051
// A wrong scale, transpose or format gives errors near 1.
constexpr double kE4M3Rms = 0.0625 / 1.7320508;
constexpr double kE5M2Rms = 0.125 / 1.7320508;
const double kForwardBound = std::sqrt(2.0) * kE4M3Rms;
const double kHybridGradBound = std::sqrt(kE5M2Rms * kE5M2Rms + kE4M3Rms * kE4M3Rms);

inline std::string shape_name(int64_t rows, int64_t cols) {
  std::ostringstream os;
  os << rows << "x" << cols;
  return os.str();
}

// Live bytes of every CPU tensor allocated since the counter was installed: a pass-through
// wrapper around LibTorch's CPU allocator, installed on first use for the rest of the process
// (tensors it allocated may outlive any test, so it is never removed). Like the default CPU
// allocator it hands out data pointers that are their own deleter context, so raw_allocate
// works through it too.
class CpuAllocationCounter final : public c10::Allocator {
 public:
  static int64_t live_bytes() { return instance().live_.load(); }

  c10::DataPtr allocate(size_t n) override {
    auto inner = base_->allocate(n);
    void* data = inner.get();
    const auto device = inner.device();
    TORCH_CHECK(inner.get_context() == data, "CpuAllocationCounter: the wrapped CPU allocator "
                                              "does not use the data pointer as its context");
    const auto deleter = inner.get_deleter();
    inner.release_context();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_[data] = {static_cast<int64_t>(n), deleter};
    }
    live_ += static_cast<int64_t>(n);
    return {data, data, &CpuAllocationCounter::release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CpuAllocationCounter::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    base_->copy_data(dest, src, count);
  }

 private:
  struct Block {
    int64_t bytes;
    c10::DeleterFnPtr deleter;
  };
  static CpuAllocationCounter& instance() {
    static CpuAllocationCounter* counter = [] {
      auto* c = new CpuAllocationCounter(c10::GetCPUAllocator());
      c10::SetCPUAllocator(c, /*priority=*/100);
      return c;
    }();
    return *counter;
  }
  explicit CpuAllocationCounter(c10::Allocator* base) : base_(base) {}
  static void release(void* data) {
    auto& self = instance();
    Block block{};
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.blocks_.find(data);
      if (it == self.blocks_.end()) {
        // Allocated before the counter was installed and freed through it (raw_deallocate).
        if (auto base_deleter = self.base_->raw_deleter()) base_deleter(data);
        return;
      }
      block = it->second;
      self.blocks_.erase(it);
    }
    self.live_ -= block.bytes;
    if (block.deleter) block.deleter(data);
  }
  c10::Allocator* base_;
  std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;
  std::atomic<int64_t> live_{0};
};

}  // namespace amp8::testing
