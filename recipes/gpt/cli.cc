#include "recipes/gpt/cli.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <new>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>
#include <sstream>
#include <variant>

#include "plugin/distributed/process_group.h"
#include "plugin/modules/recompute.h"
#include "plugin/training/trainer.h"
#include "recipes/gpt/loss_plot.h"
#include "recipes/gpt/pretrain.h"

namespace amp8::recipes {
namespace {

namespace fs = std::filesystem;

// LibTorch reports a failed CUDA allocation as c10::OutOfMemoryError but a failed CPU one as a
// plain c10::Error from DefaultCPUAllocator (c10/core/impl/alloc_cpu.cpp); both mean the same to
// the user of a --device cpu or --device cuda run.
bool is_cpu_allocation_failure(const c10::Error& error) {
  return error.msg().find("DefaultCPUAllocator: can't allocate memory") != std::string::npos;
}

std::string out_of_memory_advice(const std::string& batch_shape, const std::string& recompute_method,
                                 bool float32_moments) {
  return "out of memory with micro-batches of " + batch_shape +
         " tokens; lower --micro-batch (and raise --grad-accum for the same batch)" +
         (recompute_method == "none" ? ", or keep fewer activations with --recompute-method uniform"
                                     : " (activations are recomputed already)") +
         (float32_moments ? ", or halve Adam's state with --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: " : ": ");
}

// ", peak memory X GB (Y GB between steps ...)" on a GPU; "" on the CPU (no allocator statistics).
std::string memory_summary(const PretrainResult& result) {
  if (result.peak_memory_bytes <= 0) return "";
  return c10::str(", peak memory ", result.peak_memory_bytes / 1e9, " GB (", result.resident_memory_bytes / 1e9,
                  " GB between steps: weights, gradients, optimizer state; the rest activations and workspace)");
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> items;
  std::stringstream stream(list);
  for (std::string item; std::getline(stream, item, ',');) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

// Flag values, checked by CLI11 before anything runs; the errors come out as "--flag: ...".

// A whole number in [min, max] written as digits (a minus sign for negatives): "1e23", "0x10",
// "1.5", "" and values out of range are errors instead of being clamped, wrapped or truncated.
CLI::Validator whole_number(int64_t min, int64_t max) {
  return CLI::Validator(
      [min, max](std::string& value) -> std::string {
        int64_t number = 0;
        const char* end = value.data() + value.size();
        const auto [stop, error] = std::from_chars(value.data(), end, number);
        if (value.empty() || error == std::errc::invalid_argument || stop != end) {
          return "expected a whole number in [" + std::to_string(min) + ", " + std::to_string(max) +
                 "], got \"" + value + "\"";
        }
        if (error == std::errc::result_out_of_range || number < min || number > max) {
          return "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " + value;
        }
        return "";
      },
      "INT in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
}

// A finite real number in (0, max].
CLI::Validator positive_number(double max) {
  return CLI::Validator(
      [max](std::string& value) -> std::string {
        char* end = nullptr;
        const double number = value.empty() ? NAN : std::strtod(value.c_str(), &end);
        if (value.empty() || end != value.c_str() + value.size() || !std::isfinite(number)) {
          return "expected a number, got \"" + value + "\"";
        }
        if (!(number > 0 && number <= max)) return "must be in (0, " + c10::str(max) + "], got " + value;
        return "";
      },
      "");
}

// true or false (also 1/0, yes/no, on/off, any case); nothing else, not even "".
CLI::Validator boolean() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        std::string lower = value;
        std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
        for (const char* word : {"true", "1", "yes", "on", "false", "0", "no", "off"}) {
          if (lower == word) {
            value = lower;
            return "";
          }
        }
        return "expected true or false, got \"" + value + "\"";
      },
      "BOOL");
}

// Names (configs, precisions, formats, devices) are matched without regard to case, all alike.
CLI::Validator lower_case() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
        return "";
      },
      "");
}

// Control characters in a message (an invisible byte in a path or a value) shown as \xNN.
std::string escape_control_characters(const std::string& text) {
  std::string escaped;
  for (const unsigned char c : text) {
    if ((c < 0x20 && c != '\n') || c == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      escaped += hex;
    } else {
      escaped += static_cast<char>(c);
    }
  }
  return escaped;
}

std::string folder_name(std::string name) {
  for (char& c : name) {
    if (c == '+' || c == '=' || c == ' ') c = '_';
  }
  return name;
}

// What a run that SIGTERM / SIGINT stopped says: after which step of how many, what it saved,
// and (`go_on`) how to continue from there.
std::string stop_report(const PretrainResult& result, int64_t max_steps, const std::string& go_on) {
  std::ostringstream report;
  const int64_t stopped_at = result.start_step + static_cast<int64_t>(result.history.size());
  report << "stopped by " << (result.stop_signal == SIGINT ? "SIGINT" : "SIGTERM") << " after step " << stopped_at
         << " of " << max_steps;
  const auto saved = result.last_checkpoint.empty()
                         ? std::nullopt
                         : Trainer::parse_checkpoint_name(fs::path(result.last_checkpoint).filename().string());
  if (!saved) {
    report << "; no checkpoint saved (--save-last false)";
  } else {
    report << "; saved " << result.last_checkpoint << "; continue with " << go_on;
    if (saved->step < stopped_at) report << " (steps " << saved->step + 1 << ".." << stopped_at << " run again)";
  }
  return report.str();
}

// A stopped run exits as the signal would have ended it: 128 + the signal.
int stop_exit_code(const PretrainResult& result) {
  return 128 + (result.stop_signal > 0 ? result.stop_signal : SIGTERM);
}

}  // namespace

int gpt_pretrain_main(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{"GPT / Llama 3 pretraining in C++ with amp8: byte-level or Megatron data, any precision (NeMo's knobs)",
               "gpt_pretrain"};
  // A flag given twice takes its last value (so a command can be extended by appending flags).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::string config = "tiny", precision = "auto", fp8 = "none", fp8_recipe = "delayed", algo = "max", data,
              device = "auto",
              save_dir, resume, compare, allow_changes;
  int fp8_margin = 0;
  // -1: "the config's" (the flag itself only takes values in its range).
  int64_t history = 1024, steps = -1, micro_batch = -1, grad_accum = 1, seq = -1, log_every = -1,
          save_every = 0;
  bool fp8_params = true, overlap_grad_reduce = true, resume_if_exists = false, fused_mlp = true;
  std::string fp8_params_scaling = "current";
  bool fp8_gemm_autotune = PretrainRecipe().fp8_gemm_autotune;
  bool overlap_param_gather = false;
  bool grad_reduce_in_fp32 = true;  // applied only when given: each precision has its default
  std::string exp_avg_dtype = "fp32", exp_avg_sq_dtype = "fp32";
  int64_t bucket_size = DistributedOptimizerOptions().bucket_size();
  std::string profile_dir;
  std::string attention_backend = "auto";
  std::string recompute_method = "none";
  int64_t recompute_num_layers = 1;
  bool cuda_graph = false, deterministic = false;
  int64_t profile_first_step = 10, profile_steps = 3;
  int64_t fp8_min_gemm_size = MixedPrecisionOptions("bf16-mixed").fp8_min_gemm_size();
  double lr = -1;
  int64_t seed = 1234;
  constexpr int64_t kMaxCount = int64_t{1} << 40;  // steps, intervals, elements
  constexpr int64_t kMaxBatch = int64_t{1} << 20;  // sequences, micro-batches, tokens
  app.add_option("--config", config, "model config: tiny, small, 125m, 128m, 350m, 1b (GPT); llama_tiny, "
                 "llama32_1b, llama32_3b, llama3_8b, llama3_8b_4layer (Llama 3)")
      ->capture_default_str()->transform(lower_case());
  auto* precision_flag = app.add_option("--precision", precision, "32, bf16-mixed, 16-mixed (fp16-mixed), or auto (bf16-mixed on a GPU, 32 on the CPU)")
      ->capture_default_str()->transform(lower_case());
  auto* fp8_flag = app.add_option("--fp8", fp8, "none, hybrid (E4M3 forward, E5M2 gradients) or e4m3")
      ->capture_default_str()->transform(lower_case());
  // The FP8 settings below need --fp8 (or a --compare run with +fp8).
  std::vector<CLI::Option*> fp8_flags;
  fp8_flags.push_back(app.add_option("--fp8-recipe", fp8_recipe,
                                     "with FP8: delayed (NeMo's presets: scales from an amax history), "
                                     "tensorwise (Megatron-Bridge's current scaling: each tensor's own amax, "
                                     "first and last layer in bf16) or blockwise (Megatron-Bridge's subchannel "
                                     "scaling: a scale per 1x128 tile of activations and gradients and per 128x128 "
                                     "block of weights, as DeepSeek-V3)")
                          ->capture_default_str()->transform(lower_case()));
  int64_t layers_start_bf16 = -1, layers_end_bf16 = -1;  // -1: the recipe's
  fp8_flags.push_back(app.add_option("--num-layers-at-start-in-bf16", layers_start_bf16,
                                     "with FP8: transformer layers at the start kept in bf16 (default: the recipe's; tensorwise: 1)")
                          ->check(whole_number(0, kMaxBatch)));
  fp8_flags.push_back(app.add_option("--num-layers-at-end-in-bf16", layers_end_bf16,
                                     "with FP8: transformer layers at the end kept in bf16 (default: the recipe's; tensorwise: 1)")
                          ->check(whole_number(0, kMaxBatch)));
  auto* margin_flag = app.add_option("--fp8-margin", fp8_margin,
                                     "with delayed or tensorwise FP8: scale = (fp8_max / amax) / 2^margin for activations, gradients "
                                     "and weights quantized in the forward pass (--fp8-params true writes FP8 weights "
                                     "from their masters' exact amax, without a margin)")
                          ->capture_default_str()->check(whole_number(0, 126));  // validate() explains > kMaxFp8Margin
  fp8_flags.push_back(margin_flag);
  auto* history_flag = app.add_option("--fp8-amax-history-len", history, "with delayed FP8: steps of amax history per FP8 tensor")
                           ->capture_default_str()->check(whole_number(1, 1 << 20));
  auto* algo_flag = app.add_option("--fp8-amax-compute-algo", algo, "with delayed FP8: max or most_recent")
                        ->capture_default_str()->transform(lower_case());
  fp8_flags.push_back(history_flag);
  fp8_flags.push_back(algo_flag);
  auto* fp8_params_flag =
      app.add_option("--fp8-params", fp8_params,
                     "with FP8: keep linear weights only in FP8 (NeMo's delayed and tensorwise presets: true; "
                     "blockwise: false, and true stores them in 128x128 blocks)")
          ->capture_default_str()->transform(boolean());
  fp8_flags.push_back(fp8_params_flag);
  auto* fp8_params_scaling_flag =
      app.add_option("--fp8-params-scaling", fp8_params_scaling,
                     "with --fp8-params true (one scale per weight): the scale FP8 weights are written at after "
                     "a step: current (from the updated master's amax) or delayed (from the previous step's, "
                     "written in the fused Adam pass, as TE's FusedAdam)")
          ->capture_default_str()->transform(lower_case())->check(CLI::IsMember({"current", "delayed"}));
  fp8_flags.push_back(fp8_params_scaling_flag);
  fp8_flags.push_back(app.add_option("--fp8-min-gemm-size", fp8_min_gemm_size,
                                     "with FP8: GEMMs smaller than this (rows x in x out) run in high precision; 0 = all in "
                                     "FP8; -1 = per shape, where FP8 was measured faster on an H200")
                          ->capture_default_str()->check(whole_number(-1, std::numeric_limits<int64_t>::max())));
  app.add_option("--steps", steps, "optimizer steps (default: the config's; tiny: 1000)")->check(whole_number(1, kMaxCount));
  app.add_option("--micro-batch", micro_batch, "sequences per micro-batch (default: the config's)")
      ->check(whole_number(1, kMaxBatch));
  app.add_option("--grad-accum", grad_accum, "micro-batches per optimizer step")->capture_default_str()
      ->check(whole_number(1, kMaxBatch));
  app.add_option("--seq", seq, "tokens (bytes) per sequence (default: the config's)")->check(whole_number(1, kMaxBatch));
  app.add_option("--lr", lr, "peak learning rate, in (0, 10] (default: the config's); the cosine decays to a tenth of it")->check(positive_number(10.0));
  app.add_option("--data", data, "a text file, read as bytes (default: the built-in corpus)");
  std::string data_prefix, data_split = "969,30,1";
  int64_t vocab_size = 0;
  int64_t eval_every = -1, eval_iters = -1;  // -1: the recipe's
  app.add_option("--eval-every", eval_every,
                 "validation loss every N steps and after the last one, 0 = none (default: the config's; tiny: 100, others: 1000)")
      ->check(whole_number(0, kMaxCount));
  auto* eval_iters_flag = app.add_option("--eval-iters", eval_iters, "held-out micro-batches per validation (default: 10)")
      ->check(whole_number(1, kMaxBatch));
  app.add_option("--data-prefix", data_prefix,
                 "Megatron-Core indexed data instead of bytes: a .bin/.idx path prefix, or a blend \"0.3 a 0.7 b\" (by size: \"a b\")");
  auto* split_flag = app.add_option("--split", data_split, "with --data-prefix: train/valid/test weights, Megatron's split string")
      ->capture_default_str();
  app.add_option("--vocab-size", vocab_size,
                 "with --data-prefix: the tokenizer's vocabulary size (padded up to a multiple of 128)")
      ->check(whole_number(1, int64_t{1} << 24));
  app.add_option("--device", device, "auto, cpu, cuda or cuda:N")->capture_default_str()->transform(lower_case());
  app.add_option("--save-dir", save_dir, "metrics.jsonl, loss.svg and checkpoints/ (default: runs/gpt_<config>); "
                 "one run at a time, and a folder that holds a run is only continued (--resume)");
  app.add_option("--save-every", save_every, "checkpoint every N steps (0: only the last one, see --save-last)")
      ->check(whole_number(0, kMaxCount));
  bool save_last = true;
  app.add_option("--save-last", save_last, "checkpoint after the last step (and on SIGTERM); false with --save-every 0: no checkpoints, e.g. for benchmarks")
      ->capture_default_str()->transform(boolean());
  app.add_option("--resume", resume, "continue from a checkpoint file or a save-dir (its newest complete checkpoint)");
  app.add_option("--resume-if-exists", resume_if_exists,
                 "continue from --save-dir's newest checkpoint when it has one, else start there (NeMo's AutoResume)")
      ->capture_default_str()->transform(boolean());
  auto* allow_changes_flag = app.add_option("--allow-changes", allow_changes,
                 "resume although these settings differ from the checkpoint's, e.g. steps,lr (an exact resume needs them equal)");
  app.add_option("--seed", seed, "seed of the initial weights and of the data order")->capture_default_str()
      ->check(whole_number(0, std::numeric_limits<int64_t>::max()));
  app.add_option("--log-every", log_every, "a progress line every N steps, 0 = none (default: the config's; tiny: 100)")
      ->check(whole_number(0, kMaxCount));
  app.add_option("--overlap-grad-reduce", overlap_grad_reduce,
                 "under torchrun: reduce-scatter gradient buckets during the backward pass")
      ->capture_default_str()->transform(boolean());
  app.add_option("--overlap-param-gather", overlap_param_gather,
                 "under torchrun: all-gather the updated parameters while the next forward pass "
                 "runs (each block waits for its own)")
      ->capture_default_str()->transform(boolean());
  app.add_option("--bucket-size", bucket_size, "under torchrun: elements per gradient bucket")
      ->capture_default_str()->check(whole_number(1, kMaxCount));
  auto* grad_reduce_flag = app.add_option(
      "--grad-reduce-in-fp32", grad_reduce_in_fp32,
      "sum gradients in float32: across ranks under torchrun and across --grad-accum micro-batches (false: in "
      "the params dtype; on one GPU FP8 weights' gradients are float32 either way); default: the precision's (NeMo: "
      "true for bf16-mixed, false for 16-mixed)")->transform(boolean());
  app.add_option("--exp-avg-dtype", exp_avg_dtype,
                 "Adam's first moment: fp32, or bf16 for half its bytes, the update still computed in "
                 "float32 (Megatron-Core's precision-aware optimizer)")
      ->capture_default_str()->transform(lower_case())->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--exp-avg-sq-dtype", exp_avg_sq_dtype, "Adam's second moment: fp32 or bf16 (see --exp-avg-dtype)")
      ->capture_default_str()->transform(lower_case())->check(CLI::IsMember({"fp32", "bf16"}));
  auto* fused_mlp_flag = app.add_option("--fused-mlp", fused_mlp,
                 "with FP8: each block's MLP as one Fp8LayerNormMLP call, GELU inside the FP8 casts "
                 "(TE's LayerNormMLP); false: its modules one after the other (outside FP8 they always are)")
      ->capture_default_str()->transform(boolean());
  fp8_flags.push_back(fused_mlp_flag);
  app.add_option("--recompute-method", recompute_method,
                 "activation recomputation (Megatron's full recompute granularity): none; uniform, the "
                 "blocks in chunks of --recompute-num-layers, each keeping only its input and run again "
                 "in the backward pass; block, the first --recompute-num-layers blocks each so, the "
                 "others keeping their activations")
      ->capture_default_str()->transform(lower_case());
  auto* recompute_layers_flag = app.add_option("--recompute-num-layers", recompute_num_layers,
                 "with --recompute-method: the chunk length (uniform) or how many blocks from the first "
                 "(block)")->capture_default_str()->check(whole_number(1, kMaxCount));
  app.add_option("--attention-backend", attention_backend,
                 "on a GPU, the fused attention kernel tried first: auto (PyTorch's own order; on Hopper with a "
                 "recent cuDNN, cuDNN first), cudnn, flash or efficient")->capture_default_str()->transform(lower_case())
      ->check(CLI::IsMember({"auto", "cudnn", "flash", "efficient"}));
  auto* autotune_flag = app.add_option("--fp8-gemm-autotune", fp8_gemm_autotune,
                 "with FP8 on a GPU: time up to 8 of cuBLASLt's candidate algorithms for each FP8 GEMM shape at "
                 "its first call and keep the fastest (the rounding may then differ from run to run; off under "
                 "--deterministic), instead of the heuristic's first")
      ->capture_default_str()->transform(boolean());
  fp8_flags.push_back(autotune_flag);
  app.add_option("--cuda-graph", cuda_graph,
                 "capture each micro-batch's forward and backward pass in a CUDA graph after 3 eager "
                 "steps and replay it: one launch instead of thousands, for models too small to keep "
                 "the GPU busy from the host; one GPU, bf16-mixed or 32, with or without FP8")
      ->capture_default_str()->transform(boolean());
  app.add_option("--deterministic", deterministic,
                 "runs that repeat bit for bit on a GPU: PyTorch's deterministic algorithms (an op "
                 "without one is an error naming it) and CUBLAS_WORKSPACE_CONFIG=:4096:8 "
                 "(Lightning's Trainer(deterministic=True))")
      ->capture_default_str()->transform(boolean());
  app.add_option("--profile", profile_dir,
                 "record a few steps with the Kineto profiler into this folder: trace.json "
                 "(chrome://tracing, ui.perfetto.dev) and the device time by category "
                 "(step_profile.txt / .json, also printed); with --compare, a folder per run");
  auto* profile_first_flag = app.add_option("--profile-first-step", profile_first_step, "with --profile: the first step recorded (0-based)")
      ->capture_default_str()->check(whole_number(0, kMaxCount));
  auto* profile_steps_flag = app.add_option("--profile-steps", profile_steps, "with --profile: how many steps are recorded")
      ->capture_default_str()->check(whole_number(1, kMaxCount));
  app.add_option("--compare", compare,
                 "run several precisions with the same seed and draw their curves in one picture, "
                 "e.g. 32,bf16-mixed,bf16-mixed+fp8; per run +fp8=e4m3, +fp8-params or +bf16-params "
                 "override --fp8-params; writes compare.svg, compare_gap.svg (every run's loss against the "
                 "first's, step by step) and compare.jsonl (final loss, tokens/s, peak memory, "
                 "difference against the 32 and bf16-mixed runs)")->transform(lower_case());
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e, out, err);  // --help
    err << "gpt_pretrain: error: " << escape_control_characters(e.what()) << "\nRun with --help for the flags."
        << std::endl;
    return e.get_exit_code();
  }

  std::string batch_shape = "?";  // micro-batch x seq, for an out-of-memory message
  const bool float32_moments = exp_avg_dtype == "fp32" && exp_avg_sq_dtype == "fp32";
  try {
    auto recipe = gpt_pretrain_recipe(config);
    if (micro_batch > 0) recipe.micro_batch = micro_batch;
    batch_shape = std::to_string(recipe.micro_batch) + " x " + std::to_string(seq > 0 ? seq : recipe.seq);
    if (seq > 0) recipe.seq = seq;
    if (lr > 0) recipe.min_lr *= lr / recipe.lr, recipe.lr = lr;  // the config's decay ratio
    if (steps > 0) recipe.trainer.max_steps(steps);
    recipe.trainer.accumulate_grad_batches(grad_accum).every_n_train_steps(save_every).save_last(save_last)
        .cuda_graph(cuda_graph).deterministic(deterministic);
    // Now, before the first GEMM, so that cuBLAS's workspace follows it (fit does it again).
    if (deterministic) use_deterministic_algorithms();
    if (log_every >= 0) recipe.trainer.log_every_n_steps(log_every);
    recipe.data = data;
    recipe.data_prefix = data_prefix;
    if (eval_every >= 0) recipe.eval_every = eval_every;
    if (eval_iters >= 1) recipe.eval_iters = eval_iters;
    TORCH_CHECK(recipe.eval_every > 0 || eval_iters_flag->count() == 0,
                "--eval-iters applies when the run validates (--eval-every > 0)");
    TORCH_CHECK(!resume.empty() || resume_if_exists || allow_changes_flag->count() == 0,
                "--allow-changes applies to a resumed run (--resume or --resume-if-exists)");
    TORCH_CHECK(resume.empty() || !resume_if_exists, "--resume and --resume-if-exists cannot be combined: "
                "--resume names what to continue from, --resume-if-exists looks in --save-dir");
    recipe.split = data_split;
    recipe.vocab_size = vocab_size;
    recipe.device = device;
    recipe.seed = seed;
    recipe.resume = resume;
    recipe.resume_if_exists = resume_if_exists;
    for (const auto& name : split(allow_changes)) recipe.allow_changes.insert(name);
    recipe.overlap_grad_reduce = overlap_grad_reduce;
    recipe.overlap_param_gather = overlap_param_gather;
    recipe.bucket_size = bucket_size;
    if (!save_dir.empty()) recipe.save_dir = save_dir;
    recipe.attention_backend = attention_backend;
    recipe.fp8_gemm_autotune = fp8_gemm_autotune;
    if (auto* gpt = std::get_if<GptConfig>(&recipe.model)) {
      gpt->fused_mlp(fused_mlp);
    } else {
      TORCH_CHECK(fused_mlp_flag->count() == 0, "--fused-mlp applies to the GPT configs (LayerNorm and "
                  "GELU MLPs); config ", config, " is a Llama");
    }
    TORCH_CHECK(recompute_method == "none" || recompute_method == "uniform" || recompute_method == "block",
                "--recompute-method must be none, uniform or block, got \"", recompute_method, "\"");
    const auto recompute = RecomputeOptions()
                               .method(recompute_method_from_string(recompute_method))
                               .num_layers(recompute_num_layers);
    TORCH_CHECK(recompute.method() != RecomputeMethod::kNone || recompute_layers_flag->count() == 0,
                "--recompute-num-layers needs --recompute-method uniform or block");
    const int64_t blocks = std::visit([](const auto& model) { return model.layers(); }, recipe.model);
    TORCH_CHECK(recompute.method() == RecomputeMethod::kNone || recompute_num_layers <= blocks,
                "--recompute-num-layers must be at most the config's ", blocks, " blocks (", config, "), got ",
                recompute_num_layers);
    TORCH_CHECK(recompute.method() == RecomputeMethod::kNone || !cuda_graph,
                "--recompute-method and --cuda-graph cannot be combined: the recomputation runs a "
                "backward pass of its own inside the captured one");
    std::visit([&](auto& model) { model.recompute(recompute); }, recipe.model);
    for (const auto* flag : {profile_first_flag, profile_steps_flag}) {
      TORCH_CHECK(!profile_dir.empty() || flag->count() == 0, flag->get_name(), " applies with --profile DIR only");
    }
    TORCH_CHECK(!data_prefix.empty() || split_flag->count() == 0, "--split applies to --data-prefix only "
                "(--data and the built-in corpus hold out their last 5% for validation)");
    recipe.profile_dir = profile_dir;
    recipe.profile_first_step = profile_first_step;
    recipe.profile_steps = profile_steps;
    // Only "auto" precision looks at the device: bf16-mixed on a GPU, 32 on the CPU.
    const bool on_cuda = device == "auto" ? torch::cuda::is_available() : device.rfind("cuda", 0) == 0;
    const std::string on_the_cpu = device == "auto" ? "the CPU (no GPU found)" : "--device " + device;
    TORCH_CHECK(!cuda_graph || on_cuda, "--cuda-graph needs a CUDA GPU; the run is on ", on_the_cpu);
    const torch::Device precision_device = on_cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
    // PyTorch's CPU attention and amp8's CPU GEMMs have no kernels to choose between.
    TORCH_CHECK(on_cuda || attention_backend == "auto", "--attention-backend ", attention_backend,
                " chooses a GPU kernel; the run is on ", on_the_cpu);
    TORCH_CHECK(on_cuda || autotune_flag->count() == 0 || !fp8_gemm_autotune,
                "--fp8-gemm-autotune true times GPU kernels; the run is on ", on_the_cpu);

    bool fp8_params_scaling_reached = false;  // --fp8-params-scaling applied to a run
    // params: a --compare run's +fp8-params / +bf16-params, over --fp8-params.
    auto precision_for = [&](const std::string& name, const std::string& fp8_format, const std::string& recipe_name,
                             std::optional<bool> params = std::nullopt) {
      auto options = precision_from_flags(name, fp8_format, precision_device, recipe_name);
      if (options.fp8_enabled()) {
        options.fp8_margin(fp8_margin).fp8_amax_history_len(history).fp8_amax_compute_algo(algo)
            .fp8_min_gemm_size(fp8_min_gemm_size);
        // The blockwise presets keep weights in high precision (Megatron-Bridge's
        // fp8_param_gather = False); an explicit --fp8-params true stores them in 128x128 blocks.
        if (recipe_name != "blockwise" || fp8_params_flag->count() > 0) options.fp8_params(fp8_params);
        if (params) options.fp8_params(*params);
        // Reaches the runs that keep FP8 weights with one scale each; a flag that reaches no run
        // is an error below.
        if (fp8_params_scaling_flag->count() > 0 && options.fp8_params() && recipe_name != "blockwise") {
          options.fp8_params_scaling(fp8_params_scaling);
          fp8_params_scaling_reached = true;
        }
        if (layers_start_bf16 >= 0) options.num_layers_at_start_in_bf16(layers_start_bf16);
        if (layers_end_bf16 >= 0) options.num_layers_at_end_in_bf16(layers_end_bf16);
        // The amax history belongs to delayed scaling alone; a margin to the recipes with one
        // scale per tensor (TE's block scaling has none).
        for (const auto* flag : {history_flag, algo_flag}) {
          TORCH_CHECK(recipe_name == "delayed" || flag->count() == 0, flag->get_name(),
                      " applies to fp8 recipe \"delayed\" only (this run: \"", recipe_name,
                      "\": every tensor is scaled by its own amax)");
        }
        TORCH_CHECK(recipe_name != "blockwise" || margin_flag->count() == 0, margin_flag->get_name(),
                    " applies to fp8 recipes \"delayed\" and \"tensorwise\" (this run: \"blockwise\": each "
                    "block's scale is fp8_max / its own amax, without a margin)");
      }
      if (grad_reduce_flag->count() > 0) options.grad_reduce_in_fp32(grad_reduce_in_fp32);
      options.exp_avg_dtype(exp_avg_dtype == "bf16" ? at::kBFloat16 : at::kFloat)
          .exp_avg_sq_dtype(exp_avg_sq_dtype == "bf16" ? at::kBFloat16 : at::kFloat);
      options.validate();
      return options;
    };

    // FP8 settings without FP8 would be silently ignored (or, stored in a checkpoint, block a
    // later resume): they are an error instead.
    // --compare names each run's precision and FP8 itself.
    for (const auto* flag : {precision_flag, fp8_flag}) {
      TORCH_CHECK(compare.empty() || flag->count() == 0, flag->get_name(), " and --compare cannot be combined: "
                  "each --compare run names its precision and FP8 (e.g. --compare bf16-mixed,bf16-mixed+fp8=e4m3)");
    }
    const bool any_fp8 = compare.empty() ? fp8 != "none" : compare.find("+fp8") != std::string::npos;
    for (const auto* flag : fp8_flags) {
      TORCH_CHECK(any_fp8 || flag->count() == 0, flag->get_name(), " is an FP8 setting, but no run uses FP8 "
                  "(--fp8 none); add --fp8 hybrid (or +fp8 to a --compare run) or drop ", flag->get_name());
    }

    if (compare.empty()) {
      recipe.precision = precision_for(precision, fp8, fp8_recipe);
      TORCH_CHECK(fp8_params_scaling_flag->count() == 0 || fp8_params_scaling_reached,
                  "--fp8-params-scaling applies with --fp8-params true and an FP8 recipe with one scale per weight "
                  "(delayed or tensorwise)");
      const auto result = run_pretraining(recipe, out);
      if (result.rank != 0) {  // rank 0 reports; every rank says its memory
        if (result.peak_memory_bytes > 0) out << "gpt_pretrain: rank " << result.rank << memory_summary(result) << std::endl;
        return result.stopped ? stop_exit_code(result) : 0;
      }
      if (result.nothing_to_do) {
        out << "gpt_pretrain: nothing to do: the checkpoint is at step " << result.start_step
            << ", at or past --steps " << recipe.trainer.max_steps()
            << " (to train further, raise --steps and add --allow-changes steps)" << std::endl;
        return 0;
      }
      if (result.stopped) {
        // What continues the run: the command as it was where it already resumes from save-dir.
        const std::string go_on = recipe.resume_if_exists || recipe.resume == recipe.save_dir
                                      ? "the same command"
                                      : "--resume " + recipe.save_dir;
        err << "gpt_pretrain: " << stop_report(result, recipe.trainer.max_steps(), go_on) << std::endl;
        return stop_exit_code(result);
      }
      out << "gpt_pretrain: final loss " << result.final_loss << ", " << result.tokens_per_s
          << " tokens/s (steady state " << result.steady_tokens_per_s << ")"
          << memory_summary(result) << "; metrics " << result.metrics_path << ", picture " << result.picture_path << std::endl;
      return 0;
    }

    TORCH_CHECK(resume.empty(), "--compare and --resume cannot be combined");
    std::vector<std::pair<std::string, MixedPrecisionOptions>> runs;
    for (const auto& item : split(compare)) {
      // <precision>[+fp8[=hybrid|=e4m3]][+delayed|+tensorwise|+blockwise][+fp8-params|+bf16-params]; every item is checked
      // before anything runs.
      std::stringstream parts(item);
      std::string name, part, format = "none", recipe_name = fp8_recipe;
      std::optional<bool> params;
      bool recipe_named = false;
      std::getline(parts, name, '+');
      while (std::getline(parts, part, '+')) {
        if (part == "fp8" || part == "fp8=hybrid" || part == "fp8=e4m3") {
          format = part == "fp8=e4m3" ? "e4m3" : "hybrid";
        } else if (part == "fp8-params" || part == "bf16-params") {
          params = part == "fp8-params";
        } else if (part == "delayed" || part == "tensorwise" || part == "blockwise") {
          recipe_name = part;
          recipe_named = true;
        } else {
          TORCH_CHECK(false, "--compare: \"", item, "\": unknown part \"", part,
                      "\"; expected <precision>[+fp8[=hybrid|=e4m3]][+delayed|+tensorwise|+blockwise]"
                      "[+fp8-params|+bf16-params]");
        }
      }
      TORCH_CHECK(!params || format != "none", "--compare: \"", item,
                  "\": +fp8-params/+bf16-params need +fp8");
      TORCH_CHECK(!recipe_named || format != "none", "--compare: \"", item, "\": +", recipe_name,
                  " (an FP8 recipe) needs +fp8");
      runs.emplace_back(item, precision_for(name, format, recipe_name, params));
    }
    TORCH_CHECK(!runs.empty(), "--compare needs at least one precision, got \"", compare, "\"");
    TORCH_CHECK(fp8_params_scaling_flag->count() == 0 || fp8_params_scaling_reached,
                "--fp8-params-scaling applies with FP8 weights (--fp8-params true or a run's +fp8-params) and an "
                "FP8 recipe with one scale per weight (delayed or tensorwise); no --compare run has them");
    std::vector<LossCurve> curves;
    std::vector<std::string> curve_runs;  // the run of each curve
    std::vector<nlohmann::json> summary;
    std::vector<std::string> failures;
    std::vector<std::string> finished;  // runs whose checkpoint was already at --steps
    std::optional<PretrainResult> stopped;  // the run a signal stopped (the later ones did not start)
    const std::string base = recipe.save_dir;
    // A run finished by an earlier call (--resume-if-exists at --steps) keeps the row that call
    // wrote; the differences to the 32 and bf16-mixed runs are worked out again below.
    std::map<std::string, nlohmann::json> earlier_rows;
    {
      std::ifstream file(fs::path(base) / "compare.jsonl");
      for (std::string line; std::getline(file, line);) {
        auto row = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (!row.is_object() || !row.contains("run") || !row["run"].is_string() || !row.contains("final_loss") ||
            !row["final_loss"].is_number()) {
          continue;
        }
        for (const char* reference : {"32", "bf16-mixed"}) {
          row.erase(std::string("final_loss_rel_diff_vs_") + reference);
          row.erase(std::string("final_val_loss_rel_diff_vs_") + reference);
        }
        earlier_rows[row["run"].get<std::string>()] = row;
      }
    }
    // Each run's whole curve from its metrics (a resumed run's too, from its first step).
    auto add_curve = [&](const std::string& name, double final_loss, const std::string& metrics_path) {
      curves.push_back(read_loss_curve(name + " (final " + std::to_string(final_loss).substr(0, 6) + ")", metrics_path));
      curve_runs.push_back(name);
    };
    // A run this call did not train keeps the row and curve of the call that did: one finished
    // by an earlier call (--resume-if-exists at --steps), or one after a run a signal stopped.
    // A finished run whose row is gone (its last call was stopped after its last step, or died
    // before writing compare.jsonl) gets one from its metrics.
    const auto environment = DistributedEnvironment::from_env();
    const int rank = environment ? environment->rank : 0;
    bool rebuilt_row = false;  // a finished run's row made from its metrics: compare.jsonl changes
    auto keep_earlier = [&](const std::string& name, bool finished_run) {
      const auto metrics_path = (fs::path(base) / folder_name(name) / "metrics.jsonl").string();
      const auto earlier = earlier_rows.find(name);
      nlohmann::json row;
      if (earlier != earlier_rows.end()) {
        row = earlier->second;
      } else if (finished_run) {
        const auto curve = read_loss_curve(name, metrics_path);
        if (curve.points.empty()) return;
        const size_t tail = std::min<size_t>(10, curve.points.size());
        double final_loss = 0;
        for (size_t i = curve.points.size() - tail; i < curve.points.size(); ++i) {
          final_loss += curve.points[i].second / static_cast<double>(tail);
        }
        row = {{"run", name},
               {"steps", static_cast<int64_t>(curve.points.back().first)},
               {"final_loss", final_loss},
               {"final_val_loss", curve.validation.empty() ? nlohmann::json() : nlohmann::json(curve.validation.back().second)},
               {"note", "from its metrics.jsonl: compare.jsonl had no row of this run"}};
        rebuilt_row = true;
      } else {
        return;
      }
      summary.push_back(row);
      add_curve(name, row["final_loss"].is_number() ? row["final_loss"].get<double>() : NAN, metrics_path);
    };
    for (size_t index = 0; index < runs.size(); ++index) {
      const auto& [name, options] = runs[index];
      auto run = recipe;
      run.precision = options;
      run.save_dir = (fs::path(base) / folder_name(name)).string();
      if (!recipe.profile_dir.empty()) run.profile_dir = (fs::path(recipe.profile_dir) / folder_name(name)).string();
      PretrainResult result;
      try {
        result = run_pretraining(run, out);
      } catch (const c10::Error& e) {
        // The other runs still run, and the summary says which one failed and why.
        failures.push_back("\"" + name + "\": " + e.what_without_backtrace());
        summary.push_back({{"run", name}, {"error", e.what_without_backtrace()}});
        err << "gpt_pretrain: --compare run \"" << name << "\" failed: " << escape_control_characters(e.what_without_backtrace()) << std::endl;
        continue;
      }
      if (result.nothing_to_do) {  // --resume-if-exists on a finished run: it keeps its results
        out << "gpt_pretrain: " << name << ": nothing to do: its checkpoint is at step " << result.start_step
            << ", at or past --steps " << recipe.trainer.max_steps() << std::endl;
        finished.push_back(name);
        keep_earlier(name, /*finished_run=*/true);
        continue;
      }
      if (result.stopped) {
        const std::string report = stop_report(result, recipe.trainer.max_steps(),
                                               recipe.resume_if_exists ? "the same command"
                                                                       : "the same command and --resume-if-exists true");
        err << "gpt_pretrain: --compare run \"" << name << "\" " << report << std::endl;
        summary.push_back({{"run", name}, {"error", report}});
        stopped = result;
        // The runs after it do not start; those an earlier call finished keep their rows.
        for (size_t later = index + 1; later < runs.size(); ++later) keep_earlier(runs[later].first, false);
        break;
      }
      add_curve(name, result.final_loss, result.metrics_path);
      out << "gpt_pretrain: " << name << ": final loss " << result.final_loss << ", "
          << result.tokens_per_s << " tokens/s";
      out << memory_summary(result) << std::endl;
      summary.push_back({{"run", name},
                         {"precision", result.precision},
                         {"fp8", options.fp8_enabled() ? options.fp8() : "none"},
                         {"fp8_recipe", options.fp8_enabled() ? options.fp8_recipe() : "none"},
                         {"fp8_params", options.fp8_enabled() && options.fp8_params()},
                         {"fp8_params_scaling", options.fp8_enabled() && options.fp8_params()
                                                    ? nlohmann::json(options.fp8_params_scaling())
                                                    : nlohmann::json()},
                         {"steps", result.start_step + static_cast<int64_t>(result.history.size())},
                         {"final_loss", result.final_loss},
                         {"final_val_loss", std::isfinite(result.final_val_loss) ? nlohmann::json(result.final_val_loss)
                                                                                 : nlohmann::json()},
                         {"tokens_per_s", result.tokens_per_s},
                         {"steady_tokens_per_s", result.steady_tokens_per_s},
                         {"peak_memory_bytes", result.peak_memory_bytes},
                         {"resident_memory_bytes", result.resident_memory_bytes},
                         {"parameters", result.parameters}});
    }
    // Under torchrun every rank trained; rank 0 writes the summary and the pictures.
    if (rank != 0) {
      return stopped ? stop_exit_code(*stopped) : failures.empty() ? 0 : 2;
    }
    if (finished.size() == runs.size() && !rebuilt_row) {
      out << "gpt_pretrain: nothing to do: every run's checkpoint is at or past --steps "
          << recipe.trainer.max_steps() << "; compare.jsonl and the pictures stay as they are (to train "
          << "further, raise --steps and add --allow-changes steps)" << std::endl;
      return 0;
    }
    // The final loss of every run relative to the 32 and bf16-mixed runs, when those ran.
    for (const char* reference : {"32", "bf16-mixed"}) {
      const auto it = std::find_if(summary.begin(), summary.end(), [&](const nlohmann::json& s) {
        return s["run"] == reference && s.contains("final_loss") && s["final_loss"].is_number();
      });
      if (it == summary.end()) continue;
      const double ref = (*it)["final_loss"].get<double>();
      const bool validated = it->contains("final_val_loss") && (*it)["final_val_loss"].is_number();
      for (auto& s : summary) {
        if (!s.contains("final_loss") || !s["final_loss"].is_number()) continue;
        s[std::string("final_loss_rel_diff_vs_") + reference] = (s["final_loss"].get<double>() - ref) / ref;
        if (validated && s["final_val_loss"].is_number()) {
          const double ref_val = (*it)["final_val_loss"].get<double>();
          s[std::string("final_val_loss_rel_diff_vs_") + reference] =
              (s["final_val_loss"].get<double>() - ref_val) / ref_val;
        }
      }
    }
    {
      std::ofstream file(fs::path(base) / "compare.jsonl");
      for (const auto& s : summary) file << s.dump() << "\n";
      TORCH_CHECK(file.good(), "cannot write ", (fs::path(base) / "compare.jsonl").string());
    }
    const auto picture = (fs::path(base) / "compare.svg").string();
    write_loss_svg(picture, curves, config + ": loss by precision (same seed and data)");
    out << "gpt_pretrain: comparison picture " << picture << std::endl;
    if (curves.size() >= 2) {
      // Every other run against the first, step by step on the same batches and at the
      // evaluations: what a precision costs, without the batches' noise.
      std::vector<LossCurve> gaps;
      for (size_t i = 1; i < curves.size(); ++i) gaps.push_back(relative_to(curves[i], curves[0], curve_runs[i]));
      const auto gap_picture = (fs::path(base) / "compare_gap.svg").string();
      write_loss_svg(gap_picture, gaps, config + ": loss against " + curve_runs[0] + " (same seed and data)",
                     "loss - " + curve_runs[0] + "'s, % of it");
      out << "gpt_pretrain: difference picture " << gap_picture << std::endl;
    }
    if (stopped) return stop_exit_code(*stopped);
    if (!failures.empty()) {
      std::string list;
      for (const auto& failure : failures) list += (list.empty() ? "" : "; ") + failure;
      TORCH_CHECK(false, "--compare: ", failures.size(), " of ", runs.size(), " runs failed (", list,
                  "); the others are in ", (fs::path(base) / "compare.jsonl").string());
    }
    return 0;
  } catch (const c10::Error& e) {
    const bool out_of_memory = dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr || is_cpu_allocation_failure(e);
    err << "gpt_pretrain: error: ";
    if (out_of_memory) err << out_of_memory_advice(batch_shape, recompute_method, float32_moments);
    err << escape_control_characters(e.what_without_backtrace()) << std::endl;
    return 2;
  } catch (const std::bad_alloc& e) {
    err << "gpt_pretrain: error: " << out_of_memory_advice(batch_shape, recompute_method, float32_moments) << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    err << "gpt_pretrain: error: " << escape_control_characters(e.what()) << std::endl;
    return 2;
  }
}

}  // namespace amp8::recipes
