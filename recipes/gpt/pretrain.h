#pragma once

#include <cmath>
#include <cstdint>
#include <iosfwd>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "plugin/precision/mixed_precision_plugin.h"
#include "plugin/training/trainer.h"
#include "recipes/gpt/decoder.h"

namespace amp8::recipes {

/// Everything a pretraining run of a GPT or a Llama 3 needs, in the spirit of NeMo's
/// `pretrain_recipe()`: model, data, optimizer and LR schedule, trainer, precision. Change any
/// field before run_pretraining, except four of `trainer`'s, which run_pretraining derives
/// (checkpoint_dir from save_dir, tokens_per_micro_batch, flops_per_token and
/// peak_flops_per_device from the shapes and the GPU; set, they are an error):
///   auto recipe = amp8::recipes::gpt_pretrain_recipe("small");
///   recipe.precision = amp8::recipes::bf16_with_fp8_mixed();
///   recipe.trainer.max_steps(2000);
struct PretrainRecipe {
  std::string config_name = "tiny";
  /// A GptConfig or a LlamaConfig (decoder_config(name)).
  DecoderConfig model = GptConfig::named("tiny");
  /// Default: "32". gpt_pretrain's --precision auto (its default) picks bf16-mixed on a GPU.
  MixedPrecisionOptions precision = MixedPrecisionOptions("32");
  TrainerOptions trainer = TrainerOptions().max_steps(300).log_every_n_steps(25).gradient_clip_val(1.0);
  int64_t micro_batch = 16;
  int64_t seq = 128;
  /// AdamW (betas 0.9, 0.95), linear warm-up then cosine decay to min_lr.
  double lr = 3e-3;
  double min_lr = 3e-4;
  double weight_decay = 0.1;
  int64_t warmup_steps = 20;
  /// A text file read as bytes; "" = the built-in corpus.
  std::string data;
  /// Megatron-Core indexed data instead of bytes (MegatronTrainData): a path prefix of a
  /// `.bin` / `.idx` pair, or a weighted blend "0.3 a 0.7 b"; its train split by `split`. Needs
  /// `vocab_size` (padded up to a multiple of 128, Megatron's make-vocab-size-divisible-by).
  std::string data_prefix;
  std::string split = "969,30,1";
  int64_t vocab_size = 0;
  /// Validation loss every this many steps and after the last one (0 = none), over eval_iters
  /// held-out micro-batches: the split's validation part (data_prefix), or the last 5% of the
  /// text (bytes; training then draws from the first 95%).
  int64_t eval_every = 0;
  int64_t eval_iters = 10;
  /// "auto" (CUDA when there is a GPU), "cpu", "cuda" or "cuda:N".
  std::string device = "auto";
  /// metrics.jsonl, loss.svg and checkpoints/ go here.
  std::string save_dir = "runs/gpt";
  /// A checkpoint file, or a folder whose newest complete step_<N>.ckpt is taken (a corrupt or
  /// incomplete newer one is named and skipped); "" = a fresh run.
  std::string resume;
  /// NeMo's AutoResume(resume_if_exists): with `resume` empty, continue from save_dir's newest
  /// checkpoint when it has one (a save-dir with metrics but no checkpoint starts over).
  /// Without it, a save_dir that holds a run is refused rather than overwritten.
  bool resume_if_exists = false;
  /// Run settings (PretrainRecipe fields by name: "seq", "steps", "lr", ...) that may differ
  /// from the resumed checkpoint's; any other difference is an error (Trainer::run_settings).
  std::set<std::string> allow_changes;
  uint64_t seed = 1234;
  /// Data-parallel (under torchrun): reduce-scatter gradient buckets during the backward pass.
  bool overlap_grad_reduce = true;
  /// Data-parallel: all-gather the updated parameters while the next forward pass runs
  /// (DistributedOptimizerOptions::overlap_param_gather; the models wait per block).
  bool overlap_param_gather = false;
  /// Data-parallel: elements per gradient bucket (DistributedOptimizerOptions::bucket_size).
  int64_t bucket_size = DistributedOptimizerOptions().bucket_size();
  /// The fused attention kernel tried first (AttentionBackendGuard): "auto" (PyTorch's order),
  /// "cudnn", "flash" or "efficient".
  std::string attention_backend = "auto";
  /// The FP8 GEMMs' cuBLASLt algorithms: the fastest of the heuristic's candidates, measured
  /// at each configuration's first call (Fp8GemmAlgoSelection::kFastestMeasured; not under
  /// --deterministic), or the heuristic's first.
  bool fp8_gemm_autotune = true;
  /// Record optimizer steps [profile_first_step, profile_first_step + profile_steps) with the
  /// Kineto profiler (StepProfiler) into this folder: trace.json and the device time by
  /// category (step_profile.json / .txt, also printed); under torchrun, rank r > 0 writes
  /// into <profile_dir>/rank<r>. "" = no profile.
  std::string profile_dir;
  int64_t profile_first_step = 10;
  int64_t profile_steps = 3;
};

/// The default recipe for a named model config (see decoder_config: GPT's and Llama 3's names):
/// batch, sequence and learning rate sized for it.
PretrainRecipe gpt_pretrain_recipe(const std::string& config = "tiny");

struct PretrainResult {
  std::vector<StepMetrics> history;  ///< the steps this call ran
  std::vector<std::pair<double, double>> validation;  ///< (step, validation loss) of this call
  double final_val_loss = NAN;       ///< the last validation loss (NaN without validation)
  double final_loss = 0;             ///< mean loss of the last min(10, steps) steps
  double tokens_per_s = 0;           ///< over the steps this call ran (checkpoints included)
  /// Steady state: tokens per step over the median step time of the second half of the run
  /// (no start-up, no checkpoint writes); all ranks' tokens under data parallelism.
  double steady_tokens_per_s = 0;
  double peak_memory_bytes = 0;      ///< CUDA only
  /// CUDA only: memory still allocated after the last step, what every step starts from
  /// (weights, gradients, optimizer state and masters); peak minus it is the step's activations
  /// and workspace, which --recompute-method shrinks.
  double resident_memory_bytes = 0;
  int rank = 0;                      ///< data-parallel rank (0 without torchrun)
  int64_t parameters = 0;
  std::string precision;             ///< the plugin's name
  std::string metrics_path, picture_path;
  /// The run ended early on SIGTERM / SIGINT (stop_signal) after saving last_checkpoint.
  bool stopped = false;
  int stop_signal = 0;
  std::string last_checkpoint;
  /// Resumed from a checkpoint at or past max_steps: no step ran.
  bool nothing_to_do = false;
  int64_t start_step = 0;  ///< the step the run started from (the checkpoint's, or 0)
  /// Data-parallel on CUDA: per step, the median over the second half of the run of the time the
  /// compute stream waited for the gradient reduce-scatter after the backward pass and for the
  /// parameter all-gather after the step (DistributedOptimizer::StepCommunication), and the
  /// bytes each rank put into them. 0 otherwise.
  double reduce_wait_ms = 0, gather_wait_ms = 0;
  double reduce_bytes = 0, gather_bytes = 0;
};

/// Runs the recipe: checks every setting first (a bad one throws c10::Error naming it, before
/// anything is written), then trains with a progress line, appends one JSON line per step to
/// <save_dir>/metrics.jsonl, checkpoints into <save_dir>/checkpoints (every
/// trainer.every_n_train_steps and after the last step), and draws <save_dir>/loss.svg from all
/// of metrics.jsonl (a resumed run continues its curve, its metrics cut back to the checkpoint's
/// step first).
///
/// What a long job meets is handled: save_dir is locked for the run (a second run into it is
/// refused, naming the process that holds it); a save_dir that already holds a run is refused
/// unless the run resumes (resume / resume_if_exists); a checkpoint records the run's settings
/// and a resume with others is refused (allow_changes); SIGTERM / SIGINT finish the step, save
/// and return with `stopped`; a failed save (a full disk) throws with the earlier checkpoints
/// intact; a data file that changes under the run throws naming it.

PretrainResult run_pretraining(const PretrainRecipe& recipe, std::ostream& log);

/// The precision options for --precision / --fp8 and friends: "32", "16-mixed"/"fp16-mixed",
/// "bf16-mixed" or "auto"; fp8 "none", "hybrid" or "e4m3"; fp8_recipe "delayed" (from NeMo's
/// FP8 presets, bf16_with_fp8_mixed) or "tensorwise" (from Megatron-Bridge's current-scaling
/// presets, bf16_with_fp8_current_scaling_mixed); fp8_params is on unless turned off.
MixedPrecisionOptions precision_from_flags(const std::string& precision, const std::string& fp8,
                                           const torch::Device& device,
                                           const std::string& fp8_recipe = "delayed");

}  // namespace amp8::recipes
