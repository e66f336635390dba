// The Llama 3 decoder (recipes/llama): rotary embeddings against a complex rotation, Llama 3.1's
// frequency scaling, grouped-query attention against repeated K/V heads, causality, training in
// every precision on the CPU, exact resume, and bad configs.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <complex>
#include <numbers>

#include "plugin/training/trainer.h"
#include "recipes/llama/llama_model.h"
#include "recipes/precision.h"
#include "tests/test_util.h"

namespace amp8 {
namespace {

using recipes::LlamaConfig;
using recipes::LlamaModel;
using recipes::RopeScaling;
using recipes::Rotary;

class LlamaModelTest : public testing::SeededTest {};

TEST_F(LlamaModelTest, RotaryIsAComplexRotationOfEachPair) {
  const int64_t batch = 2, seq = 7, heads = 3, head_dim = 10;
  const auto x = torch::randn({batch, seq, heads, head_dim});
  const auto frequencies = recipes::rope_inverse_frequencies(head_dim, 10000.0, std::nullopt);
  const auto rotated = recipes::apply_rotary(x, Rotary::at_positions(frequencies, seq));
  ASSERT_EQ(rotated.sizes(), x.sizes());
  const auto xa = x.accessor<float, 4>(), ra = rotated.accessor<float, 4>();
  const auto fa = frequencies.accessor<float, 1>();
  double worst = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t p = 0; p < seq; ++p)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < head_dim / 2; ++i) {
          const std::complex<double> z(xa[b][p][h][2 * i], xa[b][p][h][2 * i + 1]);
          const auto expected = z * std::polar(1.0, static_cast<double>(p) * fa[i]);
          worst = std::max({worst, std::abs(ra[b][p][h][2 * i] - expected.real()),
                            std::abs(ra[b][p][h][2 * i + 1] - expected.imag())});
        }
  EXPECT_LT(worst, 2e-6);
  // Position 0 is not rotated; the frequencies are theta^(-2i/d).
  EXPECT_TRUE(torch::equal(rotated.select(1, 0), x.select(1, 0)));
  EXPECT_NEAR(frequencies[1].item<double>(), std::pow(10000.0, -2.0 / head_dim), 1e-7);
}

TEST_F(LlamaModelTest, RotaryKeepsTheInputsDtype) {
  const auto x = torch::randn({1, 5, 2, 8}).to(torch::kBFloat16);
  const auto frequencies = recipes::rope_inverse_frequencies(8, 500000.0, std::nullopt);
  const auto rotated = recipes::apply_rotary(x, Rotary::at_positions(frequencies, 5));
  EXPECT_EQ(rotated.scalar_type(), torch::kBFloat16);
  testing::ExpectErrorContaining(
      [&] { recipes::apply_rotary(x, Rotary::at_positions(frequencies, 4)); }, "with seq 4");
}

// llama-models' apply_scaling (Llama 3.1: factor 8, low 1, high 4, context 8192) at head_dim 128,
// theta 500000: the three bands, each value from its own formula.
TEST_F(LlamaModelTest, FrequencyScalingFollowsLlama31) {
  const auto scaled = recipes::rope_inverse_frequencies(128, 500000.0, RopeScaling());
  const auto plain = recipes::rope_inverse_frequencies(128, 500000.0, std::nullopt);
  ASSERT_EQ(scaled.size(0), 64);
  int high = 0, low = 0, middle = 0;
  for (int64_t i = 0; i < 64; ++i) {
    const double freq = std::pow(500000.0, -static_cast<double>(2 * i) / 128.0);
    const double wavelength = 2 * std::numbers::pi / freq;
    double expected;
    if (wavelength < 8192.0 / 4) {
      expected = freq, ++high;
    } else if (wavelength > 8192.0 / 1) {
      expected = freq / 8, ++low;
    } else {
      const double smooth = (8192.0 / wavelength - 1) / (4 - 1);
      expected = (1 - smooth) * freq / 8 + smooth * freq, ++middle;
    }
    EXPECT_FLOAT_EQ(scaled[i].item<float>(), static_cast<float>(expected)) << "i = " << i;
    EXPECT_FLOAT_EQ(plain[i].item<float>(), static_cast<float>(freq)) << "i = " << i;
  }
  // Each band is present at this shape (i < 29 kept, 29..35 interpolated, the rest / 8).
  EXPECT_EQ(high, 29);
  EXPECT_EQ(middle, 6);
  EXPECT_EQ(low, 29);
  EXPECT_FLOAT_EQ(scaled[0].item<float>(), 1.0f);
  EXPECT_FLOAT_EQ(scaled[63].item<float>(), plain[63].item<float>() / 8);
}

// enable_gqa against the same attention with each K/V head repeated for its query heads.
TEST_F(LlamaModelTest, GroupedQueryAttentionMatchesRepeatedKvHeads) {
  const auto config = LlamaConfig().hidden(48).heads(6).kv_heads(2).max_seq_len(16);
  recipes::LlamaAttention attention(config);
  const int64_t b = 2, t = 9, d = config.head_dim();
  const auto x = torch::randn({b, t, config.hidden()});
  const auto rotary = Rotary::at_positions(
      recipes::rope_inverse_frequencies(d, config.rope_theta(), std::nullopt), t);
  torch::NoGradGuard no_grad;
  const auto out = attention->forward(x, rotary);

  // The RMSNorm inside qkv (Fp8LayerNormLinear), then its linear layer.
  const auto normalized =
      at::rms_norm(x, {config.hidden()}, attention->qkv->layer_norm->weight, config.norm_eps());
  const auto qkv = torch::nn::functional::linear(normalized, attention->qkv->linear->weight)
                       .split({6 * d, 2 * d, 2 * d}, -1);
  const auto q = recipes::apply_rotary(qkv[0].view({b, t, 6, d}), rotary).transpose(1, 2);
  auto k = recipes::apply_rotary(qkv[1].view({b, t, 2, d}), rotary).transpose(1, 2);
  auto v = qkv[2].view({b, t, 2, d}).transpose(1, 2);
  k = k.repeat_interleave(3, 1), v = v.repeat_interleave(3, 1);  // query head h reads K/V head h / 3
  const auto expected = torch::nn::functional::linear(
      at::scaled_dot_product_attention(q, k, v, {}, 0.0, true).transpose(1, 2).reshape({b, t, 48}),
      attention->o_proj->weight);
  EXPECT_TRUE(torch::allclose(out, expected, 1e-5, 1e-6)) << (out - expected).abs().max();
}

TEST_F(LlamaModelTest, LogitsHaveTheVocabularyAndAreCausal) {
  for (const bool tied : {false, true}) {
    LlamaModel model(LlamaConfig().vocab_size(100).tie_embeddings(tied));
    EXPECT_EQ(static_cast<bool>(model->output), !tied);
    auto tokens = torch::randint(0, 100, {2, 12}, torch::kLong);
    torch::NoGradGuard no_grad;
    const auto logits = model->forward(tokens);
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 12, 100}));
    auto changed = tokens.clone();
    changed.index_put_({torch::indexing::Slice(), 6}, (tokens.select(1, 6) + 1) % 100);
    const auto after = model->forward(changed);
    const auto prefix = torch::indexing::Slice(0, 6), rest = torch::indexing::Slice(6, 12);
    EXPECT_TRUE(torch::equal(after.index({torch::indexing::Slice(), prefix}),
                             logits.index({torch::indexing::Slice(), prefix})))
        << "a later token changed an earlier position's logits";
    EXPECT_FALSE(torch::allclose(after.index({torch::indexing::Slice(), rest}),
                                 logits.index({torch::indexing::Slice(), rest})));
  }
}

TEST_F(LlamaModelTest, ParameterCountIsTheLayersSum) {
  const auto config = LlamaConfig().vocab_size(96).hidden(64).layers(3).heads(8).kv_heads(2).ffn_hidden(80);
  const int64_t h = 64, d = 8, f = 80, v = 96;
  const int64_t block = h + h * (8 + 2 * 2) * d + h * h + h + 2 * f * h + f * h;
  EXPECT_EQ(LlamaModel(config)->parameter_count(), v * h + 3 * block + h + h * v);
  EXPECT_EQ(LlamaModel(LlamaConfig(config).tie_embeddings(true))->parameter_count(), v * h + 3 * block + h);
}

TEST_F(LlamaModelTest, NamedConfigsHaveThePublishedShapes) {
  const auto eight = LlamaConfig::named("llama3_8b");
  EXPECT_EQ(eight.hidden(), 4096);
  EXPECT_EQ(eight.layers(), 32);
  EXPECT_EQ(eight.heads(), 32);
  EXPECT_EQ(eight.kv_heads(), 8);
  EXPECT_EQ(eight.ffn_hidden(), 14336);
  EXPECT_FALSE(eight.rope_scaling().has_value());
  EXPECT_FALSE(eight.tie_embeddings());
  const auto one = LlamaConfig::named("llama32_1b");
  EXPECT_EQ(one.hidden(), 2048);
  EXPECT_EQ(one.layers(), 16);
  EXPECT_EQ(one.kv_heads(), 8);
  EXPECT_EQ(one.ffn_hidden(), 8192);
  ASSERT_TRUE(one.rope_scaling().has_value());
  EXPECT_EQ(one.rope_scaling()->factor(), 32.0);
  EXPECT_EQ(LlamaConfig::named("llama3_8b_4layer").layers(), 4);
  EXPECT_EQ(LlamaConfig::named("llama3_8b_4layer").ffn_hidden(), 14336);
  const auto three = LlamaConfig::named("llama32_3b");
  EXPECT_EQ(three.hidden(), 3072);
  EXPECT_EQ(three.layers(), 28);
  EXPECT_EQ(three.heads(), 24);
  for (const auto& name : LlamaConfig::names()) EXPECT_NO_THROW(LlamaConfig::named(name).validate()) << name;
}

TEST_F(LlamaModelTest, BadConfigsAreNamed) {
  testing::ExpectErrorContaining([] { LlamaModel(LlamaConfig().hidden(48).heads(6).kv_heads(4)); },
                                 "heads (6) must be a multiple of kv_heads (4)");
  testing::ExpectErrorContaining([] { LlamaModel(LlamaConfig().hidden(60).heads(4)); },
                                 "head size hidden / heads must be even");
  testing::ExpectErrorContaining([] { LlamaModel(LlamaConfig().hidden(64).heads(5)); },
                                 "hidden (64) must be a positive multiple of heads (5)");
  testing::ExpectErrorContaining([] { LlamaModel(LlamaConfig().rope_scaling(RopeScaling().low_freq_factor(4))); },
                                 "low_freq_factor < high_freq_factor");
  testing::ExpectErrorContaining([] { LlamaConfig::named("llama2_7b"); }, "\"llama3_8b_4layer\", got \"llama2_7b\"");
  LlamaModel model(LlamaConfig().max_seq_len(8));
  testing::ExpectErrorContaining([&] { model->forward(torch::zeros({1, 9}, torch::kLong)); },
                                 "sequence length 9 exceeds max_seq_len 8");
}

// A random walk over 64 tokens, next = current + one of 8 steps: 2.079 nats (ln 8) at best.
torch::Tensor walk_batch(int64_t step, int64_t micro_batch) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000 * step + micro_batch + 7));
  const auto start = torch::randint(0, 64, {8, 1}, generator, torch::kLong);
  const auto steps = torch::randint(0, 8, {8, 32}, generator, torch::kLong);
  return torch::cat({start, start + steps.cumsum(1)}, 1).remainder(64);
}

struct TrainedRun {
  std::vector<double> losses;
  double last_mean() const {
    double sum = 0;
    for (size_t i = losses.size() - 10; i < losses.size(); ++i) sum += losses[i];
    return sum / 10;
  }
};

TrainedRun train(const MixedPrecisionOptions& precision, int64_t steps, const std::string& checkpoint_dir = "",
                 const std::string& resume_from = "", int64_t save_every = 0) {
  at::manual_seed(5);
  LlamaModel model(LlamaConfig().vocab_size(64).hidden(64).layers(2).heads(4).kv_heads(2).ffn_hidden(128).max_seq_len(32));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  Trainer trainer(TrainerOptions().max_steps(steps).log_every_n_steps(1000).checkpoint_dir(checkpoint_dir)
                      .every_n_train_steps(save_every).save_last(false));
  trainer.plugins = precision;
  std::ostringstream log;
  trainer.log = &log;
  trainer.fit(*model, optimizer, [&](const TrainStepInput& in) {
    const auto tokens = walk_batch(in.step, in.micro_batch);
    const auto logits = in.precision.convert_output(model->forward(tokens.slice(1, 0, 32)));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, 64}).to(torch::kFloat32),
                                                tokens.slice(1, 1, 33).reshape({-1}));
  }, resume_from);
  TrainedRun run;
  for (const auto& m : trainer.history()) run.losses.push_back(m.loss);
  return run;
}

// Every precision the presets have (FP8 in every GEMM: fp8_min_gemm_size 0) ends within 2% of
// fp32's loss (mean of the last 10 of 300 steps), near the task's floor ln 8.
TEST_F(LlamaModelTest, TrainsInEveryPrecisionLikeFp32) {
  const auto fp32 = train(MixedPrecisionOptions("32"), 300);
  EXPECT_LT(fp32.last_mean(), 2.3) << "fp32 did not learn the walk (floor ln 8 = 2.079; ln 64 = 4.16 untrained)";
  EXPECT_GT(fp32.losses.front(), 3.5);
  const std::vector<std::pair<std::string, MixedPrecisionOptions>> cases = {
      {"bf16-mixed", recipes::bf16_mixed()},
      {"16-mixed", recipes::fp16_mixed()},
      {"bf16 + FP8 delayed", recipes::bf16_with_fp8_mixed().fp8_params(false).fp8_min_gemm_size(0)},
      {"bf16 + FP8 current scaling", recipes::bf16_with_fp8_current_scaling_mixed().fp8_params(false).fp8_min_gemm_size(0)},
  };
  for (const auto& [name, precision] : cases) {
    const auto run = train(precision, 300);
    EXPECT_NEAR(run.last_mean(), fp32.last_mean(), 0.02 * fp32.last_mean()) << name;
  }
}

// Block i's four Fp8Linear modules, by name.
std::vector<std::pair<std::string, Fp8Linear>> block_linears(const LlamaModel& model, int64_t i) {
  const auto block = model->blocks->ptr(static_cast<size_t>(i))->as<recipes::LlamaBlockImpl>();
  return {{"qkv", block->attention->qkv->linear}, {"o_proj", block->attention->o_proj},
          {"gate_up", block->mlp->ln_fc1->linear}, {"down", block->mlp->fc2}};
}

// NeMo's num_layers_at_start/end_in_bf16 reach the Llama blocks (the ModuleList `blocks`): every
// Fp8Linear of the first and the last block is kept in high precision, the others' are not, and
// every one gets the plugin's fp8_min_gemm_size.
TEST_F(LlamaModelTest, FirstAndLastBlocksInBf16) {
  LlamaModel model(LlamaConfig().vocab_size(64).hidden(64).layers(4).heads(4).kv_heads(2).ffn_hidden(128).max_seq_len(32));
  torch::optim::AdamW optimizer(model->parameters(), 1e-3);
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_params(false).fp8_min_gemm_size(0)
                                    .num_layers_at_start_in_bf16(1).num_layers_at_end_in_bf16(1);
  plugin.connect(*model, optimizer);
  for (int64_t i = 0; i < 4; ++i) {
    const bool kept = i == 0 || i == 3;
    for (const auto& [name, linear] : block_linears(model, i)) {
      EXPECT_EQ(linear->options.keep_in_high_precision(), kept) << "blocks." << i << "." << name;
      EXPECT_EQ(linear->options.fp8_min_gemm_size(), 0) << "blocks." << i << "." << name;
    }
  }
  EXPECT_EQ(plugin.conversion().kept_in_high_precision.size(), 8u);  // 4 Fp8Linear x 2 blocks
}

// Under fp8_params the kept blocks are built with high-precision weights (LlamaModel's
// Fp8ModelInit::Layer scopes), the others with FP8-only ones, and the plugin connects them.
TEST_F(LlamaModelTest, BlocksKeptInBf16HaveHighPrecisionWeightsUnderFp8Params) {
  LlamaModel model = [] {
    Fp8ModelInit init(true, true, 1, 1);
    return LlamaModel(LlamaConfig().vocab_size(64).hidden(64).layers(4).heads(4).kv_heads(2).ffn_hidden(128).max_seq_len(32));
  }();
  for (int64_t i = 0; i < 4; ++i) {
    const bool kept = i == 0 || i == 3;
    for (const auto& [name, linear] : block_linears(model, i)) {
      EXPECT_EQ(linear->options.fp8_params(), !kept) << "blocks." << i << "." << name;
    }
  }
  torch::optim::AdamW optimizer(model->parameters(), 1e-3);
  MixedPrecisionPlugin plugin = recipes::bf16_with_fp8_mixed().fp8_params(true).fp8_min_gemm_size(0)
                                    .num_layers_at_start_in_bf16(1).num_layers_at_end_in_bf16(1);
  plugin.connect(*model, optimizer);
  EXPECT_EQ(plugin.conversion().kept_in_high_precision.size(), 8u);
}

// 12 steps, a checkpoint, fresh objects, 12 more == 24 uninterrupted steps, loss for loss.
TEST_F(LlamaModelTest, ResumeIsExact) {
  for (const auto& precision : {MixedPrecisionOptions("32"),
                                recipes::bf16_with_fp8_mixed().fp8_params(false).fp8_min_gemm_size(0)}) {
    const auto dir = testing::scratch_path("llama", "resume");
    const auto whole = train(precision, 24);
    const auto first = train(precision, 12, dir.string(), "", 12);
    const auto second = train(precision, 24, dir.string(), dir.string());
    ASSERT_EQ(first.losses.size(), 12u);
    ASSERT_EQ(second.losses.size(), 12u);
    for (size_t i = 0; i < 12; ++i) {
      EXPECT_EQ(first.losses[i], whole.losses[i]) << "step " << i;
      EXPECT_EQ(second.losses[i], whole.losses[12 + i]) << "step " << 12 + i;
    }
  }
}

}  // namespace
}  // namespace amp8
