// recipes:gpt_pretrain end to end on the CPU, through the same entry point as the binary.
#include "recipes/gpt/cli.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "ops/fp8_gemm.h"
#include "recipes/data/gpt_dataset.h"
#include "recipes/gpt/megatron_data.h"
#include "recipes/gpt/pretrain.h"
#include "tests/gpt_pretrain_cli.h"
#include "tests/test_util.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <utility>
#include <vector>

namespace amp8::recipes {
namespace {

namespace fs = std::filesystem;
using testing::ExpectErrorContaining;

using Run = testing::CliRun;
using testing::gpt_pretrain;
using testing::metrics;

fs::path scratch(const std::string& name) { return testing::scratch_path("gpt_pretrain", name); }

std::string read(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

const std::vector<std::string> kTiny = {"--config", "tiny", "--device", "cpu", "--seq", "64",
                                        "--micro-batch", "8", "--log-every", "10"};

// The rows of a --compare's summary, one per run.
std::vector<nlohmann::json> compare_rows(const fs::path& dir) {
  std::ifstream file(dir / "compare.jsonl");
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(file, line);) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(GptPretrainTest, TrainsWritesMetricsPictureAndCheckpoint) {
  const auto dir = scratch("run");
  const auto run = gpt_pretrain(with(kTiny, {"--steps", "30", "--save-dir", dir.string()}));
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_NE(run.out.find("step 10/30 | loss "), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("tok/s"), std::string::npos);
  const auto lines = metrics(dir);
  ASSERT_EQ(lines.size(), 30u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += lines[i]["loss"].get<double>() / 5;
  for (int i = 25; i < 30; ++i) last += lines[i]["loss"].get<double>() / 5;
  EXPECT_NEAR(first, std::log(256.0), 0.5) << "starts near uniform over bytes";
  EXPECT_LT(last, first - 1.0) << "the loss falls";
  EXPECT_EQ(lines.back()["step"].get<int>(), 30);
  const auto svg = read(dir / "loss.svg");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("<polyline"), std::string::npos);
  EXPECT_TRUE(fs::exists(dir / "checkpoints" / "step_00000030.ckpt"));
}

// Four trainer fields are derived by run_pretraining (the checkpoint folder from save_dir, the
// throughput figures from the shapes and the GPU); set on the recipe they were replaced without
// a word. Now each is an error naming the field and what decides it, before anything is written.
TEST(GptPretrainTest, TrainerFieldsTheRecipeDerivesAreRefusedWhenSet) {
  const std::vector<std::pair<std::function<void(TrainerOptions&)>, std::string>> cases = {
      {[](TrainerOptions& t) { t.checkpoint_dir("elsewhere"); }, "recipe.trainer.checkpoint_dir is set by "
                                                                 "run_pretraining from save_dir"},
      {[](TrainerOptions& t) { t.tokens_per_micro_batch(4096); }, "recipe.trainer.tokens_per_micro_batch is set"},
      {[](TrainerOptions& t) { t.flops_per_token(1e9); }, "recipe.trainer.flops_per_token is set"},
      {[](TrainerOptions& t) { t.peak_flops_per_device(1e15); }, "recipe.trainer.peak_flops_per_device is set"},
  };
  for (const auto& [set, message] : cases) {
    auto recipe = gpt_pretrain_recipe("tiny");
    recipe.save_dir = scratch("derived").string();
    set(recipe.trainer);
    std::ostringstream log;
    testing::ExpectErrorContaining([&] { run_pretraining(recipe, log); }, message);
    EXPECT_FALSE(fs::exists(recipe.save_dir)) << message;
  }
}

// The Llama 3 configs go through the same recipe, flags, outputs and checkpoints: a tiny Llama
// trains on bytes, in FP8 too (every GEMM: --fp8-min-gemm-size 0), validates, compares, and
// resumes exactly; the GPT-only flag is refused by name.
TEST(GptPretrainTest, LlamaConfigsTrainThroughTheSameRecipe) {
  const std::vector<std::string> llama = {"--config", "llama_tiny", "--device", "cpu", "--seq", "64",
                                          "--micro-batch", "8", "--log-every", "0"};
  const auto dir = scratch("llama");
  const auto run = gpt_pretrain(with(llama, {"--steps", "30", "--eval-every", "15", "--eval-iters", "2",
                                             "--save-dir", dir.string(), "--compare", "32,bf16-mixed+fp8",
                                             "--fp8-min-gemm-size", "0"}));
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_NE(run.out.find("config llama_tiny ("), std::string::npos) << run.out;
  for (const auto* name : {"32", "bf16-mixed_fp8"}) {
    SCOPED_TRACE(name);
    const auto lines = metrics(dir / name);
    ASSERT_EQ(lines.size(), 30u);
    double first = 0, last = 0;
    for (int i = 0; i < 5; ++i) first += lines[i]["loss"].get<double>() / 5;
    for (int i = 25; i < 30; ++i) last += lines[i]["loss"].get<double>() / 5;
    EXPECT_NEAR(first, std::log(256.0), 0.5) << "starts near uniform over bytes";
    EXPECT_LT(last, first - 1.0) << "the loss falls";
    EXPECT_TRUE(lines[14].contains("val_loss"));
    EXPECT_TRUE(lines[29].contains("val_loss"));
  }
  EXPECT_TRUE(fs::exists(dir / "compare.svg"));

  const auto full = scratch("llama_full"), split = scratch("llama_split");
  const auto common = with(llama, {"--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-min-gemm-size", "0"});
  ASSERT_EQ(gpt_pretrain(with(common, {"--steps", "12", "--save-dir", full.string()})).code, 0);
  ASSERT_EQ(gpt_pretrain(with(common, {"--steps", "12", "--save-every", "6", "--save-dir", split.string()})).code, 0);
  fs::remove(split / "checkpoints" / "step_00000012.ckpt");  // as if stopped after step 6's save
  const auto resumed = gpt_pretrain(with(common, {"--steps", "12", "--save-dir", split.string(), "--resume",
                                                  split.string()}));
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  const auto a = metrics(full), b = metrics(split);
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;

  const auto bad = gpt_pretrain(with(llama, {"--steps", "2", "--fused-mlp", "false", "--save-dir",
                                             scratch("llama_bad").string()}));
  EXPECT_NE(bad.err.find("--fused-mlp applies to the GPT configs"), std::string::npos) << bad.err;
  const auto unknown = gpt_pretrain({"--config", "llama2_7b", "--device", "cpu"});
  EXPECT_NE(unknown.err.find("\"llama_tiny\", \"llama32_1b\""), std::string::npos) << unknown.err;
}

// --profile: steps 1..2 recorded, the trace and the table written and printed.
TEST(GptPretrainTest, ProfileRecordsTheAskedSteps) {
  const auto dir = scratch("profile");
  const auto profile = dir / "profile";
  const auto run = gpt_pretrain(with(kTiny, {"--steps", "4", "--save-dir", (dir / "run").string(), "--profile",
                                             profile.string(), "--profile-first-step", "1", "--profile-steps", "2"}));
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_NE(run.out.find("profile of steps 1..2 (0-based) in " + profile.string()), std::string::npos) << run.out;
  const auto table = nlohmann::json::parse(read(profile / "step_profile.json"));
  EXPECT_EQ(table["steps"].get<int>(), 2);
  EXPECT_GT(table["wall_ms"].get<double>(), 0.0);
  EXPECT_TRUE(table["categories"].contains("gemm"));
  const auto trace = read(profile / "trace.json");
  EXPECT_NE(trace.find("\"amp8::step 1\""), std::string::npos);
  EXPECT_NE(trace.find("\"amp8::step 2\""), std::string::npos);
  EXPECT_EQ(trace.find("\"amp8::step 3\""), std::string::npos);
  EXPECT_EQ(metrics(dir / "run").size(), 4u);
}

TEST(GptPretrainTest, ResumeContinuesExactlyWhereTheRunStopped) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> precisions = {
      {"32", {"--precision", "32"}},
      {"bf16", {"--precision", "bf16-mixed"}},
      {"bf16_fp8", {"--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-amax-history-len", "16"}},
      // Weights stored in 128×128 blocks, written from the masters the checkpoint holds.
      {"bf16_fp8_blockwise_params", {"--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-recipe", "blockwise",
                                     "--fp8-params", "true", "--fp8-min-gemm-size", "0"}},
  };
  for (const auto& [name, flags] : precisions) {
    SCOPED_TRACE(name);
    const auto full = scratch("full_" + name), split = scratch("split_" + name);
    const auto common = with(with(kTiny, flags), {"--log-every", "0", "--eval-every", "5", "--eval-iters", "2"});
    ASSERT_EQ(gpt_pretrain(with(common, {"--steps", "20", "--save-dir", full.string()})).code, 0);
    // The split run stops at 10 (its checkpoint), then continues to 20 from it.
    auto first = gpt_pretrain(with(common, {"--steps", "20", "--save-every", "10", "--save-dir",
                                            split.string()}));
    ASSERT_EQ(first.code, 0) << first.err;
    // As after a crash between the two saves: metrics of 20 steps, a checkpoint of step 10. The
    // resume cuts the metrics back to step 10, so no step is listed twice.
    fs::remove(split / "checkpoints" / "step_00000020.ckpt");
    auto resumed = gpt_pretrain(with(common, {"--steps", "20", "--save-dir", split.string(),
                                              "--resume", split.string()}));
    ASSERT_EQ(resumed.code, 0) << resumed.err;
    const auto a = metrics(full), b = metrics(split);
    ASSERT_EQ(a.size(), 20u);
    ASSERT_EQ(b.size(), 20u);
    for (size_t i = 0; i < 20; ++i) {
      EXPECT_EQ(a[i]["step"], b[i]["step"]);
      EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
      EXPECT_EQ(a[i]["lr"].get<double>(), b[i]["lr"].get<double>()) << "step " << i + 1;
      // Validation every 5 steps: the same held-out batches, so a resume does not change it.
      ASSERT_EQ(a[i].contains("val_loss"), (i + 1) % 5 == 0) << "step " << i + 1;
      if (a[i].contains("val_loss")) {
        EXPECT_EQ(a[i]["val_loss"].get<double>(), b[i]["val_loss"].get<double>()) << "step " << i + 1;
      }
    }
  }
}

// Validation on the held-out tail of the text: in the progress output, the metrics (with
// perplexity and model TFLOP/s) and the picture; the same seed gives the same values twice.
TEST(GptPretrainTest, ValidatesOnHeldOutTextDeterministically) {
  const auto a = scratch("valid_a"), b = scratch("valid_b");
  const auto args = with(kTiny, {"--steps", "20", "--eval-every", "10", "--eval-iters", "3"});
  const auto run = gpt_pretrain(with(args, {"--save-dir", a.string()}));
  ASSERT_EQ(run.code, 0) << run.err;
  ASSERT_EQ(gpt_pretrain(with(args, {"--save-dir", b.string()})).code, 0);
  EXPECT_NE(run.out.find("validation at step 10 | loss "), std::string::npos) << run.out;
  const auto first = metrics(a), second = metrics(b);
  ASSERT_EQ(first.size(), 20u);
  for (int step : {10, 20}) {
    const auto& line = first[step - 1];
    ASSERT_TRUE(line.contains("val_loss")) << step;
    EXPECT_EQ(line["val_loss"].get<double>(), second[step - 1]["val_loss"].get<double>()) << step;
    EXPECT_NEAR(line["val_ppl"].get<double>(), std::exp(line["val_loss"].get<double>()), 1e-9);
  }
  EXPECT_LT(first[19]["val_loss"].get<double>(), first[9]["val_loss"].get<double>()) << "it generalizes";
  EXPECT_FALSE(first[4].contains("val_loss"));
  EXPECT_TRUE(first[0].contains("model_tflops_per_gpu"));
  EXPECT_FALSE(first[0].contains("mfu")) << "no peak on the CPU";
  const auto svg = read(a / "loss.svg");
  EXPECT_NE(svg.find("<circle"), std::string::npos);
  EXPECT_NE(svg.find("(circles: validation)"), std::string::npos);
}

// --recompute-method reaches the model (the run says so) and changes nothing of the training:
// loss for loss the run that keeps its activations, GPT and Llama, both in FP8 (delayed scaling,
// every GEMM: the FP8 state the recomputation replays).
TEST(GptPretrainTest, RecomputeTrainsAsWithoutIt) {
  for (const auto* config : {"tiny", "llama_tiny"}) {
    SCOPED_TRACE(config);
    const std::vector<std::string> common = {"--config", config, "--device", "cpu", "--seq", "32", "--micro-batch",
                                             "4", "--steps", "6", "--log-every", "0", "--precision", "bf16-mixed",
                                             "--fp8", "hybrid", "--fp8-min-gemm-size", "0"};
    const auto kept_dir = scratch(std::string("recompute_kept_") + config);
    const auto recomputed_dir = scratch(std::string("recompute_") + config);
    const auto kept = gpt_pretrain(with(common, {"--save-dir", kept_dir.string()}));
    ASSERT_EQ(kept.code, 0) << kept.err;
    EXPECT_EQ(kept.out.find("activations recomputed"), std::string::npos);
    const auto recomputed = gpt_pretrain(with(common, {"--save-dir", recomputed_dir.string(), "--recompute-method",
                                                       "block", "--recompute-num-layers", "2"}));
    ASSERT_EQ(recomputed.code, 0) << recomputed.err;
    EXPECT_NE(recomputed.out.find(", activations recomputed (block, 2 layers)"), std::string::npos) << recomputed.out;
    const auto a = metrics(kept_dir), b = metrics(recomputed_dir);
    ASSERT_EQ(a.size(), 6u);
    ASSERT_EQ(b.size(), 6u);
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(b[i]["loss"].get<double>(), a[i]["loss"].get<double>()) << "step " << i + 1;
  }
}

// Adam's moments in bfloat16 (--exp-avg-dtype / --exp-avg-sq-dtype): said on the run line, the
// checkpoint holds them so, a resume with other dtypes is named, and the run trains as with
// float32 moments (the same first step: the moments start at zero and enter the update unrounded).
TEST(GptPretrainTest, Bfloat16MomentsTrainAndAreKeptBySetting) {
  const std::vector<std::string> common = {"--config", "tiny", "--device", "cpu", "--seq", "32", "--micro-batch",
                                           "4", "--steps", "20", "--log-every", "0", "--precision", "bf16-mixed"};
  const auto float32_dir = scratch("moments_fp32"), bf16_dir = scratch("moments_bf16");
  const auto float32 = gpt_pretrain(with(common, {"--save-dir", float32_dir.string()}));
  ASSERT_EQ(float32.code, 0) << float32.err;
  EXPECT_EQ(float32.out.find("Adam moments"), std::string::npos);
  const auto bf16 = gpt_pretrain(
      with(common, {"--save-dir", bf16_dir.string(), "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"}));
  ASSERT_EQ(bf16.code, 0) << bf16.err;
  EXPECT_NE(bf16.out.find(", Adam moments in BFloat16 / BFloat16"), std::string::npos) << bf16.out;
  const auto a = metrics(float32_dir), b = metrics(bf16_dir);
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  EXPECT_EQ(b[1]["loss"].get<double>(), a[1]["loss"].get<double>()) << "step 2 follows the same first update";
  EXPECT_NE(b[19]["loss"].get<double>(), a[19]["loss"].get<double>()) << "later moments are rounded";
  EXPECT_NEAR(b[19]["loss"].get<double>(), a[19]["loss"].get<double>(), 0.02 * a[19]["loss"].get<double>());
  const auto resumed = gpt_pretrain(with(common, {"--save-dir", bf16_dir.string(), "--steps", "22", "--resume",
                                                  bf16_dir.string()}));
  EXPECT_NE(resumed.code, 0);
  EXPECT_NE(resumed.err.find("exp_avg_dtype BFloat16 (this run: Float)"), std::string::npos) << resumed.err;
}

TEST(GptPretrainTest, HelpListsTheFlagsWithDefaults) {
  const auto run = gpt_pretrain({"--help"});
  EXPECT_EQ(run.code, 0);
  for (const char* flag : {"--precision", "--fp8", "--fp8-margin", "--fp8-amax-history-len",
                           "--fp8-amax-compute-algo", "--fp8-params", "--config", "--steps",
                           "--micro-batch", "--grad-accum", "--seq", "--lr", "--data", "--device",
                           "--save-dir", "--resume", "--seed", "--compare", "--overlap-grad-reduce",
                           "--overlap-param-gather", "--bucket-size", "--recompute-method",
                           "--recompute-num-layers", "--exp-avg-dtype", "--exp-avg-sq-dtype"}) {
    EXPECT_NE(run.out.find(flag), std::string::npos) << flag;
  }
  EXPECT_NE(run.out.find("1024"), std::string::npos) << "defaults are shown";
}

TEST(GptPretrainTest, BadInputFailsClearlyAndOverwritesNothing) {
  const auto dir = scratch("bad");
  fs::create_directories(dir);
  const auto file = dir / "a_file";
  std::ofstream(file) << "keep me";
  std::ofstream(dir / "empty.txt");
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--no-such-flag"}, "--no-such-flag"},
      {{"--steps", "many"}, "--steps"},
      {{"--precision", "bf17-mixed"}, "precision must be"},
      {{"--fp8", "e5m2"}, "fp8 must be \"none\", \"hybrid\" or \"e4m3\", got \"e5m2\""},
      {{"--precision", "32", "--fp8", "hybrid"}, "precision \"32\" takes only fp8 = \"none\""},
      {{"--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-amax-compute-algo", "mean"}, "fp8_amax_compute_algo"},
      {{"--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-margin", "-1"}, "--fp8-margin: must be in [0, 126], got -1"},
      {{"--config", "2b"}, "config must be one of"},
      {{"--data", (dir / "missing.txt").string()}, "missing.txt does not exist"},
      {{"--data", (dir / "empty.txt").string()}, "empty.txt is empty"},
      {{"--save-dir", file.string()}, "exists and is not a folder"},
      {{"--device", "tpu"}, "device must be"},
      {{"--seq", "1000"}, "seq must be in [1, 256]"},
      {{"--compare", "32,bf16-mixed+fp9"}, "unknown part \"fp9\""},
      {{"--compare", "bf16-mixed+fp8-params"}, "need +fp8"},
      {{"--profile", (dir / "p").string(), "--profile-first-step", "2"}, "profile-first-step must be in [0, steps) = [0, 2), got 2"},
      {{"--profile", (dir / "p").string(), "--profile-steps", "0"}, "--profile-steps"},
      {{"--attention-backend", "fa9"}, "--attention-backend: fa9 not in {auto,cudnn,flash,efficient}"},
      // Flags that would do nothing here: a GPU kernel's choice on the CPU; an FP8 setting
      // without FP8; an FP8 recipe on a --compare run without +fp8; two ways to resume.
      {{"--attention-backend", "cudnn"}, "--attention-backend cudnn chooses a GPU kernel; the run is on --device cpu"},
      {{"--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-gemm-autotune", "true"},
       "--fp8-gemm-autotune true times GPU kernels; the run is on --device cpu"},
      {{"--fp8-gemm-autotune", "false"}, "--fp8-gemm-autotune is an FP8 setting, but no run uses FP8"},
      {{"--precision", "bf16-mixed", "--fused-mlp", "false"}, "--fused-mlp is an FP8 setting, but no run uses FP8"},
      {{"--compare", "32,bf16-mixed+tensorwise"}, "--compare: \"bf16-mixed+tensorwise\": +tensorwise (an FP8 recipe) needs +fp8"},
      {{"--resume", (dir / "out").string(), "--resume-if-exists", "true"}, "--resume and --resume-if-exists cannot be combined"},
      {{"--cuda-graph", "true"}, "--cuda-graph needs a CUDA GPU; the run is on --device cpu"},
      {{"--cuda-graph", "maybe"}, "--cuda-graph"},
      {{"--recompute-method", "full"}, "--recompute-method must be none, uniform or block, got \"full\""},
      {{"--recompute-num-layers", "2"}, "--recompute-num-layers needs --recompute-method uniform or block"},
      {{"--recompute-method", "block", "--recompute-num-layers", "3"},
       "--recompute-num-layers must be at most the config's 2 blocks (tiny), got 3"},
      {{"--recompute-method", "uniform", "--cuda-graph", "true"}, "--recompute-method and --cuda-graph cannot be combined"},
      {{"--exp-avg-dtype", "fp16"}, "--exp-avg-dtype: fp16 not in {fp32,bf16}"},
      {{"--exp-avg-sq-dtype", "fp8"}, "--exp-avg-sq-dtype: fp8 not in {fp32,bf16}"},
      // Flags that would be dropped: each --compare run names its precision and FP8; a margin
      // under block scaling; profiling settings without --profile; a split of byte-level data.
      {{"--compare", "32", "--fp8", "hybrid"}, "--fp8 and --compare cannot be combined"},
      {{"--compare", "32", "--precision", "bf16-mixed"}, "--precision and --compare cannot be combined"},
      {{"--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-recipe", "blockwise", "--fp8-margin", "2"},
       "--fp8-margin applies to fp8 recipes \"delayed\" and \"tensorwise\" (this run: \"blockwise\""},
      {{"--compare", "bf16-mixed+fp8+blockwise", "--fp8-margin", "1"}, "--fp8-margin applies to fp8 recipes"},
      {{"--profile-first-step", "0"}, "--profile-first-step applies with --profile DIR only"},
      {{"--profile-steps", "2"}, "--profile-steps applies with --profile DIR only"},
      {{"--split", "100,0,0"}, "--split applies to --data-prefix only"},
      {{"--eval-every", "0", "--eval-iters", "3"}, "--eval-iters applies when the run validates (--eval-every > 0)"},
      {{"--allow-changes", "steps"}, "--allow-changes applies to a resumed run"},
  };
  for (const auto& c : cases) {
    auto args = with({"--config", "tiny", "--steps", "2", "--save-dir", (dir / "out").string()}, c.args);
    if (std::find(c.args.begin(), c.args.end(), "--device") == c.args.end()) {
      args = with(args, {"--device", "cpu"});
    }
    const auto run = gpt_pretrain(args);
    EXPECT_NE(run.code, 0) << c.message;
    EXPECT_NE((run.err + run.out).find(c.message), std::string::npos)
        << "expected \"" << c.message << "\" in: " << run.err << run.out;
  }
  EXPECT_EQ(read(file), "keep me");
  EXPECT_FALSE(fs::exists(dir / "out")) << "a rejected run writes nothing";
}

// --fp8-recipe tensorwise: Megatron-Bridge's current-scaling preset (first and last layer in
// bf16); a checkpoint of one recipe does not resume under another.
TEST(GptPretrainTest, Fp8RecipeTensorwiseTrainsAndIsRecordedInTheCheckpoint) {
  const auto dir = scratch("tensorwise");
  const auto common = with(kTiny, {"--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-min-gemm-size", "0",
                                   "--log-every", "0", "--save-dir", dir.string()});
  // tiny has two layers: with the preset's 1 + 1 in bf16 nothing would be FP8.
  const auto run = gpt_pretrain(with(common, {"--steps", "30", "--fp8-recipe", "tensorwise",
                                              "--num-layers-at-start-in-bf16", "0", "--num-layers-at-end-in-bf16", "0"}));
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_NE(run.out.find("precision bf16-mixed fp8=hybrid recipe=tensorwise fp8_params"), std::string::npos) << run.out;
  const auto lines = metrics(dir);
  ASSERT_EQ(lines.size(), 30u);
  EXPECT_LT(lines.back()["loss"].get<double>(), lines.front()["loss"].get<double>() - 1.0) << "it learns";
  const auto other = gpt_pretrain(with(common, {"--steps", "30", "--resume", dir.string()}));
  EXPECT_NE(other.code, 0);
  EXPECT_NE(other.err.find("written with precision \"bf16-mixed fp8=hybrid recipe=tensorwise fp8_params\", this "
                           "plugin is \"bf16-mixed fp8=hybrid fp8_params\""), std::string::npos) << other.err;
  const auto history = gpt_pretrain(with(kTiny, {"--fp8", "hybrid", "--precision", "bf16-mixed", "--fp8-recipe",
                                                 "tensorwise", "--fp8-amax-history-len", "16", "--save-dir",
                                                 scratch("history").string()}));
  EXPECT_NE(history.err.find("--fp8-amax-history-len applies to fp8 recipe \"delayed\" only"), std::string::npos)
      << history.err;
  const auto mxfp8 = gpt_pretrain(with(kTiny, {"--fp8", "hybrid", "--precision", "bf16-mixed", "--fp8-recipe", "mxfp8",
                                               "--save-dir", scratch("mxfp8").string()}));
  EXPECT_NE(mxfp8.err.find("NVIDIA Blackwell"), std::string::npos) << mxfp8.err;
}

// --fp8-params-scaling delayed: FP8 weights written at the last step's scale (in the fused Adam
// pass on a GPU). It learns; the checkpoint records it, so a resume under the other scaling,
// which writes other bytes from the same masters, is refused by name; --compare reports it per
// run (none where a run keeps no FP8 weights); without FP8 weights it is an error.
TEST(GptPretrainTest, Fp8ParamsScalingDelayedTrainsAndIsASettingOfTheCheckpoint) {
  const auto dir = scratch("fp8_params_scaling");
  const auto every_layer = with(kTiny, {"--fp8-min-gemm-size", "0", "--num-layers-at-start-in-bf16", "0",
                                        "--num-layers-at-end-in-bf16", "0", "--log-every", "0"});
  const auto common = with(every_layer, {"--precision", "bf16-mixed", "--fp8", "hybrid"});
  const auto run = gpt_pretrain(with(common, {"--steps", "30", "--fp8-params-scaling", "delayed", "--save-dir",
                                              dir.string()}));
  ASSERT_EQ(run.code, 0) << run.err;
  const auto lines = metrics(dir);
  ASSERT_EQ(lines.size(), 30u);
  EXPECT_LT(lines.back()["loss"].get<double>(), lines.front()["loss"].get<double>() - 1.0) << "it learns";
  const auto longer = with(common, {"--steps", "32", "--allow-changes", "steps", "--resume", dir.string(), "--save-dir",
                                    dir.string()});
  const auto other = gpt_pretrain(longer);
  EXPECT_NE(other.code, 0);
  EXPECT_NE(other.err.find("fp8_params_scaling delayed (this run: current)"), std::string::npos) << other.err;
  const auto same = gpt_pretrain(with(longer, {"--fp8-params-scaling", "delayed"}));
  EXPECT_EQ(same.code, 0) << same.err;

  const auto compared = scratch("fp8_params_scaling_compare");
  // --fp8-params false: the first run's +fp8-params gives it FP8 weights, and the flag reaches it.
  const auto both = gpt_pretrain(with(every_layer, {"--steps", "2", "--fp8-params", "false", "--fp8-params-scaling",
                                                    "delayed", "--save-dir", compared.string(), "--compare",
                                                    "bf16-mixed+fp8+fp8-params,bf16-mixed+fp8"}));
  ASSERT_EQ(both.code, 0) << both.err;
  const auto rows = compare_rows(compared);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0]["fp8_params_scaling"], "delayed");
  EXPECT_TRUE(rows[1]["fp8_params_scaling"].is_null()) << rows[1].dump();

  const auto without = gpt_pretrain(with(common, {"--fp8-params", "false", "--fp8-params-scaling", "delayed",
                                                  "--save-dir", scratch("fp8_params_scaling_bf16").string()}));
  EXPECT_NE(without.code, 0);
  EXPECT_NE(without.err.find("--fp8-params-scaling applies with --fp8-params true"), std::string::npos) << without.err;
  const auto none_compared = gpt_pretrain(with(every_layer, {"--fp8-params-scaling", "delayed", "--save-dir",
                                                             scratch("fp8_params_scaling_none").string(), "--compare",
                                                             "bf16-mixed,bf16-mixed+fp8+bf16-params"}));
  EXPECT_NE(none_compared.code, 0);
  EXPECT_NE(none_compared.err.find("--fp8-params-scaling applies with FP8 weights (--fp8-params true or a run's "
                                   "+fp8-params) and an FP8 recipe with one scale per weight (delayed or "
                                   "tensorwise); no --compare run has them"),
            std::string::npos)
      << none_compared.err;
}

// --fp8-recipe blockwise: Megatron-Bridge's subchannel preset (weights in high precision, every
// layer in FP8); it learns, the checkpoint names it, and --fp8-params true is refused by name.
TEST(GptPretrainTest, Fp8RecipeBlockwiseTrainsAndIsRecordedInTheCheckpoint) {
  const auto dir = scratch("blockwise");
  const auto common = with(kTiny, {"--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-min-gemm-size", "0",
                                   "--log-every", "0", "--save-dir", dir.string(), "--steps", "30",
                                   "--fp8-recipe", "blockwise"});
  const auto run = gpt_pretrain(common);
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_NE(run.out.find("precision bf16-mixed fp8=hybrid recipe=blockwise, device"), std::string::npos) << run.out;
  const auto lines = metrics(dir);
  ASSERT_EQ(lines.size(), 30u);
  EXPECT_LT(lines.back()["loss"].get<double>(), lines.front()["loss"].get<double>() - 1.0) << "it learns";
  // Weights kept only in FP8, in 128×128 blocks: it learns as well.
  const auto params_dir = scratch("blockwise_fp8_params");
  const auto fp8_params = gpt_pretrain(with(common, {"--fp8-params", "true", "--save-dir", params_dir.string()}));
  ASSERT_EQ(fp8_params.code, 0) << fp8_params.err;
  const auto params_lines = metrics(params_dir);
  ASSERT_EQ(params_lines.size(), 30u);
  EXPECT_LT(params_lines.back()["loss"].get<double>(), params_lines.front()["loss"].get<double>() - 1.0);
  EXPECT_NEAR(params_lines.back()["loss"].get<double>(), lines.back()["loss"].get<double>(),
              0.05 * lines.back()["loss"].get<double>())
      << "within 5% of the run whose weights are in bf16";
}

// Micro-batches `indices` (of 4 samples) of `data` are samples [4 i, 4 i + 4) of `reference`
// (a GptDataset or BlendedGptDataset), tokens and labels.
template <typename Reference>
void expect_batches_are_samples_in_order(const MegatronData& data, const Reference& reference,
                                         std::initializer_list<int64_t> indices) {
  for (int64_t index : indices) {
    const auto [tokens, labels] = data.batch(index, 4, torch::kCPU);
    for (int64_t row = 0; row < 4; ++row) {
      const auto [t, l] = reference.tokens_and_labels(index * 4 + row);
      EXPECT_TRUE(tokens[row].equal(t)) << "micro-batch " << index << " row " << row;
      EXPECT_TRUE(labels[row].equal(l)) << "micro-batch " << index << " row " << row;
    }
  }
}

// Megatron-Core indexed data: micro-batch i is Megatron's samples [i * B, (i + 1) * B) of the
// train split, and gpt_pretrain trains on it with the padded vocabulary.
TEST(GptPretrainTest, TrainsOnMegatronIndexedData) {
  const std::string prefix = "tests/data/megatron_indexed/gpt_uint16";
  const MegatronData data(prefix, "80,20", 16, 1234, 24, 65536);
  const GptDataset reference(std::make_shared<IndexedDataset>(prefix), DatasetSplit::kTrain, 24,
                             GptDatasetOptions(16).random_seed(1234).split("80,20"));
  expect_batches_are_samples_in_order(data, reference, {0, 1, 5});
  ExpectErrorContaining([&] { MegatronData(prefix, "80,20", 16, 1234, 24, 1000).batch(0, 4, torch::kCPU); },
                        "is not below the model's vocabulary size 1000");

  const auto dir = scratch("megatron");
  const auto run = gpt_pretrain({"--config", "tiny", "--device", "cpu", "--data-prefix", prefix, "--vocab-size", "65500",
                                 "--split", "80,20", "--seq", "16", "--micro-batch", "4", "--grad-accum", "2",
                                 "--steps", "3", "--log-every", "0", "--eval-every", "2", "--eval-iters", "1",
                                 "--save-dir", dir.string()});
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_NE(run.out.find("data megatron " + prefix + " (split 80,20"), std::string::npos) << run.out;
  const auto lines = metrics(dir);
  ASSERT_EQ(lines.size(), 3u);
  // 65500 padded to 65536 (a multiple of 128; the fixture's ids reach 65535): the first loss
  // is near ln(65536).
  EXPECT_NEAR(lines[0]["loss"].get<double>(), std::log(65536.0), 0.5);
  // Validation on the split's validation part, after step 2 and the last one.
  EXPECT_FALSE(lines[0].contains("val_loss"));
  EXPECT_TRUE(lines[1].contains("val_loss"));
  EXPECT_TRUE(lines[2].contains("val_loss"));
  EXPECT_NE(run.out.find("validation at step 3 | loss "), std::string::npos) << run.out;
  const auto bad = gpt_pretrain({"--config", "tiny", "--device", "cpu", "--data-prefix", prefix, "--steps", "2",
                                 "--save-dir", scratch("no_vocab").string()});
  EXPECT_NE(bad.err.find("data-prefix needs the tokenizer's vocabulary size: --vocab-size"), std::string::npos) << bad.err;
}

// A .bin whose .idx names a signed dtype can hold negative token ids: named with the data, not
// left to fail inside the embedding (on a GPU, a device-side assert that names nothing).
TEST(GptPretrainTest, NegativeTokenIdsAreNamed) {
  const std::string source = "tests/data/megatron_indexed/gpt_uint16";
  const auto dir = scratch("negative_ids");
  std::filesystem::create_directories(dir);
  const auto prefix = (dir / "as_int16").string();
  std::filesystem::copy_file(source + ".bin", prefix + ".bin", std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(source + ".idx", prefix + ".idx", std::filesystem::copy_options::overwrite_existing);
  const auto [tokens, labels] = MegatronData(source, "80,20", 16, 1234, 24, 65536).batch(0, 4, torch::kCPU);
  ASSERT_GT(tokens.max().item<int64_t>(), 32767) << "the first micro-batch must hold an id that int16 makes negative";
  {
    std::fstream idx(prefix + ".idx", std::ios::in | std::ios::out | std::ios::binary);
    idx.seekp(17);
    idx.put(3);  // Megatron's DType code of int16: the same bytes, read signed
  }
  ExpectErrorContaining([&] { MegatronData(prefix, "80,20", 16, 1234, 24, 65536).batch(0, 4, torch::kCPU); },
                        "in micro-batch 0 is negative");
}

// With --data-prefix, step s reads the samples from s x the global batch on, in the order each
// prefix's epoch count gives: a resume that would change either (and so read some samples twice
// and skip others) is refused by name, even where the settings it comes from are allowed.
TEST(GptPretrainTest, AMegatronResumeKeepsTheGlobalBatchAndTheSampleOrder) {
  const std::string prefix = "tests/data/megatron_indexed/gpt_uint16";
  const int64_t epoch = GptDataset(std::make_shared<IndexedDataset>(prefix), DatasetSplit::kTrain, std::nullopt,
                                   GptDatasetOptions(16).random_seed(1234).split("80,20"))
                            .size();
  const auto dir = scratch("megatron_resume");
  const auto run = [&](const std::vector<std::string>& more) {
    std::vector<std::string> args = {"--config", "tiny", "--device", "cpu", "--data-prefix", prefix,
                                     "--vocab-size", "65500", "--split", "80,20", "--seq", "16",
                                     "--log-every", "0", "--eval-every", "0", "--save-dir", dir.string()};
    args.insert(args.end(), more.begin(), more.end());
    return gpt_pretrain(args);
  };
  ASSERT_EQ(run({"--micro-batch", "4", "--grad-accum", "2", "--steps", "2"}).code, 0);
  const std::vector<std::string> resume = {"--resume", dir.string(), "--allow-changes", "micro_batch,grad_accum,steps"};
  auto with_resume = [&](std::vector<std::string> args) {
    args.insert(args.end(), resume.begin(), resume.end());
    return args;
  };
  const auto halved = run(with_resume({"--micro-batch", "2", "--grad-accum", "2", "--steps", "3"}));
  EXPECT_NE(halved.code, 0);
  EXPECT_NE(halved.err.find("global_batch 8 (this run: 4)"), std::string::npos) << halved.err;
  // Past one epoch the order of the samples is another one.
  const std::string past_epoch = std::to_string(epoch / 8 + 2);
  const auto longer = run(with_resume({"--micro-batch", "2", "--grad-accum", "4", "--steps", past_epoch}));
  EXPECT_NE(longer.code, 0);
  EXPECT_NE(longer.err.find("data_order epochs 1 (this run: epochs 2"), std::string::npos) << longer.err;
  // The same global batch from other factors, and more steps within the epoch: it goes on.
  const auto same = run(with_resume({"--micro-batch", "2", "--grad-accum", "4", "--steps", "3"}));
  EXPECT_EQ(same.code, 0) << same.err;
  EXPECT_EQ(metrics(dir).size(), 3u);
}

// Megatron's unweighted blend ("a b") is one epoch of each prefix blended by size: the train
// micro-batches are its samples in order, and a run that would draw more is refused up front.
TEST(GptPretrainTest, AnUnweightedBlendServesOneEpochOfEachPrefix) {
  const std::string a = "tests/data/megatron_indexed/gpt_uint16", b = "tests/data/megatron_indexed/gpt_int32";
  const auto options = GptDatasetOptions(16).random_seed(99).split("80,20");
  const BlendedGptDataset reference({{std::nullopt, a}, {std::nullopt, b}}, DatasetSplit::kTrain, 40, options);
  const MegatronData data(a + " " + b, "80,20", 16, 99, 40, 262144);
  expect_batches_are_samples_in_order(data, reference, {0, 3, 9});
  // One epoch of both train splits holds 145 + 66 samples (the fixture's unweighted blend).
  EXPECT_NO_THROW(MegatronData(a + " " + b, "80,20", 16, 99, 211, 262144));
  ExpectErrorContaining([&] { MegatronData(a + " " + b, "80,20", 16, 99, 212, 262144); },
                        "the unweighted blend holds 211 train samples (one epoch of each prefix), fewer than the "
                        "212 the run draws");
}

TEST(GptPretrainTest, CompareDrawsEveryPrecisionInOnePicture) {
  const auto dir = scratch("compare");
  const auto run = gpt_pretrain(with(kTiny, {"--steps", "6", "--log-every", "0", "--save-dir",
                                             dir.string(), "--compare", "32,bf16-mixed+fp8"}));
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_EQ(metrics(dir / "32").size(), 6u);
  EXPECT_EQ(metrics(dir / "bf16-mixed_fp8").size(), 6u);
  const auto svg = read(dir / "compare.svg");
  size_t count = 0, dashed = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) {
    (svg.substr(at, svg.find('>', at) - at).find("stroke-dasharray") == std::string::npos ? count : dashed) += 1;
  }
  EXPECT_EQ(count, 2u) << "one training curve per run";
  EXPECT_EQ(dashed, 2u) << "one validation line per run (the final evaluation)";
  EXPECT_NE(svg.find("bf16-mixed+fp8 (final"), std::string::npos);
  // The second run against the first, in percent: one training line, one validation point.
  const auto gap = read(dir / "compare_gap.svg");
  EXPECT_NE(gap.find("loss against 32 (same seed and data)"), std::string::npos);
  EXPECT_NE(gap.find(">loss - 32's, % of it</text>"), std::string::npos);
  count = dashed = 0;
  for (size_t at = gap.find("<polyline"); at != std::string::npos; at = gap.find("<polyline", at + 1)) {
    (gap.substr(at, gap.find('>', at) - at).find("stroke-dasharray") == std::string::npos ? count : dashed) += 1;
  }
  EXPECT_EQ(count, 1u);
  EXPECT_EQ(dashed, 1u);
  EXPECT_NE(run.out.find("difference picture"), std::string::npos);
}

// --compare --resume-if-exists on runs that already reached --steps: nothing trains, and the
// comparison written by the runs stays (it was once rewritten with NaN losses).
TEST(GptPretrainTest, CompareOfFinishedRunsKeepsTheirComparison) {
  const auto dir = scratch("compare_finished");
  const auto args = with(kTiny, {"--steps", "2", "--log-every", "0", "--save-dir", dir.string(), "--compare",
                                 "32,bf16-mixed", "--resume-if-exists", "true"});
  ASSERT_EQ(gpt_pretrain(args).code, 0);
  const auto read = [&] {
    std::ifstream file(dir / "compare.jsonl");
    return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  };
  const auto written = read();
  ASSERT_NE(written.find("\"final_loss\":"), std::string::npos) << written;
  const auto again = gpt_pretrain(args);
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("32: nothing to do: its checkpoint is at step 2"), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("nothing to do: every run's checkpoint is at or past --steps 2"), std::string::npos);
  EXPECT_EQ(read(), written);
}

// A --compare --resume-if-exists in which some runs are finished and others train: the finished
// ones keep their rows and curves (they were once left out of compare.jsonl and the pictures).
TEST(GptPretrainTest, CompareWithSomeRunsFinishedKeepsThem) {
  const auto dir = scratch("compare_partly_finished");
  const auto args = [&](const std::string& runs) {
    return with(kTiny, {"--steps", "3", "--log-every", "0", "--save-dir", dir.string(), "--compare", runs,
                        "--resume-if-exists", "true"});
  };
  const auto rows = [&] { return compare_rows(dir); };
  ASSERT_EQ(gpt_pretrain(args("32")).code, 0);
  const auto first = rows();
  ASSERT_EQ(first.size(), 1u);
  const auto more = gpt_pretrain(args("32,bf16-mixed"));
  ASSERT_EQ(more.code, 0) << more.err;
  EXPECT_NE(more.out.find("32: nothing to do"), std::string::npos) << more.out;
  const auto both = rows();
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both[0]["run"], "32");
  EXPECT_EQ(both[0]["final_loss"], first[0]["final_loss"]);
  EXPECT_EQ(both[0]["tokens_per_s"], first[0]["tokens_per_s"]) << "the row of the call that trained it";
  EXPECT_EQ(both[1]["run"], "bf16-mixed");
  EXPECT_EQ(both[1]["steps"], 3);
  EXPECT_TRUE(both[1]["final_loss_rel_diff_vs_32"].is_number());
  const auto svg = read(dir / "compare.svg");
  EXPECT_NE(svg.find(">32 (final"), std::string::npos) << "the finished run's curve";
  EXPECT_NE(svg.find(">bf16-mixed (final"), std::string::npos);
  // The difference picture has the second run's line against the finished run's points.
  const auto gap = read(dir / "compare_gap.svg");
  EXPECT_NE(gap.find("loss against 32"), std::string::npos);
  EXPECT_NE(gap.find("<polyline"), std::string::npos) << gap;

  // A finished run whose row is gone (a call stopped after its last step wrote an error row, or
  // died before writing compare.jsonl) gets one from its metrics.
  std::filesystem::remove(dir / "compare.jsonl");
  const auto again = gpt_pretrain(args("32,bf16-mixed,bf16-mixed+fp8"));
  ASSERT_EQ(again.code, 0) << again.err;
  const auto rebuilt = rows();
  ASSERT_EQ(rebuilt.size(), 3u);
  EXPECT_EQ(rebuilt[0]["run"], "32");
  EXPECT_EQ(rebuilt[0]["steps"], 3);
  const auto losses = metrics(dir / "32");
  ASSERT_EQ(losses.size(), 3u);
  EXPECT_DOUBLE_EQ(rebuilt[0]["final_loss"].get<double>(),
                   (losses[0]["loss"].get<double>() + losses[1]["loss"].get<double>() + losses[2]["loss"].get<double>()) / 3);
  EXPECT_NE(rebuilt[0]["note"].get<std::string>().find("from its metrics.jsonl"), std::string::npos);
  EXPECT_EQ(rebuilt[1]["final_loss"], both[1]["final_loss"]) << "bf16-mixed: finished too, from its metrics";
  EXPECT_TRUE(rebuilt[2]["final_loss_rel_diff_vs_32"].is_number());

  // Every run finished and the file gone: nothing trains, and the rows come back from the metrics.
  std::filesystem::remove(dir / "compare.jsonl");
  const auto all_finished = gpt_pretrain(args("32,bf16-mixed,bf16-mixed+fp8"));
  ASSERT_EQ(all_finished.code, 0) << all_finished.err;
  const auto from_metrics = rows();
  ASSERT_EQ(from_metrics.size(), 3u);
  for (const auto& row : from_metrics) EXPECT_TRUE(row.contains("note")) << row;
  EXPECT_EQ(from_metrics[2]["final_loss"], rebuilt[2]["final_loss"]);
}

// --lr keeps the config's decay ratio: the cosine ends at a tenth of it (an --lr below the
// config's min_lr once gave a flat schedule).
TEST(GptPretrainTest, LrScalesTheWholeSchedule) {
  const auto dir = scratch("lr");
  ASSERT_EQ(gpt_pretrain(with(kTiny, {"--steps", "40", "--log-every", "0", "--lr", "1e-4", "--save-dir",
                                      dir.string()})).code, 0);
  const auto lines = metrics(dir);
  ASSERT_EQ(lines.size(), 40u);
  EXPECT_DOUBLE_EQ(lines[20]["lr"].get<double>(), 1e-4) << "the peak, after 20 warm-up steps";
  const double end = 1e-5 + 0.5 * 9e-5 * (1.0 + std::cos(M_PI * 19.0 / 20.0));
  EXPECT_NEAR(lines[39]["lr"].get<double>(), end, 1e-12);
}

TEST(GptPretrainTest, CompareSetsFp8ParamsPerRunAndSummarisesEveryRun) {
  const auto dir = scratch("compare_summary");
  const auto run = gpt_pretrain(with(kTiny, {"--steps", "4", "--log-every", "0", "--save-dir", dir.string(),
                                             "--compare", "32,bf16-mixed+fp8+bf16-params,bf16-mixed+fp8=e4m3+fp8-params"}));
  ASSERT_EQ(run.code, 0) << run.err;
  const auto rows = compare_rows(dir);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0]["run"], "32");
  EXPECT_EQ(rows[0]["fp8"], "none");
  EXPECT_EQ(rows[0]["fp8_params"], false);
  EXPECT_EQ(rows[0]["final_loss_rel_diff_vs_32"], 0.0);
  EXPECT_EQ(rows[1]["fp8"], "hybrid");
  EXPECT_EQ(rows[1]["fp8_params"], false);
  EXPECT_EQ(rows[2]["fp8"], "e4m3");
  EXPECT_EQ(rows[2]["fp8_params"], true);
  for (const auto& row : rows) {
    EXPECT_EQ(row["steps"], 4);
    const double loss = row["final_loss"].get<double>();
    EXPECT_TRUE(std::isfinite(loss) && loss > 0) << row.dump();
    EXPECT_NEAR(row["final_loss_rel_diff_vs_32"].get<double>(),
                (loss - rows[0]["final_loss"].get<double>()) / rows[0]["final_loss"].get<double>(), 1e-12);
    const double val = row["final_val_loss"].get<double>(), val_32 = rows[0]["final_val_loss"].get<double>();
    EXPECT_NEAR(row["final_val_loss_rel_diff_vs_32"].get<double>(), (val - val_32) / val_32, 1e-12);
    EXPECT_GT(row["tokens_per_s"].get<double>(), 0);
  }
  EXPECT_TRUE(fs::is_regular_file(dir / "bf16-mixed_fp8_e4m3_fp8-params" / "metrics.jsonl"));
}

// gpt_pretrain as rank 0 of a torchrun launch of two (its environment set for the call only).
Run as_rank_0_of_2(const std::vector<std::string>& args) {
  ::setenv("WORLD_SIZE", "2", 1), ::setenv("RANK", "0", 1), ::setenv("LOCAL_RANK", "0", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1), ::setenv("MASTER_PORT", "29511", 1);
  const auto run = gpt_pretrain(args);
  for (const char* name : {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(name);
  return run;
}

TEST(GptPretrainTest, ATorchrunLaunchOnTheCpuIsAClearError) {
  const auto dir = scratch("torchrun_cpu");
  const auto run = as_rank_0_of_2(with(kTiny, {"--steps", "2", "--device", "cpu", "--save-dir", dir.string()}));
  EXPECT_NE(run.code, 0);
  EXPECT_NE(run.err.find("a torchrun launch (WORLD_SIZE 2) trains data-parallel over NCCL, each rank on "
                          "cuda:LOCAL_RANK, and needs --device auto or cuda, got \"cpu\""),
            std::string::npos)
      << run.err;
  EXPECT_FALSE(fs::exists(dir)) << "a rejected run writes nothing";
}

// Each rank trains on cuda:LOCAL_RANK: a device with an index is refused (it was replaced), before
// the device is looked for (so the CPU machine sees this error, not "no CUDA GPU").
TEST(GptPretrainTest, ATorchrunLaunchWithADeviceIndexIsAClearError) {
  const auto dir = scratch("torchrun_device_index");
  const auto run = as_rank_0_of_2(with(kTiny, {"--steps", "2", "--device", "cuda:1", "--save-dir", dir.string()}));
  EXPECT_NE(run.code, 0);
  EXPECT_NE(run.err.find("each rank on cuda:LOCAL_RANK, and needs --device auto or cuda, got \"cuda:1\""),
            std::string::npos)
      << run.err;
  EXPECT_FALSE(fs::exists(dir)) << "a rejected run writes nothing";
}

// --fp8-recipe names the recipe of the --compare runs with +fp8; the runs without FP8 train as
// they would alone (the whole command was once refused: their precision was given the recipe).
TEST(GptPretrainTest, CompareTakesTheFp8RecipeForItsFp8RunsOnly) {
  const auto dir = scratch("compare_fp8_recipe");
  const auto run = gpt_pretrain(with(kTiny, {"--steps", "2", "--log-every", "0", "--fp8-min-gemm-size", "0",
                                             "--save-dir", dir.string(), "--fp8-recipe", "tensorwise", "--num-layers-at-start-in-bf16", "0",
                                             "--num-layers-at-end-in-bf16", "0",
                                             "--compare", "32,bf16-mixed+fp8"}));
  ASSERT_EQ(run.code, 0) << run.err;
  const auto rows = compare_rows(dir);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0]["run"], "32");
  EXPECT_EQ(rows[1]["run"], "bf16-mixed+fp8");
  EXPECT_EQ(rows[1]["fp8_recipe"], "tensorwise");
}

TEST(GptPretrainTest, TrainsOnTheGpuInEveryPrecision_CUDA) {
  AMP8_REQUIRE_CUDA();
  const std::vector<std::vector<std::string>> precisions = {
      {"--precision", "32"},
      {"--precision", "bf16-mixed"},
      {"--precision", "16-mixed"},
      {"--precision", "bf16-mixed", "--fp8", "hybrid"},
      {"--precision", "16-mixed", "--fp8", "e4m3", "--fp8-params", "false"},
  };
  int index = 0;
  for (const auto& flags : precisions) {
    const auto dir = scratch("gpu_" + std::to_string(index++));
    auto args = with({"--config", "tiny", "--device", "cuda", "--steps", "60", "--log-every", "0",
                      "--save-dir", dir.string()}, flags);
    const auto run = gpt_pretrain(args);
    ASSERT_EQ(run.code, 0) << run.err;
    const auto lines = metrics(dir);
    ASSERT_EQ(lines.size(), 60u);
    EXPECT_LT(lines.back()["loss"].get<double>(), lines.front()["loss"].get<double>() - 1.0)
        << run.out;
    EXPECT_NE(run.out.find(" GB between steps: weights, gradients, optimizer state"), std::string::npos) << run.out;
  }
}

// The measured choice of the FP8 GEMMs' algorithms is gpt_pretrain's default (it won 1.5–2% of
// the 1b and 8B-proxy FP8 steps on an H100: bench/results/gemm_autotune/); `false` keeps the
// heuristic's first. The `false` run comes first, so that the default run's shapes were chosen
// another way before it and must be timed again.
TEST(GptPretrainTest, TheFp8GemmsAlgorithmsAreMeasuredUnlessTurnedOff_CUDA) {
  AMP8_REQUIRE_CUDA();
  const std::vector<std::string> fp8 = {"--config", "tiny", "--device", "cuda", "--steps", "2", "--log-every", "0",
                                        "--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-min-gemm-size", "0"};
  const auto before = fp8_gemm_candidates_timed();
  const auto off = gpt_pretrain(with(fp8, {"--fp8-gemm-autotune", "false", "--save-dir", scratch("autotune_off").string()}));
  ASSERT_EQ(off.code, 0) << off.err;
  EXPECT_EQ(fp8_gemm_candidates_timed(), before) << "--fp8-gemm-autotune false timed candidates";
  const auto by_default = gpt_pretrain(with(fp8, {"--save-dir", scratch("autotune_default").string()}));
  ASSERT_EQ(by_default.code, 0) << by_default.err;
  EXPECT_GT(fp8_gemm_candidates_timed(), before) << "the default run kept the heuristic's algorithms";
  EXPECT_EQ(fp8_gemm_algo_selection(), Fp8GemmAlgoSelection::kHeuristic) << "the run left its choice behind";
}

}  // namespace
}  // namespace amp8::recipes
