// The GPT model, the byte data and the loss picture.
#include "recipes/gpt/gpt_model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "plugin/modules/convert_module.h"
#include "plugin/fp8/fp8_autocast.h"
#include "recipes/gpt/data.h"
#include "recipes/gpt/loss_plot.h"
#include "tests/test_util.h"

namespace amp8::recipes {
namespace {

using testing::ExpectErrorContaining;

class GptModelTest : public testing::SeededTest {};

TEST_F(GptModelTest, LogitsHaveTheVocabularyAndAreCausal) {
  GptModel model(GptConfig::named("tiny"));
  model->eval();
  auto tokens = torch::randint(256, {3, 40}, torch::kLong);
  auto logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 40, 256}));
  // Changing a later token leaves earlier positions' logits exactly as they were.
  auto changed = tokens.clone();
  changed[1][30] = (changed[1][30].item<int64_t>() + 1) % 256;
  auto again = model->forward(changed);
  EXPECT_TRUE(again.narrow(1, 0, 30).equal(logits.narrow(1, 0, 30)));
  EXPECT_FALSE(again[1][30].equal(logits[1][30]));
}

TEST_F(GptModelTest, HeadIsTiedAndTheModelRunsInFp8) {
  GptModel model(GptConfig::named("tiny"));
  const auto params = model->named_parameters();
  EXPECT_FALSE(params.contains("head.weight"));
  // tiny: embeddings 256·64 + 256·64, 2 blocks of (LN 2·64 + qkv 64·192+192 + proj 64·64+64 +
  // LN 2·64 + fc1 64·256+256 + fc2 256·64+64), final LN 2·64.
  const int64_t block = 128 + 64 * 192 + 192 + 64 * 64 + 64 + 128 + 64 * 256 + 256 + 256 * 64 + 64;
  EXPECT_EQ(model->parameter_count(), 2 * 256 * 64 + 2 * block + 128);
  // The tiny model's GEMMs are below the default fp8_min_gemm_size; the precision's knob
  // (here through convert_to_fp8, as MixedPrecisionPlugin applies it) reaches its modules.
  convert_to_fp8(*model, Fp8ConversionOptions().fp8_min_gemm_size(0));
  auto tokens = torch::randint(256, {2, 32}, torch::kLong);
  torch::Tensor fp8_logits;
  {
    Fp8Autocast fp8;
    fp8_logits = model->forward(tokens);
  }
  auto logits = model->forward(tokens);
  EXPECT_GT(testing::relative_error(fp8_logits, logits), 0.0) << "the FP8 path ran";
  EXPECT_LE(testing::relative_error(fp8_logits, logits), 0.1);
}

// Megatron's bf16 layers under FP8 weights (fp8_params): the layers the precision keeps in bf16
// are built with high-precision weights (Fp8ModelInit's counts, GptModel's Fp8ModelInit::Layer
// scopes), the others with FP8-only ones; and a kept layer built with an FP8-only weight is an
// error at conversion, not a "bf16" layer that trains a dequantized FP8 weight.
TEST_F(GptModelTest, LayersKeptInBf16AreBuiltWithHighPrecisionWeights) {
  const auto config = GptConfig::named("tiny").layers(3);
  const auto linears = [](const GptModel& model, size_t i) {
    const auto block = model->blocks->ptr(i)->as<GptBlockImpl>();
    return std::vector<Fp8LinearImpl*>{block->ln_qkv->linear.get(), block->proj.get(),
                                       block->mlp->ln_fc1->linear.get(), block->mlp->fc2.get()};
  };
  const auto options = Fp8ConversionOptions().fp8_params(true).fp8_min_gemm_size(0)
                           .num_layers_at_start_in_bf16(1).num_layers_at_end_in_bf16(1);
  GptModel model = [&] {
    Fp8ModelInit init(true, true, 1, 1);
    return GptModel(config);
  }();
  EXPECT_FALSE(Fp8ModelInit::is_enabled()) << "the guard is gone";
  for (size_t i = 0; i < 3; ++i) {
    for (auto* linear : linears(model, i)) {
      EXPECT_EQ(linear->options.fp8_params(), i == 1) << "blocks." << i;
      EXPECT_EQ(linear->weight.scalar_type() == torch::kFloat8_e4m3fn, i == 1) << "blocks." << i;
    }
  }
  const auto conversion = convert_to_fp8(*model, options);
  EXPECT_EQ(conversion.kept_in_high_precision.size(), 8u);  // 4 Fp8Linear x blocks 0 and 2
  for (size_t i = 0; i < 3; ++i) {
    for (auto* linear : linears(model, i)) EXPECT_EQ(linear->options.keep_in_high_precision(), i != 1) << i;
  }

  GptModel fp8_everywhere = [&] {
    Fp8ModelInit init;
    return GptModel(config);
  }();
  ExpectErrorContaining([&] { convert_to_fp8(*fp8_everywhere, options); },
                        "convert_to_fp8: blocks.0.ln_qkv.linear is in a layer kept in bf16");
  ExpectErrorContaining([] { Fp8ModelInit init(true, true, 2, 2); GptModel model(GptConfig::named("tiny")); },
                        "num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 = 4 exceeds the model's 2 layers");
  ExpectErrorContaining([] { Fp8ModelInit init(true, true, -1, 0); }, "Fp8ModelInit: num_layers_at_start_in_bf16");
}

// GptConfig::fused_mlp picks how a block runs its MLP, not which parameters it has: the fused
// module (one call; FC2's forward() is not called) and its modules in sequence agree in an FP8
// region on the same parameters, within FP8 rounding (float32 on the CPU, where the two differ
// only in how tanh is computed). Every parameter gets a gradient either way.
TEST_F(GptModelTest, FusedMlpIsTheSameModelCalledOnce) {
  GptModel fused(GptConfig::named("tiny").fused_mlp(true));
  GptModel sequence(GptConfig::named("tiny").fused_mlp(false));
  {
    torch::NoGradGuard no_grad;
    const auto from = fused->named_parameters();
    for (auto& p : sequence->named_parameters()) p.value().copy_(from[p.key()]);
  }
  for (auto* model : {&fused, &sequence}) {
    convert_to_fp8(**model, Fp8ConversionOptions().fp8_min_gemm_size(0));
  }
  auto tokens = torch::randint(256, {2, 32}, torch::kLong);
  std::vector<torch::Tensor> losses;
  for (auto* model : {&fused, &sequence}) {
    torch::Tensor logits;
    {
      Fp8Autocast fp8;
      logits = (*model)->forward(tokens);
    }
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 256}), tokens.reshape({-1}));
    loss.backward();
    losses.push_back(loss);
  }
  const auto& block = fused->blocks[0]->as<GptBlock>();
  EXPECT_EQ(block->mlp->fc2->forward_calls(), 0) << "fused: one Fp8LayerNormMLP call";
  EXPECT_EQ(sequence->blocks[0]->as<GptBlock>()->mlp->fc2->forward_calls(), 1);
  EXPECT_LT(testing::relative_error(losses[0], losses[1]), 1e-3);
  const auto sequence_parameters = sequence->named_parameters();
  for (auto& p : fused->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_LT(testing::relative_error(p.value().grad(), sequence_parameters[p.key()].grad()), 2e-2)
        << p.key();
  }
}

TEST_F(GptModelTest, BadConfigsAreNamed) {
  ExpectErrorContaining([] { GptConfig::named("2b"); },
                        "config must be one of \"tiny\", \"small\", \"125m\", \"128m\", \"350m\", \"1b\", got \"2b\"");
  ExpectErrorContaining([] { GptModel(GptConfig().hidden(60).heads(8)); },
                        "hidden (60) must be a positive multiple of heads (8)");
  GptModel model(GptConfig::named("tiny"));
  ExpectErrorContaining([&] { model->forward(torch::zeros({1, 300}, torch::kLong)); },
                        "sequence length 300 exceeds max_seq_len 256");
  ExpectErrorContaining([&] { model->forward(torch::zeros({1, 3})); }, "tokens must be int64");
}

// The guard puts the asked kernel first, keeps the others in PyTorch's order, and restores.
TEST(AttentionBackendGuardTest, PutsTheBackendFirstAndRestores) {
  if (torch::cuda::is_available()) {
    // PyTorch sets its CUDA default order on the first CUDA attention call; a guard lets it
    // happen before reading the order it restores. Let it happen here too, first.
    const auto probe = torch::zeros({1, 1, 16, 64}, torch::dtype(torch::kBFloat16).device(torch::kCUDA));
    at::_fused_sdp_choice(probe, probe, probe);
  }
  const auto before = at::globalContext().sDPPriorityOrder();
  {
    AttentionBackendGuard cudnn("cudnn");
    const auto order = at::globalContext().sDPPriorityOrder();
    EXPECT_EQ(order[0], at::SDPBackend::cudnn_attention);
    std::vector<at::SDPBackend> rest(order.begin() + 1, order.end()), expected;
    for (auto b : before) {
      if (b != at::SDPBackend::cudnn_attention) expected.push_back(b);
    }
    EXPECT_EQ(rest, expected);
    {
      AttentionBackendGuard untouched("auto");
      EXPECT_EQ(at::globalContext().sDPPriorityOrder(), order);
    }
    EXPECT_EQ(at::globalContext().sDPPriorityOrder(), order);
  }
  EXPECT_EQ(at::globalContext().sDPPriorityOrder(), before);
  // "auto" restores nothing: an order set while it lives (PyTorch sets its CUDA default on the
  // first attention call) stays. (Restoring it made every later run of a --compare use flash
  // instead of PyTorch's cuDNN default: 8% slower at 1b, profiled.)
  {
    AttentionBackendGuard untouched("auto");
    at::globalContext().setSDPPriorityOrder({2, 1, 0, 3, 4});
  }
  EXPECT_EQ(at::globalContext().sDPPriorityOrder()[0], at::SDPBackend::efficient_attention);
  std::vector<int64_t> restore;
  for (auto b : before) restore.push_back(static_cast<int64_t>(b));
  at::globalContext().setSDPPriorityOrder(restore);
  testing::ExpectErrorContaining([] { AttentionBackendGuard("fa9"); },
                                 "attention-backend must be \"auto\", \"cudnn\", \"flash\" or "
                                 "\"efficient\", got \"fa9\"");
}

TEST(ByteDatasetTest, BatchesAreShiftedWindowsDrawnFromTheSeed) {
  const auto data = ByteDataset::builtin(1 << 16);
  EXPECT_EQ(data.size(), 1 << 16);
  auto [x, y] = data.batch(7, 3, 0, 4, 33, torch::kCPU);
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{4, 33}));
  EXPECT_TRUE(x.narrow(1, 1, 32).equal(y.narrow(1, 0, 32))) << "targets are the next bytes";
  auto [x2, y2] = data.batch(7, 3, 0, 4, 33, torch::kCPU);
  EXPECT_TRUE(x.equal(x2));
  auto [x3, y3] = data.batch(7, 4, 0, 4, 33, torch::kCPU);
  EXPECT_FALSE(x.equal(x3));
  EXPECT_TRUE((x >= 0).all().item<bool>() && (x < 256).all().item<bool>());
}

// On a GPU the batch goes through pinned memory without waiting for the device (copy_to_device):
// the same tokens as on the CPU, once the stream has run the copies, even when the next batch
// is drawn (and the pinned buffers of this one released) before that.
TEST(ByteDatasetTest, GpuBatchesAreTheCpuBatches_CUDA) {
  if (!testing::cuda_available()) GTEST_SKIP() << "no CUDA device";
  const auto data = ByteDataset::builtin(1 << 16);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> on_gpu;
  for (int64_t step = 0; step < 4; ++step) on_gpu.push_back(data.batch(7, step, 0, 8, 129, torch::kCUDA));
  for (int64_t step = 0; step < 4; ++step) {
    const auto [x, y] = data.batch(7, step, 0, 8, 129, torch::kCPU);
    EXPECT_TRUE(on_gpu[step].first.is_cuda());
    EXPECT_TRUE(on_gpu[step].first.is_contiguous());
    EXPECT_TRUE(on_gpu[step].first.cpu().equal(x)) << "step " << step;
    EXPECT_TRUE(on_gpu[step].second.cpu().equal(y)) << "step " << step;
  }
}

TEST(ByteDatasetTest, FilesAreMappedAndBadOnesNamed) {
  const auto dir = std::filesystem::temp_directory_path() / ("amp8_gpt_data_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "text.txt") << "hello, world. hello, amp8.";
    std::ofstream(dir / "empty.txt");
  }
  const auto data = ByteDataset::from_file((dir / "text.txt").string());
  EXPECT_EQ(data.size(), 26);
  auto [x, y] = data.batch(1, 0, 0, 2, 25, torch::kCPU);
  EXPECT_EQ(x[0][0].item<int64_t>(), 'h');
  ExpectErrorContaining([&] { ByteDataset::from_file((dir / "missing.txt").string()); },
                        "missing.txt does not exist");
  ExpectErrorContaining([&] { ByteDataset::from_file((dir / "empty.txt").string()); },
                        "empty.txt is empty");
  ExpectErrorContaining([&] { ByteDataset::from_file(dir.string()); }, "is a folder, not a regular file");
  ExpectErrorContaining([&] { data.batch(1, 0, 0, 2, 26, torch::kCPU); },
                        "is shorter than seq + 1 = 27 bytes");
  testing::remove_tree(dir.string());
}

TEST(LossPlotTest, WritesOnePolylinePerCurve) {
  const auto path = std::filesystem::temp_directory_path() / ("amp8_plot_" + std::to_string(::getpid()) + ".svg");
  write_loss_svg(path.string(), {{"a", {{1, 5.0}, {2, 4.0}, {3, 3.5}}}, {"b<c", {{1, 5.2}, {2, NAN}, {3, 3.0}}}},
                 "title");
  std::ifstream in(path);
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  size_t count = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) ++count;
  EXPECT_EQ(count, 2u);
  EXPECT_NE(svg.find("b&lt;c"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  std::filesystem::remove(path);
}

// Every curve of a picture with up to ten has its own colour (a seventh curve once reused the
// first one's blue in bench/results/validation_long_corpus/val_gap.png).
TEST(LossPlotTest, TenCurvesGetTenColours) {
  const auto path = std::filesystem::temp_directory_path() / ("amp8_plot_colours_" + std::to_string(::getpid()) + ".svg");
  std::vector<LossCurve> curves;
  for (int c = 0; c < 10; ++c) curves.push_back({"run " + std::to_string(c), {{1, 5.0 - c * 0.1}, {2, 4.0 - c * 0.1}}});
  write_loss_svg(path.string(), curves, "title");
  std::ifstream in(path);
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(path);
  std::set<std::string> colours;
  const std::string key = "<polyline fill=\"none\" stroke=\"";
  for (size_t at = svg.find(key); at != std::string::npos; at = svg.find(key, at + 1)) {
    colours.insert(svg.substr(at + key.size(), 7));
  }
  EXPECT_EQ(colours.size(), 10u);
}

// The y axis names what the curves hold: the loss by default, or what the caller says (a
// difference between runs, in percent, goes below zero).
TEST(LossPlotTest, TheYAxisSaysWhatItShows) {
  const auto path = std::filesystem::temp_directory_path() / ("amp8_plot_y_" + std::to_string(::getpid()) + ".svg");
  auto read = [&] {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  LossCurve gap{"fp8", {}, {{500, -1.0}, {1000, 3.1}, {1500, 2.4}}};
  write_loss_svg(path.string(), {gap}, "title");
  EXPECT_NE(read().find(">loss</text>"), std::string::npos);
  write_loss_svg(path.string(), {gap}, "title", "FP8 - bf16 <% of bf16>");
  const std::string svg = read();
  std::filesystem::remove(path);
  EXPECT_NE(svg.find(">FP8 - bf16 &lt;% of bf16&gt;</text>"), std::string::npos);
  EXPECT_EQ(svg.find(">loss</text>"), std::string::npos);
  EXPECT_NE(svg.find(">-1<"), std::string::npos) << "a tick below zero";
}

// A run against a reference, step by step in percent: only steps both have, no division by zero.
TEST(LossPlotTest, RelativeToTakesTheStepsBothHave) {
  const LossCurve reference{"ref", {{1, 4.0}, {2, 2.0}, {3, 0.0}}, {{2, 2.5}}};
  const LossCurve run{"fp8 (final 2.1)", {{1, 5.0}, {2, 1.9}, {3, 1.0}, {4, 1.0}}, {{2, 2.6}, {4, 2.0}}};
  const auto gap = relative_to(run, reference, "fp8");
  EXPECT_EQ(gap.name, "fp8");
  ASSERT_EQ(gap.points.size(), 2u);
  EXPECT_EQ(gap.points[0], std::make_pair(1.0, 25.0));
  EXPECT_EQ(gap.points[1].first, 2.0);
  EXPECT_NEAR(gap.points[1].second, -5.0, 1e-12);
  ASSERT_EQ(gap.validation.size(), 1u);
  EXPECT_EQ(gap.validation[0].first, 2.0);
  EXPECT_NEAR(gap.validation[0].second, 4.0, 1e-12);
}

// A long noisy run with an early spike, as pretraining draws them: rounded ticks, the spike cut
// off (with a note) rather than flattening the curve, a moving average over the raw steps, and
// a legend that is not clipped by the picture's edge.
TEST(LossPlotTest, LongNoisyCurvesAreReadable) {
  const auto path = std::filesystem::temp_directory_path() / ("amp8_plot_long_" + std::to_string(::getpid()) + ".svg");
  LossCurve curve{"bf16-mixed+fp8+tensorwise (final 1.5365), a long name that must stay whole", {}};
  for (int step = 1; step <= 2000; ++step) {
    const double noise = 0.2 * std::sin(step * 1.7);
    curve.points.emplace_back(step, (step == 3 ? 9.0 : 1.5 + 2.0 / std::sqrt(step)) + noise);
  }
  write_loss_svg(path.string(), {curve}, "title");
  std::ifstream in(path);
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(path);
  // Tick labels: round numbers only (the old axis printed 1.584, 4.317, ...).
  for (const char* label : {">1.5<", ">1.6<", ">500<", ">1000<", ">2000<"}) {
    EXPECT_NE(svg.find(label), std::string::npos) << label;
  }
  for (size_t at = svg.find("text-anchor=\"end\">"); at != std::string::npos;
       at = svg.find("text-anchor=\"end\">", at + 1)) {
    const auto label = svg.substr(at + 18, svg.find('<', at) - at - 18);
    if (label.empty() || !std::isdigit(static_cast<unsigned char>(label[0]))) continue;
    const auto dot = label.find('.');
    EXPECT_TRUE(dot == std::string::npos || label.size() - dot - 1 <= 1) << "tick label " << label;
  }
  // The settled curve (1.3 .. 1.9) fills the plot: the spike and the first steps are cut off.
  EXPECT_EQ(svg.find(">9<"), std::string::npos) << "the spike does not set the range";
  EXPECT_EQ(svg.find(">3.0<"), std::string::npos) << "nor do the first steps";
  EXPECT_NE(svg.find("(the first steps, spikes) cut off"), std::string::npos);
  size_t polylines = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) ++polylines;
  EXPECT_EQ(polylines, 2u) << "every step, and the moving average";
  // The legend line starts at the plot's left edge and is below the plot, so it has the whole
  // width of the picture.
  const auto name_at = svg.find("a long name that must stay whole");
  ASSERT_NE(name_at, std::string::npos);
  const auto text_at = svg.rfind("<text x=\"", name_at);
  EXPECT_LT(std::stod(svg.substr(text_at + 9)), 120.0) << svg.substr(text_at, 80);
}

}  // namespace
}  // namespace amp8::recipes
