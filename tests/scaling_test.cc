#include "ops/scaling.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>

#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::BytesEqual;
using ::testing::HasSubstr;
using testing::item;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(ComputeScaleTest, FormulaWithMargins) {
  // scale = (fp8_max / amax) / 2^margin
  EXPECT_EQ(compute_scale(1.0f, 9.0f, 448.0f, 0), 448.0f);
  EXPECT_EQ(compute_scale(1.0f, 9.0f, 448.0f, 1), 224.0f);
  EXPECT_EQ(compute_scale(1.0f, 9.0f, 448.0f, 3), 56.0f);
  EXPECT_EQ(compute_scale(7.0f, 9.0f, 57344.0f, 0), 57344.0f / 7.0f);
  EXPECT_EQ(compute_scale(3.5f, 9.0f, 448.0f, 1), 64.0f);
}

TEST(ComputeScaleTest, ZeroAndNonFiniteAmaxKeepThePreviousScale) {
  EXPECT_EQ(compute_scale(0.0f, 9.0f, 448.0f, 0), 9.0f);
  EXPECT_EQ(compute_scale(kNaN, 9.0f, 448.0f, 0), 9.0f);
  EXPECT_EQ(compute_scale(kInf, 9.0f, 448.0f, 0), 9.0f);
  EXPECT_EQ(compute_scale(-1.0f, 9.0f, 448.0f, 0), 9.0f);
}

TEST(ComputeScaleTest, OverflowBecomesFltMax) {
  EXPECT_EQ(compute_scale(1e-45f, 9.0f, 448.0f, 0), FLT_MAX);  // 448 / denormal = inf
  EXPECT_EQ(compute_scale(1e-40f, 9.0f, 448.0f, 0), FLT_MAX);
  EXPECT_EQ(compute_scale(1e-40f, 9.0f, 448.0f, 3), FLT_MAX);  // inf / 8 is still inf
}

TEST(ComputeScaleTest, BadMargin) {
  try {
    compute_scale(1.0f, 1.0f, 448.0f, -1);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("margin must be in [0, 126], got -1"));
  }
}

DelayedScalingGroup make_group(at::Tensor history, float initial_scale = 1.0f) {
  const int64_t slots = history.size(1);
  return {history, at::full({slots}, initial_scale), at::full({slots}, 1.0f / initial_scale)};
}

TEST(DelayedScalingTest, HistoryOfOne) {
  auto g = make_group(testing::matrix({{2.0f, 0.0f}}));
  delayed_scaling_update(std::vector{g}, {Fp8Format::kE4M3, 0, AmaxComputeAlgo::kMax});
  EXPECT_TRUE(BytesEqual(g.scale, at::tensor({224.0f, 1.0f})));  // slot 1: amax 0 keeps 1
  EXPECT_TRUE(BytesEqual(g.scale_inv, at::tensor({1.0f / 224.0f, 1.0f})));
  EXPECT_TRUE(BytesEqual(g.amax_history, at::zeros({1, 2})));  // row 0 zeroed for the next step
}

TEST(DelayedScalingTest, HistoryOfFourRollsAndTakesTheMax) {
  // Row 0 is the step just done; rows 1..3 are older steps.
  auto history = testing::matrix({{4.0f}, {1.0f}, {8.0f}, {2.0f}});
  auto g = make_group(history.clone());
  delayed_scaling_update(std::vector{g}, {Fp8Format::kE4M3, 0, AmaxComputeAlgo::kMax});
  EXPECT_EQ(item(g.scale), 448.0f / 8.0f);
  // Rolled towards the front: [1, 8, 2, 4], then row 0 zeroed.
  EXPECT_TRUE(BytesEqual(g.amax_history, testing::matrix({{0.0f}, {8.0f}, {2.0f}, {4.0f}})));

  // Four steps later the 8 has left the history.
  for (float amax : {3.0f, 0.5f, 1.0f}) {
    g.amax_history[0][0] = amax;
    delayed_scaling_update(std::vector{g}, {Fp8Format::kE4M3, 0, AmaxComputeAlgo::kMax});
  }
  // Window now holds 4 (oldest), 3, 0.5, 1: max 4.
  EXPECT_EQ(item(g.scale), 448.0f / 4.0f);
  g.amax_history[0][0] = 0.25f;
  delayed_scaling_update(std::vector{g}, {Fp8Format::kE4M3, 0, AmaxComputeAlgo::kMax});
  EXPECT_EQ(item(g.scale), 448.0f / 3.0f);  // the 4 dropped out: window 3, 0.5, 1, 0.25
}

TEST(DelayedScalingTest, MostRecentUsesRowZeroOnly) {
  auto g = make_group(testing::matrix({{4.0f}, {1.0f}, {8.0f}, {2.0f}}));
  delayed_scaling_update(std::vector{g}, {Fp8Format::kE5M2, 1, AmaxComputeAlgo::kMostRecent});
  EXPECT_EQ(item(g.scale), 57344.0f / 4.0f / 2.0f);
  EXPECT_TRUE(BytesEqual(g.amax_history, testing::matrix({{0.0f}, {8.0f}, {2.0f}, {4.0f}})));
}

TEST(DelayedScalingTest, NonFiniteAmaxesNeverPoisonTheScale) {
  auto g = make_group(testing::matrix({{kNaN, kInf, 0.0f, 2.0f}, {1.0f, 1.0f, 0.0f, kNaN}}), 5.0f);
  delayed_scaling_update(std::vector{g}, {Fp8Format::kE4M3, 0, AmaxComputeAlgo::kMax});
  // NaN or inf anywhere in the window, or an all-zero window: the previous scale stays.
  EXPECT_TRUE(BytesEqual(g.scale, at::tensor({5.0f, 5.0f, 5.0f, 5.0f})));
  EXPECT_TRUE(BytesEqual(g.scale_inv, at::full({4}, 1.0f / 5.0f)));
}

TEST(DelayedScalingTest, HistoryOf1024MatchesAReferenceLoop) {
  at::manual_seed(3);
  const int64_t len = 1024, slots = 5;
  auto history = at::rand({len, slots}) * 10;
  auto g = make_group(history.clone());
  delayed_scaling_update(std::vector{g}, {Fp8Format::kE4M3, 3, AmaxComputeAlgo::kMax});
  auto expected_scale = (448.0f / history.amax(0)) / 8.0f;
  EXPECT_TRUE(BytesEqual(g.scale, expected_scale));
  auto rolled = at::roll(history, -1, 0);
  rolled[0].zero_();
  EXPECT_TRUE(BytesEqual(g.amax_history, rolled));
}

TEST(DelayedScalingTest, ManyGroupsInOneCall) {
  std::vector<DelayedScalingGroup> groups;
  for (int i = 1; i <= 3; ++i) groups.push_back(make_group(at::full({2, i}, float(i))));
  delayed_scaling_update(groups, {Fp8Format::kE4M3, 0, AmaxComputeAlgo::kMax});
  for (int i = 1; i <= 3; ++i)
    EXPECT_TRUE(BytesEqual(groups[i - 1].scale, at::full({i}, 448.0f / i)));
}

TEST(DelayedScalingTest, BadInputsAreNamed) {
  auto expect_error = [](auto&& fn, const std::string& text) {
    testing::ExpectErrorContaining(fn, text);
  };
  DelayedScalingUpdateOptions options;
  expect_error(
      [&] {
        delayed_scaling_update(
            std::vector{make_group(at::ones({4, 2})), make_group(at::ones({3, 2}))}, options);
      },
      "groups[1].amax_history must have history_len 4 like groups[0], got 3");
  expect_error(
      [&] {
        delayed_scaling_update(
            std::vector<DelayedScalingGroup>{{at::ones({4, 2}), at::ones({3}), at::ones({2})}},
            options);
      },
      "groups[0].scale must have shape [2], got [3]");
  expect_error(
      [&] {
        delayed_scaling_update(std::vector<DelayedScalingGroup>{{at::ones({4, 2}, at::kDouble),
                                                                 at::ones({2}), at::ones({2})}},
                               options);
      },
      "groups[0].amax_history must be float32, got Double");
  expect_error(
      [&] {
        delayed_scaling_update(std::vector{make_group(at::ones({4, 2}))},
                               {Fp8Format::kE4M3, -2, AmaxComputeAlgo::kMax});
      },
      "fp8_margin must be in [0, 126], got -2");
  expect_error(
      [&] {
        delayed_scaling_update(
            std::vector<DelayedScalingGroup>{{at::ones({0, 2}), at::ones({2}), at::ones({2})}},
            options);
      },
      "history_len >= 1");
  expect_error([&] { amax_compute_algo_from_string("mean"); },
               "fp8_amax_compute_algo must be \"max\" or \"most_recent\", got \"mean\"");
  EXPECT_EQ(amax_compute_algo_from_string("most_recent"), AmaxComputeAlgo::kMostRecent);
}

// ---- CUDA vs CPU: bit for bit. ----

std::vector<DelayedScalingGroup> random_groups(int num_groups, int64_t len, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<DelayedScalingGroup> groups;
  for (int i = 0; i < num_groups; ++i) {
    const int64_t slots = 1 + (i * 7) % 5;
    auto history = at::rand({len, slots}) * at::pow(2.0, at::randint(-20, 20, {len, slots}));
    // Sprinkle zeros, NaN and inf, and leave some slots all-zero.
    history = at::where(at::rand({len, slots}) < 0.05, at::zeros_like(history), history);
    if (i % 11 == 3) history[len - 1][0] = kNaN;
    if (i % 13 == 4) history[0][0] = kInf;
    if (i % 17 == 5) history.select(1, 0).zero_();
    if (i % 19 == 6) history[0][0] = 1e-44f;  // scale overflows to FLT_MAX
    groups.push_back({history, at::rand({slots}) + 0.5, at::zeros({slots})});
  }
  return groups;
}

std::vector<DelayedScalingGroup> to_cuda(const std::vector<DelayedScalingGroup>& groups) {
  std::vector<DelayedScalingGroup> out;
  for (const auto& g : groups)
    out.push_back({g.amax_history.cuda(), g.scale.cuda(), g.scale_inv.cuda()});
  return out;
}

TEST(DelayedScalingGpuTest, MatchesCpuBitForBit_CUDA) {
  AMP8_REQUIRE_CUDA();
  // 10 groups take the small parameter table, 1000 the large one and two launches (960 each).
  for (int num_groups : {10, 1000}) {
    for (int64_t len : {1, 4, 1024, 1000}) {
      for (auto algo : {AmaxComputeAlgo::kMax, AmaxComputeAlgo::kMostRecent}) {
        for (int margin : {0, 1, 3}) {
          auto cpu = random_groups(num_groups, len, len * 10 + margin);
          auto gpu = to_cuda(cpu);
          const DelayedScalingUpdateOptions options{Fp8Format::kE5M2, margin, algo};
          for (int step = 0; step < 3; ++step) {
            delayed_scaling_update(cpu, options);
            delayed_scaling_update(gpu, options);
          }
          for (size_t i = 0; i < cpu.size(); ++i) {
            ASSERT_TRUE(BytesEqual(gpu[i].scale, cpu[i].scale)) << "group " << i << " len " << len;
            ASSERT_TRUE(BytesEqual(gpu[i].scale_inv, cpu[i].scale_inv)) << "group " << i;
            ASSERT_TRUE(BytesEqual(gpu[i].amax_history, cpu[i].amax_history)) << "group " << i;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace amp8
