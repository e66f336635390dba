// LossScaler: Megatron's DynamicGradScaler state machine, static scaling, unscale + inf check.
#include "plugin/precision/loss_scaler.h"

#include <gtest/gtest.h>

#include <limits>

#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::SeededTest;

struct Expected {
  bool found_inf;
  double scale_after;
};

// Initial 256, window 3, hysteresis 2: growth after 3 clean steps; the first overflow after a
// growth only skips, the second backs off; a clean step between overflows does not refill the
// hysteresis (only a growth does), so the third overflow backs off at once.
TEST(LossScalerTest, FollowsMegatronHysteresisExactly) {
  LossScaler scaler(LossScalerOptions().initial_scale(256).growth_interval(3).hysteresis(2));
  const std::vector<Expected> sequence = {
      {false, 256}, {false, 256}, {false, 512},  // growth after the window
      {true, 512},  {true, 256},                 // hysteresis 2 → 1, then 0: back off
      {false, 256},                              // growth counter 1, hysteresis stays 0
      {true, 128},                               // hysteresis -1: back off immediately
      {false, 128}, {false, 128}, {false, 256},  // window again: grow, hysteresis refilled
      {true, 256},  {true, 128},  {true, 64},
  };
  for (size_t i = 0; i < sequence.size(); ++i) {
    scaler.update(sequence[i].found_inf);
    EXPECT_EQ(scaler.scale(), sequence[i].scale_after) << "after step " << i + 1;
  }
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(LossScalerTest, NeverBacksOffBelowMinScale) {
  LossScaler scaler(LossScalerOptions().initial_scale(8).min_scale(2).hysteresis(1));
  for (double expected : {4.0, 2.0, 2.0, 2.0}) {
    scaler.update(true);
    EXPECT_EQ(scaler.scale(), expected);
  }
}

TEST(LossScalerTest, StaticScaleNeverChanges) {
  LossScaler scaler(LossScalerOptions().loss_scale(128.0));
  EXPECT_FALSE(scaler.dynamic());
  for (bool inf : {true, true, false, true, false, false}) {
    scaler.update(inf);
    EXPECT_EQ(scaler.scale(), 128.0);
  }
}

TEST(LossScalerTest, NeMoDefaults) {
  LossScaler scaler;
  EXPECT_EQ(scaler.scale(), 4294967296.0);
  EXPECT_EQ(scaler.options().growth_interval(), 1000);
  EXPECT_EQ(scaler.options().hysteresis(), 2);
  EXPECT_EQ(scaler.options().min_scale(), 1.0);
}

class LossScalerUnscaleTest : public SeededTest {};

TEST_F(LossScalerUnscaleTest, UnscalesInPlaceAndFlagsNonFinite) {
  LossScaler scaler(LossScalerOptions().initial_scale(1024));
  auto a = torch::randn({37, 5}) * 1024, b = torch::randn({1481}) * 1024;
  const auto a0 = a.clone(), b0 = b.clone();
  auto found = scaler.unscale_({a, torch::Tensor(), b});
  EXPECT_EQ(found.item<float>(), 0.0f);
  EXPECT_TRUE(testing::BytesEqual(a, a0 / 1024));  // a power of two: exact
  EXPECT_TRUE(testing::BytesEqual(b, b0 / 1024));
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    auto c = torch::randn({3, 3});
    c[1][2] = bad;
    EXPECT_EQ(scaler.unscale_({a, c}).item<float>(), 1.0f) << bad;
  }
}

TEST_F(LossScalerUnscaleTest, SaveLoadRoundTripsTheState) {
  LossScaler scaler(LossScalerOptions().initial_scale(256).growth_interval(5).hysteresis(3));
  for (bool inf : {false, false, true, false}) scaler.update(inf);
  torch::serialize::OutputArchive out;
  scaler.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  std::istringstream stream(bytes.str());
  in.load_from(stream);
  LossScaler restored(LossScalerOptions().initial_scale(256).growth_interval(5).hysteresis(3));
  restored.load(in);
  EXPECT_EQ(restored.scale(), scaler.scale());
  EXPECT_EQ(restored.growth_tracker(), scaler.growth_tracker());
  EXPECT_EQ(restored.hysteresis_tracker(), scaler.hysteresis_tracker());
  for (bool inf : {false, true, true, false}) {
    scaler.update(inf);
    restored.update(inf);
    EXPECT_EQ(restored.scale(), scaler.scale());
  }
}

TEST(LossScalerTest, BadOptionsNameTheKnob) {
  auto message = [](const LossScalerOptions& options) {
    try {
      LossScaler scaler(options);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(LossScalerOptions().loss_scale(0.0)).find("loss_scale must be positive"), std::string::npos);
  EXPECT_NE(message(LossScalerOptions().loss_scale(-4.0)).find("loss_scale"), std::string::npos);
  EXPECT_NE(message(LossScalerOptions().initial_scale(0)).find("initial_loss_scale"), std::string::npos);
  EXPECT_NE(message(LossScalerOptions().min_scale(-1)).find("min_loss_scale"), std::string::npos);
  EXPECT_NE(message(LossScalerOptions().growth_interval(0)).find("loss_scale_window"), std::string::npos);
  EXPECT_NE(message(LossScalerOptions().hysteresis(0)).find("hysteresis"), std::string::npos);
  // A static scale with dynamic settings beside it (MixedPrecisionOptions refused the same; the
  // scaler on its own took them and ignored them).
  EXPECT_NE(message(LossScalerOptions().loss_scale(128.0).growth_interval(10).backoff_factor(0.25))
                .find("the dynamic loss-scaling settings growth_interval, backoff_factor do not apply with a "
                      "static loss_scale (128)"),
            std::string::npos);
  EXPECT_EQ(message(LossScalerOptions().loss_scale(128.0)), "no error");
}

TEST(LossScalerTest, UnscaleOnGpu_CUDA) {
  AMP8_REQUIRE_CUDA();
  at::manual_seed(3);
  LossScaler scaler(LossScalerOptions().initial_scale(65536));
  auto cpu = torch::randn({1481, 3}) * 65536;
  auto gpu = cpu.cuda();
  auto found = scaler.unscale_({gpu, cpu});
  EXPECT_EQ(found.item<float>(), 0.0f);
  EXPECT_TRUE(testing::BytesEqual(gpu.cpu(), cpu));
  gpu[7][1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(scaler.unscale_({cpu, gpu}).item<float>(), 1.0f);
}

}  // namespace
}  // namespace amp8
