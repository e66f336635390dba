#include "recipes/data/numpy_random_state.h"

#include <c10/util/Exception.h>

namespace amp8::recipes {

NumpyRandomState::NumpyRandomState(int64_t seed) {
  TORCH_CHECK(seed >= 0 && seed <= int64_t{0xffffffff},
              "random_seed must be between 0 and 2**32 - 1 (numpy.random.RandomState), got ", seed);
  generator_.seed(static_cast<std::mt19937::result_type>(seed));
}

uint64_t NumpyRandomState::random_interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value = 0;
  if (max <= 0xffffffffULL) {
    do {
      value = static_cast<uint32_t>(generator_()) & mask;
    } while (value > max);
  } else {
    do {
      const uint64_t high = static_cast<uint32_t>(generator_());
      const uint64_t low = static_cast<uint32_t>(generator_());
      value = ((high << 32) | low) & mask;
    } while (value > max);
  }
  return value;
}

}  // namespace amp8::recipes
