#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace amp8::recipes {

/// numpy.random.RandomState(seed), for the two calls Megatron-Core's GPTDataset makes on it:
/// `shuffle` of a 1-D array, and nothing else. The generator is MT19937 seeded the way numpy's
/// legacy seeding seeds an integer (init_genrand, identical to std::mt19937(seed)), and
/// `shuffle` is numpy's legacy Fisher-Yates: for i = n-1 down to 1, swap element i with element
/// `random_interval(i)`, numpy's masked rejection sampler (32-bit draws for bounds below 2^32,
/// two draws combined high-then-low above). The same seed and calls give the same permutation
/// as numpy, element for element.
class NumpyRandomState {
 public:
  /// Throws unless 0 <= seed < 2^32 (numpy's "Seed must be between 0 and 2**32 - 1").
  explicit NumpyRandomState(int64_t seed);

  /// numpy's legacy `random_interval(max)`: a uniform integer in [0, max].
  uint64_t random_interval(uint64_t max);

  /// `RandomState.shuffle(values)` for a 1-D array, in place.
  template <typename T>
  void shuffle(std::vector<T>& values) {
    for (size_t i = values.size() > 0 ? values.size() - 1 : 0; i >= 1; --i) {
      std::swap(values[i], values[random_interval(i)]);
    }
  }

 private:
  std::mt19937 generator_;
};

}  // namespace amp8::recipes
