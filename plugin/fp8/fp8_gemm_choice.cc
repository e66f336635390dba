#include "plugin/fp8/fp8_gemm_choice.h"

#include <c10/util/Exception.h>

#include <cstddef>

#include "plugin/fp8/detail/fp8_gemm_table.h"

namespace amp8 {
namespace {

// Index of the largest grid value ≤ v, or -1 when v is below the grid.
template <size_t N>
int floor_index(const int64_t (&grid)[N], int64_t v) {
  int index = -1;
  for (size_t i = 0; i < N && grid[i] <= v; ++i) index = static_cast<int>(i);
  return index;
}

}  // namespace

bool fp8_gemm_pays_off(int64_t rows, int64_t in_features, int64_t out_features, bool fp8_params) {
  const int r = floor_index(detail::kGridRows, rows);
  const int i = floor_index(detail::kGridFeatures, in_features);
  const int o = floor_index(detail::kGridFeatures, out_features);
  return r >= 0 && i >= 0 && o >= 0 && detail::kPaysOff[fp8_params ? 1 : 0][r][i][o];
}

bool fp8_gemm_chosen(int64_t rows, int64_t in_features, int64_t out_features,
                     int64_t fp8_min_gemm_size, bool fp8_params) {
  if (fp8_min_gemm_size == kFp8GemmSizeByShape) {
    return fp8_gemm_pays_off(rows, in_features, out_features, fp8_params);
  }
  return rows * in_features * out_features >= fp8_min_gemm_size;
}

void check_fp8_min_gemm_size(int64_t fp8_min_gemm_size, const char* knob) {
  TORCH_CHECK(fp8_min_gemm_size >= 0 || fp8_min_gemm_size == kFp8GemmSizeByShape, knob,
              " must be >= 0 (rows x in x out of the smallest GEMM in FP8; 0: every GEMM) or ",
              kFp8GemmSizeByShape, " (per shape, where FP8 was measured faster), got ",
              fp8_min_gemm_size);
}

}  // namespace amp8
