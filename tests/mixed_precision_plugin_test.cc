// MixedPrecisionPlugin: presets, configuration errors, module conversion, FP32 master params,
// fp16 loss scaling in a training loop, autocast, and every precision trained against fp32.
#include "plugin/precision/mixed_precision_plugin.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "ops/fp8_format.h"
#include "ops/quantize.h"
#include "plugin/precision/autocast_guard.h"
#include "plugin/modules/fp8_layer_norm.h"
#include "plugin/modules/convert_module.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/optim/fused_optimizer.h"

#include <optional>
#include "plugin/training/export.h"
#include "plugin/training/trainer.h"
#include "recipes/precision.h"
#include "tests/test_models.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

using testing::BytesEqual;
using testing::error_of;
using testing::ExpectErrorContaining;
using testing::MlpData;
using testing::SequenceData;
using testing::TinyTransformer;

bool is_fp8(c10::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// Every tensor an optimizer holds (parameters and state) must be float32, Adam's moments in the
// dtypes asked for (float32 unless moments says otherwise).
void expect_optimizer_sees_only_fp32(torch::optim::Optimizer& optimizer, const AdamMomentDtypes& moments = {}) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  }
  int64_t state_tensors = 0;
  for (const auto& [key, state] : optimizer.state()) {
    if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(state.get())) {
      EXPECT_EQ(adam->exp_avg().scalar_type(), moments.exp_avg);
      EXPECT_EQ(adam->exp_avg_sq().scalar_type(), moments.exp_avg_sq);
      state_tensors += 2;
    } else if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      EXPECT_EQ(adamw->exp_avg().scalar_type(), moments.exp_avg);
      EXPECT_EQ(adamw->exp_avg_sq().scalar_type(), moments.exp_avg_sq);
      state_tensors += 2;
    } else if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      EXPECT_EQ(sgd->momentum_buffer().scalar_type(), at::kFloat);
      state_tensors += 1;
    }
  }
  EXPECT_GT(state_tensors, 0) << "the optimizer has stepped, it must hold state";
}

// One forward (in the plugin's context) and backward of an MSE loss; returns the loss.
template <typename Model>
torch::Tensor forward_backward(MixedPrecisionPlugin& plugin, Model& model, const torch::Tensor& x,
                               const torch::Tensor& y) {
  torch::Tensor loss;
  {
    auto context = plugin.forward_context();
    loss = torch::mse_loss(plugin.convert_output(model->forward(plugin.convert_input(x))), y);
  }
  plugin.backward(loss);
  return loss;
}

// ---- presets and configuration ----

TEST(PrecisionPresetsTest, CarryNeMoValues) {
  const auto bf16 = recipes::bf16_mixed();
  EXPECT_EQ(bf16.canonical_precision(), "bf16-mixed");
  EXPECT_EQ(bf16.resolved_params_dtype(), at::kBFloat16);
  EXPECT_FALSE(bf16.autocast_enabled());
  EXPECT_TRUE(bf16.grad_reduce_in_fp32());
  EXPECT_EQ(bf16.fp8(), "none");

  const auto fp16 = recipes::fp16_mixed();
  EXPECT_EQ(fp16.canonical_precision(), "16-mixed");
  EXPECT_EQ(fp16.resolved_params_dtype(), at::kHalf);
  EXPECT_FALSE(fp16.grad_reduce_in_fp32());
  EXPECT_EQ(fp16.fp16_initial_loss_scale(), 4294967296.0);
  EXPECT_EQ(fp16.fp16_loss_scale_window(), 1000);
  EXPECT_EQ(fp16.fp16_hysteresis(), 2);
  EXPECT_EQ(fp16.fp16_min_loss_scale(), 1.0);
  EXPECT_FALSE(fp16.fp16_loss_scale().has_value());

  for (const auto& fp8 : {recipes::bf16_with_fp8_mixed(), recipes::fp16_with_fp8_mixed()}) {
    EXPECT_EQ(fp8.fp8(), "hybrid");
    EXPECT_EQ(fp8.fp8_margin(), 0);
    EXPECT_EQ(fp8.fp8_amax_history_len(), 1024);
    EXPECT_EQ(fp8.fp8_amax_compute_algo(), "max");
    EXPECT_EQ(fp8.fp8_recipe(), "delayed");
    EXPECT_TRUE(fp8.fp8_params());
  }
  EXPECT_EQ(recipes::bf16_with_fp8_mixed().resolved_params_dtype(), at::kBFloat16);
  EXPECT_EQ(recipes::fp16_with_fp8_mixed().resolved_params_dtype(), at::kHalf);

  // Megatron-Bridge's current-scaling presets.
  for (const auto& fp8 : {recipes::bf16_with_fp8_current_scaling_mixed(),
                          recipes::fp16_with_fp8_current_scaling_mixed()}) {
    EXPECT_EQ(fp8.fp8(), "hybrid");
    EXPECT_EQ(fp8.fp8_recipe(), "tensorwise");
    EXPECT_EQ(fp8.num_layers_at_start_in_bf16(), 1);
    EXPECT_EQ(fp8.num_layers_at_end_in_bf16(), 1);
    EXPECT_TRUE(fp8.fp8_params());
  }
  EXPECT_EQ(recipes::bf16_with_fp8_current_scaling_mixed().resolved_params_dtype(), at::kBFloat16);
  EXPECT_EQ(recipes::fp16_with_fp8_current_scaling_mixed().resolved_params_dtype(), at::kHalf);
  EXPECT_EQ(recipes::fp16_with_fp8_current_scaling_mixed().fp16_initial_loss_scale(), 4294967296.0);
  // The recipe is part of the name a checkpoint records (delayed, the default, is unnamed).
  EXPECT_EQ(MixedPrecisionPlugin(recipes::bf16_with_fp8_current_scaling_mixed()).name(),
            "bf16-mixed fp8=hybrid recipe=tensorwise fp8_params");
  EXPECT_EQ(MixedPrecisionPlugin(recipes::bf16_with_fp8_mixed()).name(), "bf16-mixed fp8=hybrid fp8_params");

  // Megatron-Bridge's subchannel (blockwise) presets: no FP8 parameters, every layer in FP8.
  for (const auto& fp8 : {recipes::bf16_with_fp8_subchannel_scaling_mixed(),
                          recipes::fp16_with_fp8_subchannel_scaling_mixed()}) {
    EXPECT_EQ(fp8.fp8(), "hybrid");
    EXPECT_EQ(fp8.fp8_recipe(), "blockwise");
    EXPECT_EQ(fp8.num_layers_at_start_in_bf16(), 0);
    EXPECT_EQ(fp8.num_layers_at_end_in_bf16(), 0);
    EXPECT_FALSE(fp8.fp8_params());
  }
  EXPECT_EQ(recipes::fp16_with_fp8_subchannel_scaling_mixed().resolved_params_dtype(), at::kHalf);
  EXPECT_EQ(MixedPrecisionPlugin(recipes::bf16_with_fp8_subchannel_scaling_mixed()).name(),
            "bf16-mixed fp8=hybrid recipe=blockwise");
  EXPECT_EQ(recipes::bf16_with_fp8_subchannel_scaling_mixed().fp8_recipe_options().resolve().scaling,
            Fp8Scaling::kBlockwise);

  // Every field overrides Options-style, and the plugin converts from the options.
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8("e4m3").fp8_params(false);
  EXPECT_EQ(plugin.name(), "bf16-mixed fp8=e4m3");
  EXPECT_EQ(MixedPrecisionPlugin(recipes::fp16_mixed()).loss_scale(), 4294967296.0);
  EXPECT_EQ(MixedPrecisionPlugin(recipes::bf16_mixed()).loss_scale(), 1.0);
  EXPECT_FALSE(MixedPrecisionPlugin(recipes::bf16_mixed()).scaler().has_value());
  EXPECT_EQ(MixedPrecisionPlugin(MixedPrecisionOptions("fp16-mixed")).name(), "16-mixed");
  EXPECT_EQ(MixedPrecisionPlugin(MixedPrecisionOptions("32-true")).name(), "32");
}

TEST(MixedPrecisionOptionsTest, BadConfigurationNamesTheKnobAndAcceptedValues) {
  auto make = [](const MixedPrecisionOptions& options) {
    return [options] { MixedPrecisionPlugin plugin(options); };
  };
  ExpectErrorContaining(make(MixedPrecisionOptions("bf17-mixed")),
                        "precision must be \"32\" (or \"32-true\"), \"16-mixed\" (or "
                        "\"fp16-mixed\") or \"bf16-mixed\", got \"bf17-mixed\"");
  ExpectErrorContaining(make(MixedPrecisionOptions("32").fp8("hybrid")),
                        "precision \"32\" takes only fp8 = \"none\"");
  ExpectErrorContaining(make(recipes::bf16_mixed().fp8("e5m2")),
                        "fp8 must be \"none\", \"hybrid\" or \"e4m3\", got \"e5m2\"");
  ExpectErrorContaining(make(recipes::bf16_with_fp8_mixed().fp8_margin(-1)),
                        "fp8_margin must be in [0, 126], got -1");
  ExpectErrorContaining(make(recipes::bf16_with_fp8_mixed().fp8_amax_history_len(0)),
                        "fp8_amax_history_len must be in [1, 1048576], got 0");
  ExpectErrorContaining(make(recipes::bf16_with_fp8_mixed().fp8_amax_compute_algo("mean")),
                        "fp8_amax_compute_algo");
  ExpectErrorContaining(make(recipes::bf16_with_fp8_mixed().fp8_amax_compute_algo("mean")),
                        "\"mean\"");
  ExpectErrorContaining(make(recipes::bf16_with_fp8_mixed().fp8_recipe("current")),
                        "fp8_recipe must be \"delayed\", \"tensorwise\" or \"blockwise\"");
  ExpectErrorContaining(make(recipes::bf16_with_fp8_mixed().fp8_recipe("mxfp8")),
                        "needs GPUs with MXFP8 tensor cores: NVIDIA Blackwell (compute capability 10.0 or later)");
  EXPECT_NO_THROW(make(recipes::bf16_with_fp8_mixed().fp8_recipe("blockwise"))());  // weights in blocks
  EXPECT_NO_THROW(make(recipes::bf16_with_fp8_mixed().fp8_recipe("blockwise").fp8_params(false))());
  ExpectErrorContaining(make(recipes::bf16_with_fp8_mixed().fp8_margin(19)),
                        "fp8_margin 19 would scale every tensor's largest value to 448 / 2^19");
  EXPECT_NO_THROW(make(recipes::bf16_with_fp8_mixed().fp8_margin(kMaxFp8Margin))());
  // The loss scaler's checks name the plugin's own knobs (fp16_*).
  ExpectErrorContaining(make(recipes::fp16_mixed().fp16_loss_scale(0.0)),
                        "fp16_loss_scale must be positive and finite");
  ExpectErrorContaining(make(recipes::fp16_mixed().fp16_loss_scale(-8.0)), "fp16_loss_scale");
  ExpectErrorContaining(make(recipes::fp16_mixed().fp16_initial_loss_scale(0.0)),
                        "fp16_initial_loss_scale must be positive");
  ExpectErrorContaining(make(recipes::fp16_mixed().fp16_min_loss_scale(8e9)),
                        "fp16_min_loss_scale must be positive and <= fp16_initial_loss_scale");
  ExpectErrorContaining(make(recipes::fp16_mixed().fp16_loss_scale_window(0)), "fp16_loss_scale_window must be >= 1");
  ExpectErrorContaining(make(recipes::fp16_mixed().fp16_hysteresis(0)), "fp16_hysteresis must be >= 1");
  ExpectErrorContaining(make(recipes::bf16_mixed().fp8_params(true)),
                        "fp8_params = true needs fp8 = \"hybrid\" or \"e4m3\"");
  ExpectErrorContaining(make(recipes::bf16_mixed().params_dtype(at::kDouble)),
                        "params_dtype must be float32, float16 or bfloat16, got Double");
  ExpectErrorContaining(make(recipes::bf16_with_fp8_mixed().num_layers_at_start_in_bf16(-1)),
                        "num_layers_at_start_in_bf16 must be >= 0");
  ExpectErrorContaining(make(recipes::bf16_mixed().exp_avg_dtype(at::kHalf)),
                        "exp_avg_dtype must be float32 or bfloat16, got Half");
  ExpectErrorContaining(make(recipes::bf16_mixed().exp_avg_sq_dtype(at::kFloat8_e4m3fn)),
                        "exp_avg_sq_dtype must be float32 or bfloat16, got Float8_e4m3fn");
  ExpectErrorContaining(make(recipes::bf16_mixed().exp_avg_dtype(at::kBFloat16).fused_optimizer(false)),
                        "bfloat16 needs fused_optimizer = true");
  // Knobs the precision would drop: one recipe's under another, FP8's without FP8, loss scaling
  // outside 16-mixed, params in a dtype the precision does not compute in.
  ExpectErrorContaining(make(recipes::bf16_with_fp8_mixed().fp8_recipe("blockwise").fp8_margin(2)),
                        "fp8_margin applies to fp8_recipe \"delayed\" and \"tensorwise\"; \"blockwise\"");
  ExpectErrorContaining(make(recipes::bf16_with_fp8_current_scaling_mixed().fp8_amax_history_len(16)),
                        "fp8_amax_history_len and fp8_amax_compute_algo apply to fp8_recipe \"delayed\" only; "
                        "\"tensorwise\" scales every tensor by its own amax (got 16 and \"max\"");
  ExpectErrorContaining(make(recipes::bf16_with_fp8_mixed().fp8_recipe("blockwise").fp8_amax_compute_algo("most_recent")),
                        "apply to fp8_recipe \"delayed\" only");
  EXPECT_NO_THROW(make(recipes::bf16_with_fp8_current_scaling_mixed().fp8_margin(1))());
  ExpectErrorContaining(make(recipes::bf16_mixed().fp8_recipe("blockwise").num_layers_at_start_in_bf16(1)),
                        "the FP8 settings fp8_recipe, num_layers_at_start_in_bf16 need fp8 = \"hybrid\" or \"e4m3\"");
  ExpectErrorContaining(make(recipes::bf16_mixed().fp8_min_gemm_size(0)), "the FP8 settings fp8_min_gemm_size need");
  ExpectErrorContaining(make(recipes::bf16_mixed().fp16_loss_scale(128.0)),
                        "the loss-scaling settings fp16_loss_scale apply to precision \"16-mixed\" only");
  ExpectErrorContaining(make(MixedPrecisionOptions("32").fp16_hysteresis(4)), "fp16_hysteresis apply to");
  // A static loss scale has no growth, backoff or floor.
  ExpectErrorContaining(make(recipes::fp16_mixed().fp16_loss_scale(128.0).fp16_hysteresis(4).fp16_min_loss_scale(2.0)),
                        "the dynamic loss-scaling settings fp16_min_loss_scale, fp16_hysteresis do not apply with a "
                        "static fp16_loss_scale (128)");
  EXPECT_NO_THROW(make(recipes::fp16_mixed().fp16_loss_scale(128.0))());
  ExpectErrorContaining(make(recipes::bf16_mixed().params_dtype(at::kHalf)),
                        "params_dtype Half contradicts precision \"bf16-mixed\"");
  ExpectErrorContaining(make(MixedPrecisionOptions("32").params_dtype(at::kBFloat16)),
                        "params_dtype BFloat16 contradicts precision \"32\"");
  // Float32 parameters under a mixed precision compute in half precision only under autocast.
  ExpectErrorContaining(make(recipes::bf16_mixed().params_dtype(at::kFloat)),
                        "params_dtype Float under precision \"bf16-mixed\" needs autocast_enabled = true");
  EXPECT_NO_THROW(make(recipes::bf16_mixed().params_dtype(at::kFloat).autocast_enabled(true))());
  EXPECT_NO_THROW(make(MixedPrecisionOptions("32").params_dtype(at::kFloat))());
  // Autocast has no lower dtype to cast to under float32: the knob was once dropped silently.
  ExpectErrorContaining(make(MixedPrecisionOptions("32").autocast_enabled(true)),
                        "autocast_enabled = true needs a mixed precision (\"bf16-mixed\" or \"16-mixed\"); "
                        "precision \"32\" computes in float32");
}

// A FusedAdamW's own moment dtypes would be replaced by the precision's at every step: a mismatch
// is an error at connect.
TEST(MixedPrecisionPluginTest, AFusedOptimizersOwnMomentDtypesMustMatchThePrecisions) {
  auto model = testing::make_mlp();
  FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  optimizer.set_moment_dtypes({at::kBFloat16, at::kBFloat16});
  MixedPrecisionPlugin plugin(recipes::bf16_mixed());
  ExpectErrorContaining([&] { plugin.connect(*model, optimizer); },
                        "the optimizer's moment dtypes (set_moment_dtypes: BFloat16 / BFloat16) differ from the "
                        "precision's exp_avg_dtype / exp_avg_sq_dtype (Float / Float)");
  auto same_model = testing::make_mlp();
  FusedAdamW same(same_model->parameters(), torch::optim::AdamWOptions(1e-2));
  same.set_moment_dtypes({at::kBFloat16, at::kBFloat16});
  MixedPrecisionPlugin matching(recipes::bf16_mixed().exp_avg_dtype(at::kBFloat16).exp_avg_sq_dtype(at::kBFloat16));
  EXPECT_NO_THROW(matching.connect(*same_model, same));
}

// A float32-moment run whose state holds bfloat16 moments (a checkpoint of a bf16-moment run) and
// steps without the fused kernels (here: the CPU) widens them first: torch::optim's own step
// would otherwise update them in bfloat16 arithmetic, and keep them so.
TEST(MixedPrecisionPluginTest, AnUnfusedStepWidensBfloat16MomentsFromACheckpoint) {
  auto model = testing::make_mlp();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  MixedPrecisionPlugin plugin(recipes::bf16_mixed());
  plugin.connect(*model, optimizer);
  const testing::MlpData data(4);
  auto step = [&](int64_t i) {
    auto [x, y] = data.batch(i, 0, 16);
    forward_backward(plugin, model, x, y);
    EXPECT_TRUE(plugin.optimizer_step(optimizer));
  };
  step(0);
  std::vector<torch::Tensor> loaded;
  for (auto& [key, state] : optimizer.state()) {
    auto& adamw = static_cast<torch::optim::AdamWParamState&>(*state);
    adamw.exp_avg(adamw.exp_avg().to(at::kBFloat16));  // as a bf16-moment checkpoint loads
    adamw.exp_avg_sq(adamw.exp_avg_sq().to(at::kBFloat16));
    loaded.push_back(adamw.exp_avg().to(at::kFloat));
  }
  step(1);
  expect_optimizer_sees_only_fp32(optimizer);
  size_t i = 0;
  for (auto& [key, state] : optimizer.state()) {
    const auto& m = static_cast<torch::optim::AdamWParamState&>(*state).exp_avg();
    EXPECT_FALSE(m.equal(loaded[i++])) << "the widened moments were stepped";
  }
}

// A plugin never connected to a model saves its state (no masters, no layout) and another
// unconnected one loads it: the scaler's state comes back, nothing else is asked of the
// optimizer it does not have.
TEST(MixedPrecisionPluginTest, AnUnconnectedPluginLoadsWhatAnUnconnectedOneSaved) {
  const auto options = recipes::fp16_with_fp8_mixed().fp8_params_scaling("delayed").fp16_initial_loss_scale(1024);
  MixedPrecisionPlugin saved(options);
  torch::serialize::OutputArchive out;
  saved.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  const auto data = bytes.str();
  in.load_from(data.data(), data.size());
  auto other_start = options;
  MixedPrecisionPlugin loaded(other_start.fp16_initial_loss_scale(8));
  loaded.load(in);
  EXPECT_TRUE(loaded.master_params().empty());
  EXPECT_EQ(loaded.skipped_steps(), 0);
  ASSERT_TRUE(loaded.scaler().has_value());
  EXPECT_EQ(loaded.scaler()->scale(), 1024.0);
}

// The number of ranks a checkpoint says wrote it is checked before the Trainer looks for their
// files: none, fewer or more than an int holds is an error naming dp_world_size (a fuzzed file
// once claimed 2^31 - 1 ranks, another one that wraps to a negative int).
TEST(MixedPrecisionPluginTest, ACheckpointsImpossibleWorldSizeIsAnError) {
  MixedPrecisionPlugin plugin(recipes::bf16_mixed());
  auto written_by = [&](int64_t value) {
    torch::serialize::OutputArchive out;
    out.write("dp_world_size", torch::tensor({value}, at::kLong));
    std::ostringstream bytes;
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    const auto data = bytes.str();
    in.load_from(data.data(), data.size());
    return plugin.checkpoint_world_size(in);
  };
  EXPECT_EQ(written_by(1), 1);
  EXPECT_EQ(written_by(3), 3);
  EXPECT_EQ(written_by(std::numeric_limits<int>::max()), std::numeric_limits<int>::max());
  for (const int64_t bad : {int64_t{0}, int64_t{-2}, int64_t{1} << 31, (int64_t{1} << 32) + 2}) {
    ExpectErrorContaining([&] { written_by(bad); },
                          "dp_world_size: expected a number of data-parallel ranks (1 to 2147483647), "
                          "the checkpoint holds " + std::to_string(bad));
  }
  torch::serialize::InputArchive unsharded;  // written before the field existed: one rank
  EXPECT_EQ(plugin.checkpoint_world_size(unsharded), 1);
}

// bfloat16 moments live only in the fused Adam / AdamW step: any other optimizer is named at
// connect instead of training with float32 moments.
TEST(MixedPrecisionPluginTest, Bfloat16MomentsWithAnOptimizerThatCannotKeepThemAreAnError) {
  for (const char* kind : {"sgd", "rmsprop", "amsgrad"}) {
    SCOPED_TRACE(kind);
    auto model = testing::make_mlp();
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (std::string(kind) == "sgd") {
      optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    } else if (std::string(kind) == "rmsprop") {
      optimizer = std::make_unique<torch::optim::RMSprop>(model->parameters(), torch::optim::RMSpropOptions(0.1));
    } else {
      optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3).amsgrad(true));
    }
    MixedPrecisionPlugin plugin(recipes::bf16_mixed().exp_avg_sq_dtype(at::kBFloat16));
    ExpectErrorContaining([&] { plugin.connect(*model, *optimizer); },
                          "exp_avg_dtype / exp_avg_sq_dtype Float / BFloat16 need a torch::optim::Adam or AdamW");
  }
}

TEST(MixedPrecisionPluginTest, Fp8OnAModelWithNoEligibleLayerIsAnError) {
  auto model = torch::nn::Sequential(torch::nn::Linear(10, 7), torch::nn::ReLU(),
                                     torch::nn::Linear(7, 3));
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed();
  ExpectErrorContaining([&] { plugin.connect(*model, optimizer); },
                        "fp8 is on but the model has no linear layer FP8 can run");
}

TEST(MixedPrecisionPluginTest, TooManyLayersKeptInBf16IsAnError) {
  TinyTransformer model(2);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().num_layers_at_start_in_bf16(2).num_layers_at_end_in_bf16(1);
  ExpectErrorContaining([&] { plugin.connect(*model, optimizer); },
                        "num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 = 3 exceeds the "
                        "model's 2 layers");
}

TEST(MixedPrecisionPluginTest, ConnectAfterTheFirstStepIsAnError) {
  auto model = testing::make_mlp();
  torch::optim::Adam optimizer(model->parameters(), 1e-3);
  model->forward(torch::randn({4, 32})).sum().backward();
  optimizer.step();
  MixedPrecisionPlugin plugin = recipes::bf16_mixed();
  ExpectErrorContaining([&] { plugin.connect(*model, optimizer); },
                        "connect the plugin before the optimizer's first step");
}

// ---- module conversion ----

class ConvertModuleTest : public testing::SeededTest {};

TEST_F(ConvertModuleTest, SwapsLinearAndLayerNormKeepingValuesAndBf16Layers) {
  TinyTransformer model(4);
  std::map<std::string, torch::Tensor> before;
  for (const auto& item : model->named_parameters()) before[item.key()] = item.value().detach().clone();
  torch::optim::AdamW optimizer(model->parameters(), 1e-3);
  // Module by module (the head's LayerNorm → Linear would otherwise fuse: see
  // SequentialRunsFuseIntoLayerNormLinearAndLayerNormMLP), so every name stays.
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_params(false).num_layers_at_start_in_bf16(1)
                                    .num_layers_at_end_in_bf16(1).fp8_fuse_modules(false);
  plugin.connect(*model, optimizer);

  // Blocks 0 and 3 stay torch::nn; blocks 1, 2, the embedding and the head are swapped.
  std::set<std::string> swapped;
  for (const auto& converted : plugin.conversion().modules) {
    swapped.insert(converted.path);
    EXPECT_TRUE(converted.parent_is_container) << converted.path;
  }
  const std::set<std::string> expected = {
      "embed.0",          "head.0",          "head.1",
      "blocks.1.ln1.0",   "blocks.1.qkv.0",  "blocks.1.proj.0", "blocks.1.ln2.0",
      "blocks.1.mlp.0",   "blocks.1.mlp.2",  "blocks.2.ln1.0",  "blocks.2.qkv.0",
      "blocks.2.proj.0",  "blocks.2.ln2.0",  "blocks.2.mlp.0",  "blocks.2.mlp.2"};
  EXPECT_EQ(swapped, expected);
  EXPECT_EQ(plugin.conversion().kept_in_high_precision.size(), 12u);  // 6 modules × 2 blocks
  EXPECT_TRUE(model->blocks[0]->as<testing::TinyBlockImpl>()->qkv->ptr(0)->as<torch::nn::LinearImpl>());
  EXPECT_TRUE(model->blocks[1]->as<testing::TinyBlockImpl>()->qkv->ptr(0)->as<Fp8LinearImpl>());
  EXPECT_TRUE(model->blocks[1]->as<testing::TinyBlockImpl>()->ln2->ptr(0)->as<Fp8LayerNormImpl>());
  EXPECT_TRUE(model->head->ptr(0)->as<Fp8LayerNormImpl>());

  // Same parameter names; values = the originals rounded to bf16; masters = the originals.
  const auto masters = plugin.master_params();
  std::vector<torch::Tensor> originals;
  for (const auto& item : model->named_parameters()) {
    ASSERT_TRUE(before.count(item.key())) << item.key();
    EXPECT_EQ(item.value().scalar_type(), at::kBFloat16) << item.key();
    EXPECT_TRUE(BytesEqual(item.value(), before[item.key()].to(at::kBFloat16))) << item.key();
    originals.push_back(before[item.key()]);
  }
  ASSERT_EQ(masters.size(), originals.size());
  for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(BytesEqual(masters[i], originals[i]));

  // The swapped modules are the ones the forward runs.
  auto x = torch::randn({2, 16, 16});
  { auto context = plugin.forward_context(); model->forward(plugin.convert_input(x)); }
  EXPECT_EQ(model->blocks[1]->as<testing::TinyBlockImpl>()->qkv->ptr(0)->as<Fp8LinearImpl>()->forward_calls(), 1);
}

// A model built from amp8's own modules: the precision's fp8_min_gemm_size and the layers it
// keeps in bf16 reach them as they reach swapped-in ones (GptModel's modules once kept their
// own default and ignored both).
// A layer the model itself keeps in high precision stays so (conversion once cleared the flag
// and counted it as an FP8 layer), and a bad fp8_min_gemm_size is named wherever it is set.
TEST_F(ConvertModuleTest, AModelsOwnHighPrecisionLayerStaysSo) {
  auto model = torch::nn::Sequential(Fp8Linear(Fp8LinearOptions(32, 32).keep_in_high_precision(true)),
                                     torch::nn::ReLU(), Fp8Linear(32, 32));
  const auto conversion = convert_to_fp8(*model, Fp8ConversionOptions().fp8_min_gemm_size(0));
  EXPECT_TRUE(model->ptr(0)->as<Fp8LinearImpl>()->options.keep_in_high_precision());
  EXPECT_FALSE(model->ptr(2)->as<Fp8LinearImpl>()->options.keep_in_high_precision());
  EXPECT_EQ(conversion.fp8_linear_count, 1);
  ASSERT_EQ(conversion.kept_in_high_precision.size(), 1u);
  EXPECT_EQ(conversion.kept_in_high_precision[0], "0 (keep_in_high_precision)");
  ExpectErrorContaining([] { Fp8Linear(Fp8LinearOptions(32, 32).fp8_min_gemm_size(-2)); },
                        "Fp8Linear: fp8_min_gemm_size must be");
  ExpectErrorContaining([&] { convert_to_fp8(*model, Fp8ConversionOptions().fp8_min_gemm_size(-2)); },
                        "convert_to_fp8: fp8_min_gemm_size must be");
}

TEST_F(ConvertModuleTest, KnobsReachTheModelsOwnFp8Modules) {
  auto model = torch::nn::Sequential(Fp8Linear(32, 32), torch::nn::ReLU(), Fp8Linear(32, 32),
                                     torch::nn::ReLU(), Fp8Linear(32, 16));
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_params(false).fp8_min_gemm_size(0)
                                    .num_layers_at_start_in_bf16(1).fp8_amax_history_len(16);
  plugin.connect(*model, optimizer);
  const std::vector<Fp8LinearImpl*> layers = {model->ptr(0)->as<Fp8LinearImpl>(),
                                              model->ptr(2)->as<Fp8LinearImpl>(),
                                              model->ptr(4)->as<Fp8LinearImpl>()};
  for (auto* layer : layers) {
    EXPECT_EQ(layer->options.fp8_min_gemm_size(), 0);
    // At connect, before any FP8 GEMM: a checkpoint written later (16 rows) loads into a model
    // just connected (the buffers once kept 1024 rows until the first FP8 GEMM, and a resumed
    // run with another history length refused its own checkpoint).
    EXPECT_EQ(layer->options.fp8_amax_history_len(), 16);
    EXPECT_EQ(layer->fp8_fwd_amax_history.size(0), 16);
    EXPECT_EQ(layer->fp8_bwd_amax_history.size(0), 16);
  }
  EXPECT_TRUE(layers[0]->options.keep_in_high_precision());
  EXPECT_FALSE(layers[1]->options.keep_in_high_precision());
  ASSERT_EQ(plugin.conversion().kept_in_high_precision.size(), 1u);
  EXPECT_EQ(plugin.conversion().kept_in_high_precision[0], "0 (bf16 layer)");

  // 16 × 32 × 32 GEMMs: FP8 runs (records amaxes) in layers 1 and 2 only.
  { auto context = plugin.forward_context(); model->forward(plugin.convert_input(torch::randn({16, 32}))); }
  EXPECT_EQ(layers[0]->fp8_fwd_amax_history.abs().sum().item<float>(), 0.0f) << "kept in bf16";
  EXPECT_GT(layers[1]->fp8_fwd_amax_history.abs().sum().item<float>(), 0.0f) << "ran in FP8";
  EXPECT_GT(layers[2]->fp8_fwd_amax_history.abs().sum().item<float>(), 0.0f) << "ran in FP8";
}

// fp8_params cannot reach Fp8Linear modules the model built itself outside Fp8ModelInit: the
// plugin once still named itself "fp8_params" and trained their bf16 weights. Now connect names
// them; built under Fp8ModelInit (or with fp8_params off) they connect.
TEST_F(ConvertModuleTest, Fp8ParamsThatCannotReachTheModelsOwnModulesAreNamed) {
  auto build = [] {
    return torch::nn::Sequential(Fp8Linear(32, 32), torch::nn::ReLU(), Fp8Linear(32, 16));
  };
  {
    auto model = build();
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed();
    ExpectErrorContaining([&] { plugin.connect(*model, optimizer); },
                          "fp8_params is set, but the model's own Fp8Linear modules 0, 2 hold high-precision "
                          "weights");
  }
  {
    std::optional<Fp8ModelInit> init(std::in_place);
    auto model = build();
    init.reset();
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed();
    EXPECT_NO_THROW(plugin.connect(*model, optimizer));
  }
  auto model = build();
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_params(false);
  EXPECT_NO_THROW(plugin.connect(*model, optimizer));
}

// The modules convert_module swaps out held float32 parameters (4 bytes per parameter); once
// the optimizer is pointed at the masters nothing may keep them alive.
TEST_F(ConvertModuleTest, ConnectReleasesTheSwappedOutParameters) {
  for (const bool fp8_params : {false, true}) {
    SCOPED_TRACE(fp8_params ? "fp8_params" : "bf16 params");
    auto model = testing::make_mlp();
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> originals;
    for (const auto& p : model->parameters()) originals.push_back(p.storage().getWeakStorageImpl());
    torch::optim::Adam optimizer(model->parameters(), 1e-3);
    MixedPrecisionPlugin plugin =
        recipes::bf16_with_fp8_mixed().fp8_params(fp8_params).fp8_min_gemm_size(0);
    plugin.connect(*model, optimizer);
    ASSERT_EQ(plugin.conversion().modules.size(), 3u);
    EXPECT_TRUE(plugin.conversion().replaced_params.empty());
    for (size_t i = 0; i < originals.size(); ++i) {
      EXPECT_TRUE(originals[i].expired()) << "parameter " << i << "'s float32 storage is still held";
    }
  }
}

TEST_F(ConvertModuleTest, IneligibleShapesStayAndAreReported) {
  auto model = torch::nn::Sequential(torch::nn::Linear(32, 48), torch::nn::ReLU(),
                                     torch::nn::Linear(48, 10));
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed();
  plugin.connect(*model, optimizer);
  EXPECT_TRUE(model->ptr(0)->as<Fp8LinearImpl>());
  EXPECT_TRUE(model->ptr(2)->as<torch::nn::LinearImpl>());
  ASSERT_EQ(plugin.conversion().kept_in_high_precision.size(), 1u);
  EXPECT_NE(plugin.conversion().kept_in_high_precision[0].find("2 (shape 10x48 not a multiple of 16)"),
            std::string::npos);
}

// A model that calls a typed torch::nn::Linear member: a swap cannot reach it; the plugin says
// so at the first step instead of silently training in bf16 or failing inside the forward.
struct TypedMemberNetImpl : torch::nn::Module {
  TypedMemberNetImpl() { fc = register_module("fc", torch::nn::Linear(32, 32)); }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TypedMemberNet);

TEST_F(ConvertModuleTest, ASwapTheForwardNeverCallsIsReported) {
  TypedMemberNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_params(false);
  plugin.connect(*model, optimizer);
  ASSERT_EQ(plugin.conversion().modules.size(), 1u);
  EXPECT_FALSE(plugin.conversion().modules[0].parent_is_container);
  // The typed member's old Linear was cast with the model: the forward runs (it once failed
  // inside LibTorch with "mat1 and mat2 must have the same dtype"), and the step names it.
  EXPECT_EQ(model->fc->weight.scalar_type(), at::kBFloat16);
  torch::Tensor loss;
  { auto context = plugin.forward_context(); loss = model->forward(plugin.convert_input(torch::randn({4, 32}))).to(at::kFloat).sum(); }
  plugin.backward(loss);
  ExpectErrorContaining([&] { plugin.optimizer_step(optimizer); },
                        "convert_module swapped fc for FP8 modules, but the model's forward never "
                        "called them");
}

// LayerNorm → Linear and LayerNorm → Linear → GELU(tanh) → Linear in a Sequential, which
// convert_to_fp8 fuses, beside runs it must leave alone: an exact GELU (only the LayerNorm →
// Linear before it fuses) and a linear layer FP8 cannot take (40 is not a multiple of 16).
torch::nn::Sequential make_fusable_model() {
  using namespace torch::nn;
  return Sequential(LayerNorm(LayerNormOptions({32})), Linear(32, 64),                       // 0-1
                    LayerNorm(LayerNormOptions({64})), Linear(64, 128),                      // 2-5
                    GELU(GELUOptions().approximate("tanh")), Linear(128, 64),
                    LayerNorm(LayerNormOptions({64})), Linear(64, 128), GELU(), Linear(128, 64),  // 6-9
                    LayerNorm(LayerNormOptions({64})), Linear(64, 40));                      // 10-11
}

template <typename Module>
Module* slot(const torch::nn::Sequential& model, size_t index) {
  return model->ptr(index)->as<Module>();
}

TEST_F(ConvertModuleTest, SequentialRunsFuseIntoLayerNormLinearAndLayerNormMLP) {
  torch::manual_seed(3);
  auto model = make_fusable_model();
  auto unfused = make_fusable_model();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < model->parameters().size(); ++i) unfused->parameters()[i].copy_(model->parameters()[i]);
  std::vector<torch::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
  torch::optim::AdamW optimizer(model->parameters(), 1e-3), unfused_optimizer(unfused->parameters(), 1e-3);
  const auto options = recipes::bf16_with_fp8_mixed().fp8_params(false).fp8_min_gemm_size(0);
  MixedPrecisionPlugin plugin = options;
  MixedPrecisionPlugin unfused_plugin = MixedPrecisionOptions(options).fp8_fuse_modules(false);
  plugin.connect(*model, optimizer);
  unfused_plugin.connect(*unfused, unfused_optimizer);

  ASSERT_TRUE(slot<Fp8LayerNormLinearImpl>(model, 0));
  ASSERT_TRUE(slot<Fp8LayerNormMLPImpl>(model, 2));
  ASSERT_TRUE(slot<Fp8LayerNormLinearImpl>(model, 6));
  EXPECT_TRUE(slot<torch::nn::GELUImpl>(model, 8)) << "exact GELU: not the tanh form the MLP computes";
  EXPECT_TRUE(slot<Fp8LinearImpl>(model, 9));
  EXPECT_TRUE(slot<Fp8LayerNormImpl>(model, 10));
  EXPECT_TRUE(slot<torch::nn::LinearImpl>(model, 11)) << "40 output features: FP8 cannot take it";
  struct Expected {
    int64_t fused_offset;
    std::string part, fused_slot_part;
  };
  const std::map<size_t, Expected> slots = {{1, {1, "linear", "layer_norm"}},
                                            {3, {1, "ln_fc1.linear", "ln_fc1.layer_norm"}},
                                            {4, {2, "", ""}},
                                            {5, {3, "fc2", ""}},
                                            {7, {1, "linear", "layer_norm"}}};
  for (const auto& [index, expected] : slots) {
    const auto* fused_slot = slot<FusedSlotImpl>(model, index);
    ASSERT_TRUE(fused_slot) << "slot " << index;
    EXPECT_EQ(fused_slot->fused_offset, expected.fused_offset) << "slot " << index;
    EXPECT_EQ(fused_slot->part, expected.part) << "slot " << index;
    EXPECT_EQ(fused_slot->fused_slot_part, expected.fused_slot_part) << "slot " << index;
  }
  EXPECT_EQ(slot<Fp8LayerNormMLPImpl>(model, 2)->options.ffn_hidden_size(), 128);
  std::set<std::string> paths;
  for (const auto& converted : plugin.conversion().modules) paths.insert(converted.path);
  EXPECT_EQ(paths, (std::set<std::string>{"0", "2", "6", "9", "10"}));
  EXPECT_EQ(plugin.conversion().fp8_linear_count, 5);

  // fp8_fuse_modules(false): every module converted on its own.
  EXPECT_TRUE(slot<Fp8LayerNormImpl>(unfused, 0));
  EXPECT_TRUE(slot<Fp8LinearImpl>(unfused, 1));
  EXPECT_TRUE(slot<torch::nn::GELUImpl>(unfused, 4));
  EXPECT_EQ(unfused_plugin.conversion().fp8_linear_count, 5);

  // The fused modules hold the original parameters, in the original order: the masters are
  // the original values.
  const auto masters = plugin.master_params();
  ASSERT_EQ(masters.size(), before.size());
  for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(BytesEqual(masters[i], before[i])) << "master " << i;

  // Outside an FP8 region the fused modules compute what the modules in sequence compute,
  // bit for bit.
  auto x = torch::randn({24, 32});
  EXPECT_TRUE(BytesEqual(model->forward(x.to(at::kBFloat16)), unfused->forward(x.to(at::kBFloat16))));
  // In FP8 the fused LayerNorm and GELU write their outputs straight into FP8 instead of
  // rounding them to bf16 first: a value rounds differently only where bf16's rounding crossed
  // an E4M3 rounding boundary (about 1 in 32 values, by one E4M3 step), and the weights'
  // quantization is the same in both. So the two FP8 outputs are closer to each other than
  // either is to the high-precision output.
  const auto high_precision = unfused->forward(x.to(at::kBFloat16)).to(at::kFloat);
  at::Tensor fused_out, unfused_out;
  {
    auto context = plugin.forward_context();
    fused_out = model->forward(plugin.convert_input(x)).to(at::kFloat);
  }
  {
    auto context = unfused_plugin.forward_context();
    unfused_out = unfused->forward(unfused_plugin.convert_input(x)).to(at::kFloat);
  }
  const double difference = testing::relative_error(fused_out, unfused_out);
  EXPECT_GT(difference, 0.0) << "the FP8 path ran (its roundings differ from the sequence's)";
  EXPECT_LT(difference, testing::relative_error(unfused_out, high_precision));
  EXPECT_LT(difference, testing::relative_error(fused_out, high_precision));
}

// Layers kept in bf16 are not fused into modules that run FP8, and a run with a kept layer
// inside is converted module by module.
// A module the model holds in two places is not fused: its other place would become a
// pass-through (the GELU) or run the whole fused module (the LayerNorm). A module held twice
// gets one replacement, in both places.
TEST_F(ConvertModuleTest, ModulesHeldTwiceAreNotFused) {
  using namespace torch::nn;
  LayerNorm norm(LayerNormOptions({32}));
  GELU gelu(GELUOptions().approximate("tanh"));
  auto model = Sequential(norm, Linear(32, 128), gelu, Linear(128, 32), gelu, norm, Linear(32, 32));
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_params(false).fp8_min_gemm_size(0);
  plugin.connect(*model, optimizer);
  EXPECT_TRUE(slot<Fp8LayerNormImpl>(model, 0));
  EXPECT_TRUE(slot<Fp8LinearImpl>(model, 1));
  EXPECT_TRUE(slot<torch::nn::GELUImpl>(model, 2));
  EXPECT_TRUE(slot<torch::nn::GELUImpl>(model, 4));
  EXPECT_TRUE(slot<Fp8LayerNormImpl>(model, 5));
  EXPECT_EQ(model->ptr(0), model->ptr(5)) << "one Fp8LayerNorm, in both slots";
  const auto x = torch::randn({8, 32}).to(at::kBFloat16);
  EXPECT_TRUE(BytesEqual(model->forward(x), model->ptr(6)->as<Fp8LinearImpl>()->forward(
      model->ptr(0)->as<Fp8LayerNormImpl>()->forward(torch::gelu(model->ptr(3)->as<Fp8LinearImpl>()->forward(
          torch::gelu(model->ptr(1)->as<Fp8LinearImpl>()->forward(model->ptr(0)->as<Fp8LayerNormImpl>()->forward(x)),
                      "tanh")), "tanh")))));

  // Across containers too: this GELU is also another Sequential's child, so only the LayerNorm
  // → Linear before it fuses.
  GELU shared(GELUOptions().approximate("tanh"));
  auto mlp = Sequential(LayerNorm(LayerNormOptions({32})), Linear(32, 128), shared, Linear(128, 32));
  auto other = Sequential(shared);
  ModuleList both(mlp, other);
  convert_to_fp8(*both, Fp8ConversionOptions().fp8_min_gemm_size(0));
  EXPECT_TRUE(slot<Fp8LayerNormLinearImpl>(mlp, 0));
  EXPECT_TRUE(slot<torch::nn::GELUImpl>(mlp, 2));
  EXPECT_TRUE(slot<Fp8LinearImpl>(mlp, 3));
  EXPECT_TRUE(slot<torch::nn::GELUImpl>(other, 0));
}

TEST_F(ConvertModuleTest, RunsWithALayerKeptInBf16AreNotFused) {
  auto model = make_fusable_model();
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  // The Sequential is the layer stack; its layers are the children with an FP8-eligible linear
  // layer: 1, 3, 5, 7, 9. The first two stay in bf16.
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_params(false).num_layers_at_start_in_bf16(2);
  plugin.connect(*model, optimizer);
  EXPECT_TRUE(slot<Fp8LayerNormImpl>(model, 0));
  EXPECT_TRUE(slot<torch::nn::LinearImpl>(model, 1));
  EXPECT_TRUE(slot<Fp8LayerNormImpl>(model, 2));
  EXPECT_TRUE(slot<torch::nn::LinearImpl>(model, 3));
  EXPECT_TRUE(slot<torch::nn::GELUImpl>(model, 4));
  EXPECT_TRUE(slot<Fp8LinearImpl>(model, 5));
  EXPECT_TRUE(slot<Fp8LayerNormLinearImpl>(model, 6));
}

// ---- FP32 master params ----

enum class OptimizerKind { kSgd, kAdam, kAdamW };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(OptimizerKind kind,
                                                        std::vector<torch::Tensor> params) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-4));
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  }
  return nullptr;
}

class MasterParamsTest : public testing::SeededTest,
                         public ::testing::WithParamInterface<OptimizerKind> {};

// The optimizer steps FP32 masters with the half gradients cast to float32: exactly what the
// same optimizer does to float32 copies given those gradients. The model then holds the
// masters rounded to bf16. On CUDA, Adam and AdamW take the fused kernels by default
// (fused_optimizer): the same operations in the same order, but ATen's CUDA kernels do not
// round each one as the kernel's explicit FMAs do (measured on an H200: 1 ulp apart in ~3% of
// the elements after a step), so the fused step is held to 16 ulps (2e-6 relative) plus 1e-7;
// both paths see the same gradients every step, so nothing compounds. The unfused step
// (fused_optimizer false, and any optimizer on the CPU) is bit for bit.
void steps_like_fp32_on_the_half_gradients(OptimizerKind kind, torch::Device device,
                                           bool fused_optimizer = true) {
  auto model = testing::make_mlp();
  model->to(device);
  std::vector<torch::Tensor> reference_params;
  for (const auto& p : model->parameters()) reference_params.push_back(p.detach().clone().requires_grad_(true));
  auto optimizer = make_optimizer(kind, model->parameters());
  auto reference = make_optimizer(kind, reference_params);
  MixedPrecisionPlugin plugin = recipes::bf16_mixed().fused_optimizer(fused_optimizer);
  plugin.connect(*model, *optimizer);
  MlpData data(5);
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = data.batch(step, 0, 16);
    forward_backward(plugin, model, x.to(device), y.to(device));
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_EQ(params[i].grad().scalar_type(), at::kBFloat16);
      reference_params[i].mutable_grad() = params[i].grad().to(at::kFloat);
    }
    EXPECT_TRUE(plugin.optimizer_step(*optimizer));
    reference->step();
    const auto masters = plugin.master_params();
    const bool fused = fused_optimizer && device.is_cuda() && kind != OptimizerKind::kSgd;
    for (size_t i = 0; i < params.size(); ++i) {
      if (fused) {
        const auto expected = reference_params[i].detach();
        const auto diff = (masters[i].detach() - expected).abs();
        EXPECT_TRUE(diff.le(expected.abs() * 2e-6 + 1e-7).all().item<bool>())
            << "param " << i << " step " << step << ": max difference " << diff.max().item<float>();
      } else {
        EXPECT_TRUE(BytesEqual(masters[i], reference_params[i])) << "param " << i << " step " << step;
      }
      EXPECT_TRUE(BytesEqual(params[i], masters[i].to(at::kBFloat16)));
      EXPECT_FALSE(params[i].grad().defined()) << "optimizer_step consumes the gradients";
    }
  }
  expect_optimizer_sees_only_fp32(*optimizer);
}

TEST_P(MasterParamsTest, StepsLikeFp32OnTheHalfGradients) {
  steps_like_fp32_on_the_half_gradients(GetParam(), torch::kCPU);
}

TEST_P(MasterParamsTest, StepsLikeFp32OnTheHalfGradients_CUDA) {
  AMP8_REQUIRE_CUDA();
  steps_like_fp32_on_the_half_gradients(GetParam(), torch::kCUDA);
}

TEST_P(MasterParamsTest, UnfusedStepsLikeFp32OnTheHalfGradients_CUDA) {
  AMP8_REQUIRE_CUDA();
  steps_like_fp32_on_the_half_gradients(GetParam(), torch::kCUDA, /*fused_optimizer=*/false);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, MasterParamsTest,
                         ::testing::Values(OptimizerKind::kSgd, OptimizerKind::kAdam,
                                           OptimizerKind::kAdamW),
                         [](const auto& info) {
                           switch (info.param) {
                             case OptimizerKind::kSgd: return std::string("SGD");
                             case OptimizerKind::kAdam: return std::string("Adam");
                             default: return std::string("AdamW");
                           }
                         });

TEST_F(MasterParamsTest, Fp8ParamsMastersAreTheHighPrecisionValues) {
  auto model = testing::make_mlp();
  std::vector<torch::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
  torch::optim::Adam optimizer(model->parameters(), 1e-3);
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0);
  plugin.connect(*model, optimizer);
  auto masters = plugin.master_params();
  ASSERT_EQ(masters.size(), before.size());
  for (size_t i = 0; i < masters.size(); ++i) {
    EXPECT_TRUE(BytesEqual(masters[i], before[i])) << "master " << i << " seeded from the originals";
  }
  auto* first = model->ptr(0)->as<Fp8LinearImpl>();
  ASSERT_TRUE(first);
  EXPECT_EQ(first->weight.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(first->bias.scalar_type(), at::kBFloat16);
  EXPECT_FALSE(first->high_precision_init_val().defined()) << "released once the master has it";

  MlpData data(6);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = data.batch(step, 0, 32);
    forward_backward(plugin, model, x, y);
    EXPECT_TRUE(plugin.optimizer_step(optimizer));
  }
  masters = plugin.master_params();
  EXPECT_FALSE(BytesEqual(masters[0], before[0])) << "the master moved";
  // The FP8 weight is the master re-quantized (current scaling: within E4M3's rounding).
  const auto dequantized = first->fp8_weight().dequantize(at::kFloat);
  EXPECT_LE(testing::relative_error(dequantized, masters[0]), testing::kE4M3Rms * 1.5);
  EXPECT_EQ(first->weight.scalar_type(), at::kFloat8_e4m3fn);
  expect_optimizer_sees_only_fp32(optimizer);
}

// The fused step measures each FP8 weight's amax as it writes the master (no second read of the
// masters): the FP8 weights after each step are their masters quantized with the current scale
// of the masters' own amax, byte for byte. bfloat16 moments take the fused step on the CPU too.
TEST_F(MasterParamsTest, Fp8WeightsAfterTheFusedStepAreTheirMastersQuantized) {
  auto model = testing::make_mlp();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  MixedPrecisionPlugin plugin =
      recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).exp_avg_dtype(at::kBFloat16).exp_avg_sq_dtype(at::kBFloat16);
  plugin.connect(*model, optimizer);
  std::vector<Fp8LinearImpl*> layers;
  for (const auto& module : model->modules(/*include_self=*/false)) {
    if (auto* linear = module->as<Fp8LinearImpl>()) layers.push_back(linear);
  }
  ASSERT_GE(layers.size(), 2u);
  MlpData data(7);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = data.batch(step, 0, 32);
    forward_backward(plugin, model, x, y);
    ASSERT_TRUE(plugin.optimizer_step(optimizer));
    // The masters are in the model's parameter order.
    const auto masters = plugin.master_params();
    const auto params = model->parameters();
    ASSERT_EQ(masters.size(), params.size());
    std::vector<float> amaxes;
    for (auto* layer : layers) {
      const auto index = static_cast<size_t>(
          std::find_if(params.begin(), params.end(), [&](const torch::Tensor& p) { return p.is_same(layer->weight); }) -
          params.begin());
      ASSERT_LT(index, masters.size());
      const auto amax = compute_amax(masters[index]);
      amaxes.push_back(amax.item<float>());
      const auto expected = quantize(masters[index], compute_current_scale(amax, Fp8Format::kE4M3), Fp8Format::kE4M3);
      const auto fp8 = layer->fp8_weight();
      EXPECT_TRUE(BytesEqual(fp8.data.view(at::kByte), expected.data.view(at::kByte))) << "step " << step;
      EXPECT_TRUE(BytesEqual(fp8.scale_inv, expected.scale_inv)) << "step " << step;
    }
    EXPECT_NE(amaxes[0], amaxes[1]) << "two weights, two scales";
  }
}

// fp8_params_scaling "delayed" (TE's FusedAdam on Float8Tensor params): the fused step writes
// each FP8 weight in its own pass at the scale of the master's amax after the previous step
// (before the first step: the masters as connected), and scale_inv is that scale's; the next
// scale comes from this step's amax. Large steps (lr 0.05) make some weights' max grow, so
// some values saturate where the current scale would not have. float32 moments step unfused on
// the CPU (the weights written after the step), bfloat16 ones through the fused step (the
// weights written in its pass).
TEST_F(MasterParamsTest, DelayedFp8WeightsAreWrittenAtTheLastStepsScale) {
  for (const auto moments : {at::kFloat, at::kBFloat16}) {
  SCOPED_TRACE(c10::toString(moments));
  auto model = testing::make_mlp();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(5e-2));
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).fp8_params_scaling("delayed")
                                    .exp_avg_dtype(moments).exp_avg_sq_dtype(moments);
  plugin.connect(*model, optimizer);
  std::vector<Fp8LinearImpl*> layers;
  for (const auto& module : model->modules(/*include_self=*/false)) {
    if (auto* linear = module->as<Fp8LinearImpl>()) layers.push_back(linear);
  }
  ASSERT_GE(layers.size(), 2u);
  const auto params = model->parameters();
  std::vector<size_t> indices;
  for (auto* layer : layers) {
    indices.push_back(static_cast<size_t>(
        std::find_if(params.begin(), params.end(), [&](const torch::Tensor& p) { return p.is_same(layer->weight); }) -
        params.begin()));
  }
  // The scales the first step writes at: the connected masters' amaxes.
  std::vector<torch::Tensor> scales;
  for (size_t index : indices) {
    scales.push_back(compute_current_scale(compute_amax(plugin.master_params()[index]), Fp8Format::kE4M3));
  }
  MlpData data(7);
  bool saturated_where_current_would_not = false;
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = data.batch(step, 0, 32);
    forward_backward(plugin, model, x, y);
    ASSERT_TRUE(plugin.optimizer_step(optimizer));
    const auto masters = plugin.master_params();
    for (size_t k = 0; k < layers.size(); ++k) {
      const auto& master = masters[indices[k]];
      const auto expected = quantize(master, scales[k], Fp8Format::kE4M3);
      const auto fp8 = layers[k]->fp8_weight();
      EXPECT_TRUE(BytesEqual(fp8.data.view(at::kByte), expected.data.view(at::kByte))) << "step " << step << ", " << k;
      EXPECT_TRUE(BytesEqual(fp8.scale_inv, expected.scale_inv)) << "step " << step << ", " << k;
      const auto amax = compute_amax(master);
      const auto current = compute_current_scale(amax, Fp8Format::kE4M3);
      saturated_where_current_would_not |= (master * scales[k]).abs().gt(448.0f).any().item<bool>();
      scales[k] = current;
    }
  }
  EXPECT_TRUE(saturated_where_current_would_not) << "lr 0.05 should grow some weight's max within 4 steps";
  }
  ExpectErrorContaining([] { MixedPrecisionPlugin(recipes::bf16_with_fp8_mixed().fp8_params(false).fp8_params_scaling("delayed")); },
                        "fp8_params_scaling \"delayed\" applies to fp8_params with one scale per weight (fp8_params = "
                        "false");
}

// Back to plain LibTorch: the trained model's FP32 masters, written under the model's names,
// load into the unmodified fp32 architecture (torch::nn::Linear where FP8 swapped in
// Fp8Linear; FP8 weights under fp8_params).
TEST_F(MasterParamsTest, ExportedFp32ModelLoadsIntoTheUnmodifiedModel) {
  struct Case {
    const char* name;
    MixedPrecisionOptions options;
  };
  const std::vector<Case> cases = {
      {"bf16-mixed", recipes::bf16_mixed()},
      {"fp16-mixed", recipes::fp16_mixed().fp16_initial_loss_scale(256)},
      {"bf16 + FP8, fp8_params", recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0)},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto model = testing::make_mlp();
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    MixedPrecisionPlugin plugin = c.options;
    plugin.connect(*model, optimizer);
    MlpData data(11);
    torch::Tensor loss;
    for (int step = 0; step < 4; ++step) {
      auto [x, y] = data.batch(step, 0, 32);
      loss = forward_backward(plugin, model, x, y);
      plugin.optimizer_step(optimizer);
    }
    const auto path = testing::scratch_path("export", "model.pt").string();
    export_fp32_model(*model, plugin, path);

    auto plain = testing::make_mlp();  // the architecture as the user wrote it, float32
    torch::load(plain, path);
    const auto masters = plugin.master_params();
    const auto params = plain->parameters();
    ASSERT_EQ(params.size(), masters.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].scalar_type(), at::kFloat);
      EXPECT_TRUE(BytesEqual(params[i], masters[i])) << "parameter " << i << " is its FP32 master";
    }
    // The masters, not the half copies: they differ after a few steps of AdamW.
    EXPECT_FALSE(BytesEqual(masters[0], model->parameters()[0].detach().to(at::kFloat)));
    // The plain model computes what the trained one does, to the precision's rounding.
    auto [x, y] = data.batch(100, 0, 32);
    torch::NoGradGuard no_grad;
    const double plain_loss = torch::mse_loss(plain->forward(x), y).item<double>();
    torch::Tensor trained_loss;
    {
      auto context = plugin.forward_context();
      trained_loss = torch::mse_loss(plugin.convert_output(model->forward(plugin.convert_input(x))), y);
    }
    EXPECT_NEAR(plain_loss, trained_loss.item<double>(), 0.05 * plain_loss);
  }
}

// A model whose Sequential runs convert_module fused (Fp8LayerNormLinear, Fp8LayerNormMLP,
// FusedSlot) is written in its original layout: it loads into the Sequential of LayerNorm,
// Linear and GELU modules the user wrote, each parameter its FP32 master.
TEST_F(MasterParamsTest, ExportedFusedModelLoadsIntoTheUnmodifiedModel) {
  auto model = make_fusable_model();
  std::vector<torch::Tensor> originals;
  for (const auto& p : model->parameters()) originals.push_back(p.detach().clone());
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0);
  ASSERT_TRUE(plugin.options().fp8_params());
  plugin.connect(*model, optimizer);
  ASSERT_TRUE(slot<Fp8LayerNormMLPImpl>(model, 2));
  EXPECT_EQ(slot<Fp8LayerNormMLPImpl>(model, 2)->fc2->weight.scalar_type(), at::kFloat8_e4m3fn);
  // fp8_params: the fused modules' FP8 weights have masters seeded from the original values.
  auto masters = plugin.master_params();
  ASSERT_EQ(masters.size(), originals.size());
  for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(BytesEqual(masters[i], originals[i])) << "master " << i;
  for (int step = 0; step < 3; ++step) {
    forward_backward(plugin, model, torch::randn({24, 32}), torch::randn({24, 40}));
    ASSERT_TRUE(plugin.optimizer_step(optimizer));
  }
  const auto path = testing::scratch_path("export", "fused.pt").string();
  export_fp32_model(*model, plugin, path);

  auto plain = make_fusable_model();
  torch::load(plain, path);
  masters = plugin.master_params();
  const auto params = plain->parameters();
  ASSERT_EQ(params.size(), masters.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(BytesEqual(params[i], masters[i])) << plain->named_parameters()[i].key() << " is its FP32 master";
  }
}

// A checkpoint of the fused layout loaded into a model converted with fp8_fuse_modules(false)
// names the setting; a missing piece inside an FP8 module a model holds itself (not in a
// Sequential, where convert_module fuses) does not get that hint.
TEST_F(MasterParamsTest, ACheckpointOfTheOtherFusionLayoutIsNamedOnLoad) {
  const auto path = testing::scratch_path("fusion_layout", "fused.ckpt").string();
  {
    auto model = make_fusable_model();
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    auto plugin = std::make_shared<MixedPrecisionPlugin>(recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0));
    plugin->connect(*model, optimizer);
    ASSERT_TRUE(slot<Fp8LayerNormMLPImpl>(model, 2));
    Trainer(TrainerOptions().log_every_n_steps(0), plugin).save_checkpoint(path, *model, optimizer);
  }
  auto unfused = make_fusable_model();
  torch::optim::AdamW optimizer(unfused->parameters(), torch::optim::AdamWOptions(1e-2));
  Trainer reader(TrainerOptions().log_every_n_steps(0),
                 recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0).fp8_fuse_modules(false));
  const std::string message = error_of([&] { reader.load_checkpoint(path, *unfused, optimizer); });
  EXPECT_NE(message.find("is missing"), std::string::npos) << message;
  EXPECT_NE(message.find("another fp8_fuse_modules"), std::string::npos) << message;

  // An Fp8LayerNormLinear held as a member: its checkpoint without a bias, loaded into one with.
  struct Holder : torch::nn::Module {
    explicit Holder(bool bias)
        : norm_linear(register_module(
              "norm_linear", Fp8LayerNormLinear(Fp8LayerNormLinearOptions(16, 24).bias(bias)))) {}
    Fp8LayerNormLinear norm_linear;
  };
  const auto holder_path = testing::scratch_path("fusion_layout", "holder.ckpt").string();
  {
    auto saved = std::make_shared<Holder>(false);
    torch::optim::SGD sgd(saved->parameters(), 0.1);
    Trainer(TrainerOptions().log_every_n_steps(0)).save_checkpoint(holder_path, *saved, sgd);
  }
  auto with_bias = std::make_shared<Holder>(true);
  torch::optim::SGD sgd(with_bias->parameters(), 0.1);
  Trainer holder_reader(TrainerOptions().log_every_n_steps(0));
  const std::string holder_message =
      error_of([&] { holder_reader.load_checkpoint(holder_path, *with_bias, sgd); });
  EXPECT_NE(holder_message.find("norm_linear.linear.bias is missing"), std::string::npos)
      << holder_message;
  EXPECT_EQ(holder_message.find("fp8_fuse_modules"), std::string::npos) << holder_message;
}

// ---- fp16 loss scaling inside the loop ----

class LossScalingTest : public testing::SeededTest {};

// Inf gradients injected at chosen steps: the steps are skipped (parameters untouched) and the
// scale follows Megatron's hysteresis exactly.
void injected_overflows_skip_steps(torch::Device device) {
  auto model = testing::make_mlp();
  model->to(device);
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  MixedPrecisionPlugin plugin =
      recipes::fp16_mixed().fp16_initial_loss_scale(256).fp16_loss_scale_window(3);
  plugin.connect(*model, optimizer);
  const std::set<int> overflow = {4, 5, 7, 11, 12, 13};
  const std::vector<double> expected_scale = {256, 256, 512, 512, 256, 256, 128,
                                              128, 128, 256, 256, 128, 64,  64};
  MlpData data(8);
  int64_t skipped = 0;
  for (int step = 1; step <= 14; ++step) {
    auto [x, y] = data.batch(step, 0, 16);
    forward_backward(plugin, model, x.to(device), y.to(device));
    if (overflow.count(step)) model->ptr(2)->as<torch::nn::LinearImpl>()->weight.grad()[3][5] = INFINITY;
    std::vector<torch::Tensor> params_before;
    for (const auto& p : plugin.master_params()) params_before.push_back(p.detach().clone());
    const bool stepped = plugin.optimizer_step(optimizer);
    EXPECT_EQ(stepped, overflow.count(step) == 0) << "step " << step;
    skipped += stepped ? 0 : 1;
    EXPECT_EQ(plugin.loss_scale(), expected_scale[step - 1]) << "scale after step " << step;
    EXPECT_EQ(plugin.skipped_steps(), skipped);
    const auto masters = plugin.master_params();
    bool unchanged = true;
    for (size_t i = 0; i < masters.size(); ++i) unchanged &= masters[i].equal(params_before[i]);
    EXPECT_EQ(unchanged, !stepped) << "step " << step;
    for (const auto& m : masters) EXPECT_TRUE(torch::isfinite(m).all().item<bool>());
  }
}

TEST_F(LossScalingTest, InjectedOverflowsSkipStepsAndMoveTheScaleExactly) {
  injected_overflows_skip_steps(torch::kCPU);
}

TEST_F(LossScalingTest, InjectedOverflowsSkipStepsAndMoveTheScaleExactly_CUDA) {
  AMP8_REQUIRE_CUDA();
  injected_overflows_skip_steps(torch::kCUDA);
}

TEST_F(LossScalingTest, GradientsReachTheOptimizerUnscaled) {
  // Same gradients in fp16 with loss scale 2^10 as the bf16 plugin without one, up to rounding:
  // the scale is divided out before the optimizer sees them.
  auto model = testing::make_mlp();
  torch::optim::SGD optimizer(model->parameters(), 0.0);  // lr 0: inspect the gradients only
  MixedPrecisionPlugin plugin = recipes::fp16_mixed().fp16_loss_scale(1024.0);
  plugin.connect(*model, optimizer);
  auto [x, y] = MlpData(9).batch(0, 0, 16);
  forward_backward(plugin, model, x, y);
  plugin.unscale_gradients(optimizer);
  auto masters = plugin.master_params();
  // The float32 reference gradient, on float32 copies of the fp16 weights.
  auto reference = testing::make_mlp();
  {
    torch::NoGradGuard no_grad;
    auto src = model->parameters();
    auto dst = reference->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i].to(at::kFloat));
  }
  torch::mse_loss(reference->forward(x.to(at::kHalf).to(at::kFloat)), y).backward();
  const auto ref = reference->parameters();
  for (size_t i = 0; i < masters.size(); ++i) {
    ASSERT_TRUE(masters[i].grad().defined());
    EXPECT_EQ(masters[i].grad().scalar_type(), at::kFloat);
    EXPECT_LE(testing::relative_error(masters[i].grad(), ref[i].grad()), 2e-2) << "param " << i;
  }
  const double norm = plugin.clip_gradients(optimizer, 1e-3);
  EXPECT_GT(norm, 1e-3);
  double clipped = 0;
  for (const auto& m : masters) clipped += m.grad().pow(2).sum().item<double>();
  EXPECT_NEAR(std::sqrt(clipped), 1e-3, 1e-5) << "clipped to the global norm";
  EXPECT_TRUE(plugin.optimizer_step(optimizer));
}

// An MLP connected under 16-mixed (loss scale 1024) with an SGD optimizer, and one batch's loss:
// the setting of the loss-scaling slips below.
struct ScaledMlp {
  torch::nn::Sequential model = testing::make_mlp();
  torch::optim::SGD optimizer{model->parameters(), 0.1};
  MixedPrecisionPlugin plugin{recipes::fp16_mixed().fp16_loss_scale(1024.0)};
  std::pair<torch::Tensor, torch::Tensor> data = MlpData(9).batch(0, 0, 16);
  ScaledMlp() { plugin.connect(*model, optimizer); }
  torch::Tensor loss() {
    return torch::mse_loss(plugin.convert_output(model->forward(plugin.convert_input(data.first))), data.second);
  }
};

TEST_F(LossScalingTest, GradientsFromLossBackwardInsteadOfThePluginsAreNamed) {
  // A common slip under 16-mixed: loss.backward() leaves the gradients unscaled, and the step
  // would divide them by the loss scale. It is an error at the step, every step it happens.
  ScaledMlp run;
  auto& [model, optimizer, plugin, data] = run;
  const auto& [x, y] = data;
  auto loss_of = [&] { return run.loss(); };
  const std::string slip = "MixedPrecisionPlugin (16-mixed): this step's gradients did not come from "
                           "plugin.backward(loss). loss.backward() does not multiply them by the loss scale (1024)";
  loss_of().backward();
  ExpectErrorContaining([&] { plugin.optimizer_step(optimizer); }, slip);
  plugin.discard_gradients(optimizer);
  plugin.backward(loss_of());
  EXPECT_TRUE(plugin.optimizer_step(optimizer)) << "plugin.backward(loss) steps";
  loss_of().backward();
  ExpectErrorContaining([&] { plugin.clip_gradients(optimizer, 1.0); }, slip);
  // bf16-mixed does not scale: loss.backward() is what plugin.backward does there.
  auto bf16_model = testing::make_mlp();
  torch::optim::SGD bf16_optimizer(bf16_model->parameters(), 0.1);
  MixedPrecisionPlugin bf16 = recipes::bf16_mixed();
  bf16.connect(*bf16_model, bf16_optimizer);
  torch::mse_loss(bf16.convert_output(bf16_model->forward(bf16.convert_input(x))), y).backward();
  EXPECT_TRUE(bf16.optimizer_step(bf16_optimizer));
}

TEST_F(LossScalingTest, ClippingTheScaledGradientsIsNamed) {
  // Another slip under 16-mixed: torch::nn::utils::clip_grad_norm_ between plugin.backward and
  // the step clips gradients still multiplied by the loss scale. An error at that step, with
  // the remedy, until a step has gone through unchanged; plugin.clip_gradients is the remedy.
  ScaledMlp run;
  auto& [model, optimizer, plugin, data] = run;
  auto loss_of = [&] { return run.loss(); };
  const std::string slip = "MixedPrecisionPlugin (16-mixed): the gradients changed between plugin.backward(loss) "
                           "and this step";
  auto two_micro_batches = [&] {
    plugin.set_gradient_sync(false);
    plugin.backward(loss_of());
    plugin.set_gradient_sync(true);
    plugin.backward(loss_of());
  };
  two_micro_batches();
  torch::nn::utils::clip_grad_norm_(model->parameters(), 1e-3);
  ExpectErrorContaining([&] { plugin.optimizer_step(optimizer); }, slip);
  plugin.discard_gradients(optimizer);
  plugin.backward(loss_of());
  torch::nn::utils::clip_grad_norm_(model->parameters(), 1e-3);
  ExpectErrorContaining([&] { plugin.clip_gradients(optimizer, 1.0); }, "loss scale (1024)");
  plugin.discard_gradients(optimizer);
  // The remedy: two micro-batches, plugin.clip_gradients, a step.
  two_micro_batches();
  plugin.clip_gradients(optimizer, 1e-3);
  EXPECT_TRUE(plugin.optimizer_step(optimizer));
}

TEST(TrainingLoopSlipTest, OptimizerStepInsteadOfThePluginsIsNamed) {
  // optimizer.step() instead of plugin.optimizer_step(optimizer): under bf16-mixed it steps the
  // FP32 masters, which have no gradients, so the model would not train; in "32" the params are
  // their own masters and step, but their gradients are never cleared and pile up. Either way
  // the next plugin.backward(loss) is an error naming both remedies.
  const std::string slip = "plugin.backward(loss) ran again with no plugin.optimizer_step(optimizer) since a "
                           "backward with gradient sync on";
  for (const auto& options : {recipes::bf16_mixed(), MixedPrecisionOptions("32")}) {
    SCOPED_TRACE(options.canonical_precision());
    auto model = testing::make_mlp();
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    MixedPrecisionPlugin plugin = options;
    plugin.connect(*model, optimizer);
    const MlpData data(3);
    auto [x, y] = data.batch(0, 0, 16);
    forward_backward(plugin, model, x, y);
    optimizer.step();
    optimizer.zero_grad();  // the optimizer's params: under bf16-mixed the masters, in "32" the model's
    ExpectErrorContaining([&] { forward_backward(plugin, model, x, y); }, slip);
    ExpectErrorContaining([&] { forward_backward(plugin, model, x, y); }, "call plugin.optimizer_step(optimizer) instead");
    // The plugin's own step still goes through after the errors.
    EXPECT_TRUE(plugin.optimizer_step(optimizer));
    // After discard_gradients a backward is fine again, and so is accumulation that says so.
    forward_backward(plugin, model, x, y);
    plugin.discard_gradients(optimizer);
    forward_backward(plugin, model, x, y);
    EXPECT_TRUE(plugin.optimizer_step(optimizer));
    plugin.set_gradient_sync(false);
    forward_backward(plugin, model, x, y);
    forward_backward(plugin, model, x, y);
    plugin.set_gradient_sync(true);
    forward_backward(plugin, model, x, y);
    ExpectErrorContaining([&] { forward_backward(plugin, model, x, y); },
                          "call plugin.set_gradient_sync(false) before every micro-batch's backward but the last");
    EXPECT_TRUE(plugin.optimizer_step(optimizer));
  }
}

TEST(TrainingLoopSlipTest, AccumulatedMicroBatchesStepAsOneBatch) {
  // The accumulation the check allows sums the micro-batches' gradients: two half batches with
  // set_gradient_sync(false) before the first step "32" exactly like one whole batch (the MSE
  // losses halved, as a trainer divides by the number of micro-batches).
  auto whole = testing::make_mlp();
  auto halves = testing::make_mlp();
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < whole->parameters().size(); ++i) halves->parameters()[i].copy_(whole->parameters()[i]);
  }
  torch::optim::SGD whole_optimizer(whole->parameters(), 0.1), halves_optimizer(halves->parameters(), 0.1);
  MixedPrecisionPlugin whole_plugin = MixedPrecisionOptions("32"), halves_plugin = MixedPrecisionOptions("32");
  whole_plugin.connect(*whole, whole_optimizer);
  halves_plugin.connect(*halves, halves_optimizer);
  auto [x, y] = MlpData(5).batch(0, 0, 16);
  whole_plugin.backward(torch::mse_loss(whole->forward(x), y));
  whole_plugin.optimizer_step(whole_optimizer);
  for (int half = 0; half < 2; ++half) {
    halves_plugin.set_gradient_sync(half == 1);
    halves_plugin.backward(torch::mse_loss(halves->forward(x.narrow(0, 8 * half, 8)), y.narrow(0, 8 * half, 8)) / 2);
  }
  halves_plugin.optimizer_step(halves_optimizer);
  for (size_t i = 0; i < whole->parameters().size(); ++i) {
    EXPECT_TRUE(torch::allclose(whole->parameters()[i], halves->parameters()[i], 1e-6, 1e-7)) << "param " << i;
  }
}

TEST(ConvertInputOutputTest, OnlyFloat32InputsAndHalfOutputsAreCast) {
  // Megatron's Float16Module: float32 inputs become the params dtype, half outputs float32; a
  // float64 target or mask and integer ids pass as they are (not narrowed to bf16).
  MixedPrecisionPlugin bf16 = recipes::bf16_mixed();
  EXPECT_EQ(bf16.convert_input(torch::randn({3, 5})).scalar_type(), at::kBFloat16);
  EXPECT_EQ(bf16.convert_input(torch::randn({3, 5}, at::kDouble)).scalar_type(), at::kDouble);
  EXPECT_EQ(bf16.convert_input(torch::randn({3, 5}, at::kHalf)).scalar_type(), at::kHalf);
  EXPECT_EQ(bf16.convert_input(torch::arange(7)).scalar_type(), at::kLong);
  EXPECT_EQ(bf16.convert_output(torch::randn({3, 5}, at::kBFloat16)).scalar_type(), at::kFloat);
  EXPECT_EQ(bf16.convert_output(torch::randn({3, 5}, at::kHalf)).scalar_type(), at::kFloat);
  EXPECT_EQ(bf16.convert_output(torch::randn({3, 5}, at::kDouble)).scalar_type(), at::kDouble);
  const auto exact = torch::randn({3, 5}, at::kDouble);
  EXPECT_TRUE(torch::equal(bf16.convert_output(exact), exact));
  MixedPrecisionPlugin fp16 = recipes::fp16_mixed();
  EXPECT_EQ(fp16.convert_input(torch::randn({3, 5})).scalar_type(), at::kHalf);
  MixedPrecisionPlugin fp32 = MixedPrecisionOptions("32");
  EXPECT_EQ(fp32.convert_input(torch::randn({3, 5})).scalar_type(), at::kFloat);
}

// Many bf16 micro-batches on one rank: their gradients are summed in float32 under
// grad_reduce_in_fp32 (Megatron's float32 main_grad), in bf16 without it. The weight's gradient
// in micro-batch k is exactly c_k (loss = sum(w * c_k)); SGD with lr 1 makes the master move by
// exactly the sum, so the master's change is the sum the step used.
void check_micro_batch_sum(const at::Device& device, bool grad_reduce_in_fp32) {
  SCOPED_TRACE(c10::str(device, grad_reduce_in_fp32 ? ", float32 sum" : ", bf16 sum"));
  torch::manual_seed(7);
  torch::nn::Linear layer(torch::nn::LinearOptions(13, 7).bias(false));
  layer->to(device);
  torch::optim::SGD optimizer(layer->parameters(), 1.0);
  MixedPrecisionPlugin plugin = recipes::bf16_mixed().grad_reduce_in_fp32(grad_reduce_in_fp32);
  plugin.connect(*layer, optimizer);
  ASSERT_EQ(layer->weight.scalar_type(), at::kBFloat16);
  constexpr int kMicroBatches = 300;  // past 256, where bf16's spacing is 2
  const auto grads = (torch::rand({kMicroBatches, 7, 13}) + 0.5).to(at::kBFloat16);
  const auto exact = grads.to(at::kDouble).sum(0);
  auto running_bf16 = grads[0].clone();  // autograd's accumulation: each sum rounded to bf16
  for (int k = 1; k < kMicroBatches; ++k) running_bf16 = (running_bf16.to(at::kFloat) + grads[k].to(at::kFloat)).to(at::kBFloat16);
  ASSERT_GT((running_bf16.to(at::kDouble) - exact).abs().max().item<double>(), 10.0);  // the case tells them apart
  const auto& optimizer_masters = plugin.distributed_optimizer()->master_shards();
  ASSERT_EQ(optimizer_masters.size(), 1u);
  for (int step = 0; step < 2; ++step) {  // the second step: the float32 sums were zeroed
    const auto before = optimizer_masters[0].to(torch::kCPU, at::kDouble);
    for (int k = 0; k < kMicroBatches; ++k) {
      plugin.set_gradient_sync(k == kMicroBatches - 1);
      plugin.backward((layer->weight * grads[k].to(device)).sum());
    }
    ASSERT_TRUE(plugin.optimizer_step(optimizer));
    const auto used = before - optimizer_masters[0].to(torch::kCPU, at::kDouble);
    if (grad_reduce_in_fp32) {
      // float32: each of the 300 adds rounds by at most half a unit at 512 (1.5e-5): under 0.005.
      EXPECT_LT((used - exact).abs().max().item<double>(), 0.02) << "step " << step;
    } else {
      EXPECT_LT((used - running_bf16.to(at::kDouble)).abs().max().item<double>(), 1e-4) << "step " << step;
    }
  }
}

TEST(MicroBatchSumTest, ManyBf16MicroBatchesSumInFloat32OnOneRank) {
  check_micro_batch_sum(at::kCPU, /*grad_reduce_in_fp32=*/true);
  check_micro_batch_sum(at::kCPU, /*grad_reduce_in_fp32=*/false);
}

TEST(MicroBatchSumTest, AParameterWithoutAGradientIsNotStepped) {
  // An unused parameter and a frozen one get no gradient in an accumulated step: AdamW must not
  // decay them (a zero float32 sum handed to the step would), as without accumulation.
  torch::manual_seed(3);
  torch::nn::Linear used(6, 4), unused(6, 4), frozen(6, 4);
  frozen->weight.set_requires_grad(false);
  std::vector<torch::Tensor> params = used->parameters();
  for (const auto& module : {unused, frozen}) {
    for (const auto& param : module->parameters()) params.push_back(param);
  }
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(0.1).weight_decay(0.5));
  torch::nn::Sequential model(used, unused, frozen);
  MixedPrecisionPlugin plugin = recipes::bf16_mixed();
  plugin.connect(*model, optimizer);
  const auto before_unused = unused->weight.clone(), before_frozen = frozen->weight.clone();
  const auto before_used = used->weight.clone();
  for (int k = 0; k < 3; ++k) {
    plugin.set_gradient_sync(k == 2);
    plugin.backward(used->forward(torch::randn({5, 6}).to(at::kBFloat16)).to(at::kFloat).square().sum());
  }
  ASSERT_TRUE(plugin.optimizer_step(optimizer));
  EXPECT_FALSE(torch::equal(used->weight, before_used));
  EXPECT_TRUE(torch::equal(unused->weight, before_unused));
  EXPECT_TRUE(torch::equal(frozen->weight, before_frozen));
}

TEST(MicroBatchSumTest, MainGradientsAreThisStepsSumsOnly) {
  // The sums are not zeroed between steps (a step's first take writes each): a parameter with a
  // gradient last step and none in this one keeps last step's sum in the buffer, and
  // main_gradients (what the gradients-unchanged check reads) must not hand it out.
  torch::manual_seed(4);
  torch::nn::Linear a(6, 4), b(6, 4);
  torch::optim::SGD optimizer(torch::nn::Sequential(a, b)->parameters(), 0.1);
  torch::nn::Sequential model(a, b);
  MixedPrecisionPlugin plugin = recipes::bf16_mixed();
  plugin.connect(*model, optimizer);
  const auto x = torch::randn({5, 6}).to(at::kBFloat16);
  auto step = [&](bool use_b) {
    plugin.set_gradient_sync(false);
    auto loss = a->forward(x).to(at::kFloat).square().sum();
    if (use_b) loss = loss + b->forward(x).to(at::kFloat).square().sum();
    plugin.backward(loss);
    const size_t summed = plugin.distributed_optimizer()->main_gradients().size();
    plugin.set_gradient_sync(true);
    plugin.backward(a->forward(x).to(at::kFloat).square().sum());
    EXPECT_TRUE(plugin.optimizer_step(optimizer));
    return summed;
  };
  EXPECT_EQ(step(/*use_b=*/true), 4u);   // a's and b's weight and bias
  EXPECT_EQ(step(/*use_b=*/false), 2u);  // a's only: b's sums are last step's
}

TEST(MicroBatchSumTest, ClippingTheParametersGradIsNamed) {
  // With float32 sums the parameters' .grad holds only the last micro-batch's gradient between
  // plugin.backward and the step: torch::nn::utils::clip_grad_norm_ there would clip a part of
  // the step's gradient. An error naming plugin.clip_gradients, which works.
  torch::manual_seed(5);
  torch::nn::Linear layer(6, 4);
  torch::optim::SGD optimizer(layer->parameters(), 0.1);
  MixedPrecisionPlugin plugin = recipes::bf16_mixed();
  plugin.connect(*layer, optimizer);
  const auto x = torch::randn({5, 6}).to(at::kBFloat16);
  auto two_micro_batches = [&] {
    for (int k = 0; k < 2; ++k) {
      plugin.set_gradient_sync(k == 1);
      plugin.backward(layer->forward(x).to(at::kFloat).square().sum());
    }
  };
  two_micro_batches();
  torch::nn::utils::clip_grad_norm_(layer->parameters(), 1e-3);
  ExpectErrorContaining([&] { plugin.optimizer_step(optimizer); },
                        "the parameters' .grad holds only the last micro-batch's");
  plugin.discard_gradients(optimizer);
  two_micro_batches();
  plugin.clip_gradients(optimizer, 1e-3);
  EXPECT_TRUE(plugin.optimizer_step(optimizer));
}

TEST(MicroBatchSumTest, ManyBf16MicroBatchesSumInFloat32OnOneRank_CUDA) {
  AMP8_REQUIRE_CUDA();
  check_micro_batch_sum(at::Device(at::kCUDA, 0), /*grad_reduce_in_fp32=*/true);  // the fused SGD step
  check_micro_batch_sum(at::Device(at::kCUDA, 0), /*grad_reduce_in_fp32=*/false);
}

// ---- autocast ----

TEST(AutocastGuardTest, EnablesAndRestoresStateAndDtype) {
  at::autocast::set_autocast_dtype(at::kCPU, at::kHalf);
  ASSERT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  auto a = torch::randn({8, 8}), b = torch::randn({8, 8});
  {
    AutocastGuard outer(at::kBFloat16);
    EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
    EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
    {
      AutocastGuard inner(at::kBFloat16, {at::kCPU}, /*enabled=*/false);
      EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
    }
    EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
    EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), at::kHalf);
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
}

TEST(AutocastGuardTest, PluginWithAutocastKeepsFloat32ParamsAsTheirOwnMasters) {
  auto model = testing::make_mlp();
  torch::optim::Adam optimizer(model->parameters(), 1e-3);
  MixedPrecisionPlugin plugin = MixedPrecisionOptions("bf16-mixed").params_dtype(at::kFloat).autocast_enabled(true);
  plugin.connect(*model, optimizer);
  const auto params = model->parameters();
  const auto masters = plugin.master_params();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].scalar_type(), at::kFloat);
    EXPECT_TRUE(masters[i].is_same(params[i]));
  }
  torch::Tensor out;
  {
    auto context = plugin.forward_context();
    out = model->forward(plugin.convert_input(torch::randn({4, 32})));
    EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(plugin.convert_output(out).scalar_type(), at::kFloat);
}

// ---- every precision against fp32 ----

struct PrecisionCase {
  std::string name;
  MixedPrecisionOptions options;
  double bound;  // relative difference of the final loss to fp32's
};

std::vector<PrecisionCase> precision_cases() {
  return {
      {"fp32", MixedPrecisionOptions("32"), 0.0},
      {"bf16_mixed", recipes::bf16_mixed(), 0.01},
      {"fp16_mixed", recipes::fp16_mixed(), 0.01},
      // FP8 (forced on for these small GEMMs): within issue 3's 2% bound for FP8 training.
      {"bf16_with_fp8_mixed", recipes::bf16_with_fp8_mixed().fp8_min_gemm_size(0), 0.02},
      {"fp16_with_fp8_mixed", recipes::fp16_with_fp8_mixed().fp8_min_gemm_size(0), 0.02},
      // Adam's moments in bfloat16 (Megatron-Core's precision-aware optimizer): as bf16_mixed.
      {"bf16_mixed_bf16_moments", recipes::bf16_mixed().exp_avg_dtype(at::kBFloat16).exp_avg_sq_dtype(at::kBFloat16),
       0.01},
  };
}

struct TrainResult {
  double final_loss;  // mean of the last 20 steps
  bool params_ok;
};

template <typename Model, typename Data>
TrainResult train(Model model, const Data& data, const PrecisionCase& precision,
                  torch::Device device, int steps) {
  model->to(device);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(2e-3).weight_decay(0.01));
  MixedPrecisionPlugin plugin = precision.options;
  plugin.connect(*model, optimizer);
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = data.batch(step, 0);
    const torch::Tensor loss = forward_backward(plugin, model, x.to(device), y.to(device));
    plugin.clip_gradients(optimizer, 1.0);
    plugin.optimizer_step(optimizer);
    losses.push_back(loss.item<double>());
  }
  double tail = 0;
  for (int i = steps - 20; i < steps; ++i) tail += losses[i];
  // Model parameters in params_dtype (FP8 weights under fp8_params); the optimizer all float32.
  const auto dtype = precision.options.resolved_params_dtype();
  bool params_ok = true;
  for (const auto& p : model->parameters()) {
    const bool ok = p.scalar_type() == dtype || (precision.options.fp8_params() && is_fp8(p.scalar_type()));
    EXPECT_TRUE(ok) << precision.name << ": a model parameter is " << p.scalar_type();
    params_ok &= ok;
  }
  for (const auto& m : plugin.master_params()) EXPECT_EQ(m.scalar_type(), at::kFloat);
  expect_optimizer_sees_only_fp32(
      optimizer, {precision.options.exp_avg_dtype(), precision.options.exp_avg_sq_dtype()});
  return {tail / 20, params_ok};
}

class PrecisionTrainingTest : public ::testing::TestWithParam<std::string> {
 protected:
  torch::Device device() const {
    return GetParam() == "GPU_CUDA" ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  }
  void SetUp() override {
    if (GetParam() == "GPU_CUDA") AMP8_REQUIRE_CUDA();
  }
};

TEST_P(PrecisionTrainingTest, MlpEveryPrecisionEndsNearFp32) {
  MlpData data(21);
  double fp32 = 0;
  for (const auto& precision : precision_cases()) {
    torch::manual_seed(1);
    const auto result = train(testing::make_mlp(), data, precision, device(), 300);
    if (precision.name == "fp32") {
      fp32 = result.final_loss;
      continue;
    }
    EXPECT_LE(std::abs(result.final_loss - fp32) / fp32, precision.bound)
        << precision.name << " " << result.final_loss << " vs fp32 " << fp32;
  }
  EXPECT_LT(fp32, 0.2) << "the MLP learns: noise floor 0.09, loss at start ~0.5";
}

TEST_P(PrecisionTrainingTest, TransformerEveryPrecisionEndsNearFp32) {
  SequenceData data(22);
  double fp32 = 0;
  for (const auto& precision : precision_cases()) {
    torch::manual_seed(2);
    const auto result = train(TinyTransformer(2), data, precision, device(), 300);
    if (precision.name == "fp32") {
      fp32 = result.final_loss;
      continue;
    }
    EXPECT_LE(std::abs(result.final_loss - fp32) / fp32, precision.bound)
        << precision.name << " " << result.final_loss << " vs fp32 " << fp32;
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, PrecisionTrainingTest, ::testing::Values("CPU", "GPU_CUDA"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace amp8
