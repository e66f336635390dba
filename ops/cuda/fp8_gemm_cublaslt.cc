// FP8 GEMM through cuBLASLt: LibTorch's handle, workspace and current stream; descriptors in
// RAII holders, built once per (shape, dtypes, flags) with the algorithm chosen for them
// (fp8_gemm_algo_selection: the heuristic's first, or the fastest candidate measured) and cached
// per thread.

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "ops/detail/cuda_ops.h"

#define AMP8_CUBLAS_CHECK(expr)                                                             \
  do {                                                                                      \
    const cublasStatus_t amp8_status_ = (expr);                                             \
    TORCH_CHECK(amp8_status_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt error at ", __FILE__, ":", \
                __LINE__, ": ", cublasLtGetStatusString(amp8_status_), " (", #expr, ")");   \
  } while (0)

namespace amp8::detail {
namespace {

template <typename T, cublasStatus_t (*Destroy)(T)>
class LtObject {
 public:
  LtObject() = default;
  LtObject(const LtObject&) = delete;
  LtObject& operator=(const LtObject&) = delete;
  ~LtObject() {
    if (handle_ != nullptr) Destroy(handle_);
  }
  T* out() { return &handle_; }
  T get() const { return handle_; }

 private:
  T handle_ = nullptr;
};

using MatmulDesc = LtObject<cublasLtMatmulDesc_t, &cublasLtMatmulDescDestroy>;
using MatrixLayout = LtObject<cublasLtMatrixLayout_t, &cublasLtMatrixLayoutDestroy>;
using Preference = LtObject<cublasLtMatmulPreference_t, &cublasLtMatmulPreferenceDestroy>;

cudaDataType_t cuda_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return CUDA_R_32F;
    case at::kBFloat16:
      return CUDA_R_16BF;
    case at::kHalf:
      return CUDA_R_16F;
    case at::kFloat8_e4m3fn:
      return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2:
      return CUDA_R_8F_E5M2;
    default:
      TORCH_CHECK(false, "fp8_gemm: no cuBLASLt type for ", t);
  }
}

template <typename V>
void set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value) {
  AMP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

void make_layout(MatrixLayout& layout, cudaDataType_t type, int64_t rows, int64_t cols,
                 int64_t ld) {
  AMP8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(layout.out(), type, rows, cols, ld));
}

void check_aligned(const void* p, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "fp8_gemm: ", name,
              " must be 16-byte aligned for cuBLASLt FP8");
}

// The largest power of two up to 256 that divides the address. cuBLASLt's heuristic assumes
// 256-byte aligned matrices unless told otherwise (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES,
// default 256) and may pick an algorithm that reads a less aligned one wrongly; a view into a
// larger buffer (a narrowed or offset tensor) is aligned to 16 only.
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// Shape, dtypes, options, device, the two operands' scale modes and the four matrices'
// alignments (cuBLASLt's A, B, C, D: the algorithm chosen for one alignment is not valid for a
// smaller one).
using PlanKey = std::tuple<int64_t, int64_t, int64_t, int, int, int, int, int, int, bool, int,
                           int, int, std::array<uint32_t, 4>>;

// Everything about one GEMM configuration that does not change from call to call: the
// descriptors (with their fixed attributes) and the algorithm chosen for them (once chosen).
// Per call only the data and scale pointers are set. Plans are per thread, so no call waits on a
// lock and no two threads share a descriptor whose pointers they are setting.
struct GemmPlan {
  MatmulDesc desc;
  MatrixLayout a_layout, b_layout, c_layout, d_layout;
  cublasLtMatmulAlgo_t algo{};
  std::optional<Fp8GemmAlgoSelection> chosen_by;  // how `algo` was chosen; none yet
};

// kFastestMeasured: how many of the heuristic's candidates are timed, in how many rounds, and
// how many launches of each (after one to warm up) a round times together.
constexpr int kMaxCandidates = 8;
constexpr int kTimedRounds = 2;
constexpr int kTimedLaunches = 3;

std::map<PlanKey, std::unique_ptr<GemmPlan>>& plans() {
  thread_local std::map<PlanKey, std::unique_ptr<GemmPlan>> cache;
  return cache;
}

// One GEMM operand: FP8 data [rows, K] and its float32 scale_inv, one value
// (CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) or one per tile (the block-scaled modes).
struct Operand {
  const at::Tensor& data;
  const at::Tensor& scale_inv;
  int32_t scale_mode = 0;  // cublasLtMatmulMatrixScale_t
};

at::Tensor run_gemm(const Operand& a, const Operand& b, at::ScalarType out_dtype,
                    const Fp8GemmOptions& o) {
  const c10::cuda::CUDAGuard guard(a.data.device());
  const int64_t m = a.data.size(0), k = a.data.size(1), n = b.data.size(0);
  const bool fp8_out = out_dtype == at::kFloat8_e4m3fn || out_dtype == at::kFloat8_e5m2;
  at::Tensor out = o.out.defined() ? o.out : at::empty({m, n}, a.data.options().dtype(out_dtype));
  if (m == 0) return out;
  check_aligned(a.data.const_data_ptr(), "a");
  check_aligned(b.data.const_data_ptr(), "b");
  check_aligned(out.const_data_ptr(), "out");
  if (o.residual.defined()) check_aligned(o.residual.const_data_ptr(), "residual");

  at::ScalarType bias_dtype = o.bias.defined() ? o.bias.scalar_type() : at::kFloat;
  // cuBLASLt's A is b, its B is a (see the layouts below); C is the residual, else `out`
  // unless D is FP8 (then C has no pointer).
  const void* c_source = o.residual.defined() ? o.residual.const_data_ptr() : out.const_data_ptr();
  const std::array<uint32_t, 4> alignments{
      alignment_of(b.data.const_data_ptr()), alignment_of(a.data.const_data_ptr()),
      fp8_out ? 256u : alignment_of(c_source), alignment_of(out.const_data_ptr())};
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  const PlanKey key{m,
                    n,
                    k,
                    static_cast<int>(a.data.scalar_type()),
                    static_cast<int>(b.data.scalar_type()),
                    static_cast<int>(out_dtype),
                    static_cast<int>(o.bias.defined() ? bias_dtype : at::kFloat),
                    static_cast<int>(o.use_fast_accum),
                    static_cast<int>(o.accumulate || o.residual.defined()),
                    o.out_amax.defined(),
                    static_cast<int>(a.data.device().index()),
                    a.scale_mode,
                    b.scale_mode,
                    alignments};
  auto& slot = plans()[key];
  if (!slot) {
    auto plan = std::make_unique<GemmPlan>();
    // Row-major Y[M,N] = A[M,K]·B[N,K]ᵀ is column-major Yᵀ[N,M] = op(B)·A with op = transpose:
    // cuBLASLt's "TN" layout, the only one Hopper's FP8 kernels take.
    AMP8_CUBLAS_CHECK(cublasLtMatmulDescCreate(plan->desc.out(), CUBLAS_COMPUTE_32F, CUDA_R_32F));
    auto* desc = plan->desc.get();
    set_attr(desc, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(CUBLAS_OP_T));
    set_attr(desc, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(CUBLAS_OP_N));
    set_attr(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(o.use_fast_accum));
    if (a.scale_mode != 0 || b.scale_mode != 0) {
#if CUBLAS_VERSION >= 120900
      set_attr(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, b.scale_mode);
      set_attr(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, a.scale_mode);
#else
      TORCH_CHECK(false, "fp8_blockwise_gemm: amp8 was built with cuBLAS ", CUBLAS_VERSION,
                  "; block-scaled FP8 GEMMs need cuBLAS 12.9 or newer");
#endif
    }
    if (o.bias.defined()) {
      set_attr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
      set_attr(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
               static_cast<int32_t>(cuda_dtype(bias_dtype)));
    }
    // C is read only when accumulating (C is `out`) or adding a residual (C is the residual).
    // With an FP8 D it must be a 16-bit type: the bias type, or fp16 without a bias (LibTorch's
    // _scaled_mm makes the same choice).
    const at::ScalarType c_dtype =
        fp8_out ? (o.bias.defined() ? bias_dtype : at::kHalf) : out_dtype;
    make_layout(plan->a_layout, cuda_dtype(b.data.scalar_type()), k, n, k);
    make_layout(plan->b_layout, cuda_dtype(a.data.scalar_type()), k, m, k);
    make_layout(plan->c_layout, cuda_dtype(c_dtype), n, m, n);
    make_layout(plan->d_layout, cuda_dtype(out_dtype), n, m, n);
    slot = std::move(plan);
  }
  GemmPlan& plan = *slot;
  // The pointers change from call to call; they are set before the heuristic query too.
  auto* desc = plan.desc.get();
  set_attr(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b.scale_inv.const_data_ptr<float>());
  set_attr(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a.scale_inv.const_data_ptr<float>());
  if (fp8_out) {
    set_attr(desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, o.out_scale.const_data_ptr<float>());
    if (o.out_amax.defined()) {
      set_attr(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, o.out_amax.mutable_data_ptr<float>());
    }
  }
  if (o.bias.defined()) set_attr(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, o.bias.const_data_ptr());
  const float alpha = 1.0f;
  const float beta = o.accumulate || o.residual.defined() ? 1.0f : 0.0f;
  // cuBLASLt rejects C == D with different descriptors, which an FP8 D always has; C is not
  // read at beta = 0, so it gets no pointer then.
  const void* c_ptr = fp8_out ? nullptr : c_source;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  auto launch = [&](const cublasLtMatmulAlgo_t& algo, void* d, const void* c) {
    return cublasLtMatmul(handle, desc, &alpha, b.data.const_data_ptr(), plan.a_layout.get(),
                          a.data.const_data_ptr(), plan.b_layout.get(), &beta, c,
                          plan.c_layout.get(), d, plan.d_layout.get(), &algo, workspace,
                          workspace_size, stream);
  };
  // The choice for this call: the measured one falls back to the heuristic's under
  // deterministic algorithms. While a CUDA graph is captured nothing is timed: a configuration
  // keeps the algorithm it has (the graph records it), and a new one takes the heuristic's.
  auto selection = fp8_gemm_algo_selection();
  if (at::globalContext().deterministicAlgorithms()) selection = Fp8GemmAlgoSelection::kHeuristic;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) selection = Fp8GemmAlgoSelection::kHeuristic;
  if (!plan.chosen_by || (plan.chosen_by != selection && capture == cudaStreamCaptureStatusNone)) {
    Preference preference;
    AMP8_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(preference.out()));
    const uint64_t max_workspace = workspace_size;
    AMP8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.get(),
                                                           CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &max_workspace, sizeof(max_workspace)));
    const cublasLtMatmulPreferenceAttributes_t alignment_attributes[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i) {
      AMP8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          preference.get(), alignment_attributes[i], &alignments[i], sizeof(alignments[i])));
    }
    const bool measure = selection == Fp8GemmAlgoSelection::kFastestMeasured;
    std::array<cublasLtMatmulHeuristicResult_t, kMaxCandidates> candidates{};
    int found = 0;
    AMP8_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(
        handle, desc, plan.a_layout.get(), plan.b_layout.get(), plan.c_layout.get(),
        plan.d_layout.get(), preference.get(), measure ? kMaxCandidates : 1, candidates.data(), &found));
    TORCH_CHECK(found > 0, "fp8_gemm: cuBLASLt has no algorithm for M=", m, " N=", n, " K=", k,
                " a=", a.data.scalar_type(), " b=", b.data.scalar_type(), " out=", out_dtype,
                o.bias.defined() ? " with bias" : "");
    // The plan changes only once the choice is made: an exception while measuring leaves it as
    // it was (chosen_by still names how its algorithm was chosen).
    cublasLtMatmulAlgo_t chosen = candidates[0].algo;
    // Accumulating, the candidates add into a copy of `out` in place (C = D), as the real
    // launch adds into `out`; so they do where the residual shares `out`'s storage (which they
    // must not overwrite before the real launch reads it). Where the copy does not fit in
    // memory, the heuristic's first is kept (and the configuration counts as chosen, not
    // measured again).
    const bool c_shares_out =
        o.accumulate || (o.residual.defined() && o.residual.is_alias_of(out));
    at::Tensor scratch;
    if (measure && found > 1) {
      try {
        scratch = c_shares_out ? out.clone() : out;
      } catch (const c10::OutOfMemoryError&) {
        scratch = at::Tensor();
      }
    }
    if (scratch.defined()) {
      // Every candidate is launched once to warm up; then, in each of kTimedRounds rounds,
      // every candidate in turn kTimedLaunches times between two events, all queued before one
      // synchronization. A candidate's time is its rounds' sum: interleaved rounds put no
      // candidate only at the start of the burst, when the clocks and caches are not yet what
      // the others see. They write `out` (each writes the result the real launch writes again,
      // from C = the residual where there is one, an FP8 D's amax too) or, when C shares
      // `out`, the copy (`out` is left as it was). A candidate that fails to launch is passed
      // over (its error cleared); the
      // heuristic's first is the fallback. An error an earlier kernel left is raised first, not
      // cleared with theirs.
      C10_CUDA_CHECK(cudaGetLastError());
      struct Timing {
        at::cuda::CUDAEvent start{cudaEventDefault}, stop{cudaEventDefault};
      };
      std::vector<std::array<Timing, kTimedRounds>> timings(found);
      std::vector<bool> launched(found, false);
      auto ok = [](cublasStatus_t status) {
        if (status == CUBLAS_STATUS_SUCCESS) return true;
        (void)cudaGetLastError();
        return false;
      };
      void* d = scratch.mutable_data_ptr();
      const void* c = o.accumulate ? d : c_ptr;
      for (int i = 0; i < found; ++i) launched[i] = ok(launch(candidates[i].algo, d, c));
      for (int round = 0; round < kTimedRounds; ++round) {
        for (int i = 0; i < found; ++i) {
          if (!launched[i]) continue;
          auto& t = timings[i][round];
          t.start.record();
          for (int r = 0; r < kTimedLaunches && launched[i]; ++r) {
            launched[i] = ok(launch(candidates[i].algo, d, c));
          }
          t.stop.record();
        }
      }
      float best_ms = std::numeric_limits<float>::infinity();
      for (int i = 0; i < found; ++i) {
        if (!launched[i]) continue;
        float ms = 0.0f;
        for (auto& t : timings[i]) {
          t.stop.synchronize();
          ms += t.start.elapsed_time(t.stop);
        }
        ++fp8_gemm_candidates_timed;
        if (ms < best_ms) {
          best_ms = ms;
          chosen = candidates[i].algo;
        }
      }
    }
    plan.algo = chosen;
    plan.chosen_by = selection;
  }
  AMP8_CUBLAS_CHECK(launch(plan.algo, out.mutable_data_ptr(), c_ptr));
  return out;
}

}  // namespace

at::Tensor fp8_gemm_cuda(const Fp8Tensor& a, const Fp8Tensor& b, at::ScalarType out_dtype,
                         const Fp8GemmOptions& options) {
  return run_gemm({a.data, a.scale_inv}, {b.data, b.scale_inv}, out_dtype, options);
}

at::Tensor fp8_blockwise_gemm_cuda(const Fp8BlockwiseTensor& a, const Fp8BlockwiseTensor& b,
                                   at::ScalarType out_dtype, const Fp8GemmOptions& options) {
#if CUBLAS_VERSION >= 120900
  const auto* properties = at::cuda::getDeviceProperties(a.data.device().index());
  TORCH_CHECK(properties->major == 9 && cublasLtGetVersion() >= 120900,
              "fp8_blockwise_gemm: cuBLASLt's block-scaled FP8 GEMMs run on Hopper (sm_90) with "
              "cuBLAS 12.9 or newer; this is sm_", properties->major, properties->minor,
              " with cuBLASLt ", cublasLtGetVersion());
  const auto mode = [](Fp8BlockShape block) {
    return static_cast<int32_t>(block == Fp8BlockShape::k1x128
                                    ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                    : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F);
  };
  return run_gemm({a.data, a.scale_inv, mode(a.block)}, {b.data, b.scale_inv, mode(b.block)},
                  out_dtype, options);
#else
  TORCH_CHECK(false, "fp8_blockwise_gemm: amp8 was built with cuBLAS ", CUBLAS_VERSION,
              "; block-scaled FP8 GEMMs need cuBLAS 12.9 or newer");
#endif
}

}  // namespace amp8::detail
