#include "recipes/gpt/pretrain.h"

#if __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#define AMP8_HAS_CUDA_ALLOCATOR 1
#endif
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <ostream>
#include <tuple>

#include "ops/fp8_gemm.h"
#include "plugin/optim/fused_optimizer.h"
#include "plugin/training/checkpoint.h"
#include "plugin/distributed/process_group.h"
#include "plugin/training/files.h"
#include "plugin/training/step_profiler.h"
#include "plugin/training/throughput.h"
#include "recipes/gpt/callbacks.h"
#include "recipes/gpt/data.h"
#include "recipes/gpt/loss_plot.h"
#include "recipes/gpt/megatron_data.h"
#include "recipes/gpt/run_folder.h"
#include "recipes/precision.h"

namespace amp8::recipes {
namespace {

namespace fs = std::filesystem;

torch::Device resolve_device(const std::string& name) {
  if (name == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::kCPU;
  std::optional<torch::Device> device;
  try {
    device.emplace(name);
  } catch (const c10::Error&) {
    TORCH_CHECK(false, "device must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got \"", name, "\"");
  }
  TORCH_CHECK(device->is_cpu() || device->is_cuda(),
              "device must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got \"", name, "\"");
  if (device->is_cuda()) {
    TORCH_CHECK(torch::cuda::is_available(), "device \"", name, "\" asked for, but no CUDA GPU is available");
    TORCH_CHECK(!device->has_index() || device->index() < static_cast<int>(torch::cuda::device_count()),
                "device \"", name, "\": there are only ", torch::cuda::device_count(), " GPUs");
  }
  return *device;
}

}  // namespace

PretrainRecipe gpt_pretrain_recipe(const std::string& config) {
  PretrainRecipe recipe;
  recipe.config_name = config;
  recipe.model = decoder_config(config);
  if (config == "tiny" || config == "llama_tiny") {
    // About a minute on two CPU cores.
    recipe.micro_batch = 16, recipe.seq = 128, recipe.lr = 3e-3, recipe.min_lr = 3e-4;
    recipe.trainer.max_steps(1000).log_every_n_steps(100);
    recipe.eval_every = 100;
  } else if (config == "small") {
    recipe.micro_batch = 16, recipe.seq = 256, recipe.lr = 1e-3, recipe.min_lr = 1e-4;
  } else if (std::holds_alternative<LlamaConfig>(recipe.model)) {
    // Llama 3's pretraining: 8192-token sequences, peak lr 3e-4 (8B), decayed to a tenth.
    recipe.micro_batch = 1, recipe.seq = max_seq_len(recipe.model), recipe.lr = 3e-4, recipe.min_lr = 3e-5;
  } else {
    recipe.micro_batch = 8, recipe.seq = max_seq_len(recipe.model), recipe.lr = 6e-4,
    recipe.min_lr = 6e-5;
  }
  if (config != "tiny" && config != "llama_tiny") recipe.eval_every = 1000;  // Megatron's default eval-interval
  recipe.save_dir = "runs/gpt_" + config;
  return recipe;
}

MixedPrecisionOptions precision_from_flags(const std::string& precision, const std::string& fp8,
                                           const torch::Device& device, const std::string& fp8_recipe) {
  std::string name = precision == "auto" ? (device.is_cuda() ? "bf16-mixed" : "32") : precision;
  MixedPrecisionOptions options(name);
  const auto canonical = options.canonical_precision();  // throws naming the accepted values
  TORCH_CHECK(fp8 == "none" || fp8 == "hybrid" || fp8 == "e4m3",
              "fp8 must be \"none\", \"hybrid\" or \"e4m3\", got \"", fp8, "\"");
  const bool with_fp8 = fp8 != "none";
  const bool bf16 = canonical == "bf16-mixed";
  if (bf16 || canonical == "16-mixed") {
    if (!with_fp8) {
      options = bf16 ? bf16_mixed() : fp16_mixed();
    } else if (fp8_recipe == "tensorwise") {
      options = bf16 ? bf16_with_fp8_current_scaling_mixed() : fp16_with_fp8_current_scaling_mixed();
    } else if (fp8_recipe == "blockwise") {
      options = bf16 ? bf16_with_fp8_subchannel_scaling_mixed() : fp16_with_fp8_subchannel_scaling_mixed();
    } else {
      options = bf16 ? bf16_with_fp8_mixed() : fp16_with_fp8_mixed();
    }
  }
  // Any other recipe name is named by validate() ("mxfp8": which GPUs it needs); "32" with FP8
  // is rejected there too. Without FP8 the recipe has nothing to scale: left at its default (a
  // --compare run without +fp8 beside --fp8-recipe for the runs with it).
  return with_fp8 ? options.fp8(fp8).fp8_recipe(fp8_recipe) : options.fp8(fp8);
}

PretrainResult run_pretraining(const PretrainRecipe& recipe, std::ostream& log) {
  // ---- check everything before writing anything ----
  // Under torchrun: data-parallel over ProcessGroupNCCL, this rank on cuda:LOCAL_RANK.
  const auto dist = DistributedEnvironment::from_env();
  const bool data_parallel = dist.has_value() && dist->world_size > 1;
  // Each rank's GPU is cuda:LOCAL_RANK: a device with an index would be replaced, so it is
  // refused with the CPU.
  TORCH_CHECK(!data_parallel || recipe.device == "auto" || recipe.device == "cuda", "device: a torchrun launch "
              "(WORLD_SIZE ", dist->world_size, ") trains data-parallel over NCCL, each rank on cuda:LOCAL_RANK, "
              "and needs --device auto or cuda, got \"", recipe.device, "\"");
  auto device = resolve_device(recipe.device);
  if (data_parallel) {
    TORCH_CHECK(device.is_cuda(), "device: a torchrun launch (WORLD_SIZE ", dist->world_size,
                ") trains data-parallel over NCCL and needs a CUDA GPU; none is available");
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dist->local_rank));
  }
  // Megatron-Core data brings its own vocabulary (padded as Megatron pads it).
  auto model_config = recipe.model;
  TORCH_CHECK(recipe.data_prefix.empty() || recipe.data.empty(), "data and data-prefix cannot be combined");
  TORCH_CHECK(recipe.data_prefix.empty() || recipe.vocab_size >= 1,
              "data-prefix needs the tokenizer's vocabulary size: --vocab-size");
  TORCH_CHECK(recipe.vocab_size == 0 || !recipe.data_prefix.empty(), "vocab-size applies to --data-prefix only "
              "(byte-level data has 256 tokens)");
  if (!recipe.data_prefix.empty()) set_vocab_size(model_config, (recipe.vocab_size + 127) / 128 * 128);
  validate(model_config);
  recipe.precision.validate();
  TORCH_CHECK(recipe.micro_batch >= 1, "micro-batch must be >= 1, got ", recipe.micro_batch);
  TORCH_CHECK(recipe.seq >= 1 && recipe.seq <= max_seq_len(recipe.model), "seq must be in [1, ",
              max_seq_len(recipe.model), "] for config \"", recipe.config_name, "\", got ", recipe.seq);
  TORCH_CHECK(recipe.lr > 0 && std::isfinite(recipe.lr), "lr must be positive, got ", recipe.lr);
  TORCH_CHECK(recipe.min_lr >= 0 && recipe.min_lr <= recipe.lr, "min_lr must be in [0, lr], got ",
              recipe.min_lr);
  TORCH_CHECK(recipe.trainer.max_steps() >= 1, "steps must be >= 1, got ", recipe.trainer.max_steps());
  // What the recipe derives for the trainer from its other fields; a value set there would be
  // replaced, so it is refused, naming the field that decides it.
  const TrainerOptions trainer_defaults;
  for (const auto& [set, field, from] :
       {std::tuple{recipe.trainer.checkpoint_dir() != trainer_defaults.checkpoint_dir(), "checkpoint_dir",
                   "save_dir (checkpoints go to <save_dir>/checkpoints)"},
        std::tuple{recipe.trainer.tokens_per_micro_batch() != trainer_defaults.tokens_per_micro_batch(),
                   "tokens_per_micro_batch", "micro_batch x seq x the data-parallel ranks"},
        std::tuple{recipe.trainer.flops_per_token() != trainer_defaults.flops_per_token(), "flops_per_token",
                   "the model and seq (on a GPU)"},
        std::tuple{recipe.trainer.peak_flops_per_device() != trainer_defaults.peak_flops_per_device(),
                   "peak_flops_per_device", "the GPU's name (on a GPU)"}}) {
    TORCH_CHECK(!set, "recipe.trainer.", field, " is set by run_pretraining from ", from,
                "; leave it at its default");
  }
  TORCH_CHECK(recipe.profile_dir.empty() ||
                  (recipe.profile_first_step >= 0 && recipe.profile_first_step < recipe.trainer.max_steps()),
              "profile-first-step must be in [0, steps) = [0, ", recipe.trainer.max_steps(), "), got ",
              recipe.profile_first_step);
  TORCH_CHECK(recipe.profile_steps >= 1, "profile-steps must be >= 1, got ", recipe.profile_steps);
  AttentionBackendGuard::check(recipe.attention_backend);
  TORCH_CHECK(recipe.trainer.accumulate_grad_batches() >= 1, "grad-accum must be >= 1, got ",
              recipe.trainer.accumulate_grad_batches());
  auto data = recipe.data.empty() ? ByteDataset::builtin() : ByteDataset::from_file(recipe.data);
  TORCH_CHECK(data.size() >= recipe.seq + 1, "data ", data.source(), " has ", data.size(),
              " bytes, fewer than seq + 1 = ", recipe.seq + 1);
  TORCH_CHECK(recipe.eval_every >= 0 && recipe.eval_iters >= 1, "eval-every must be >= 0 and eval-iters >= 1, got ",
              recipe.eval_every, " and ", recipe.eval_iters);
  const int64_t world_size = data_parallel ? dist->world_size : 1;
  std::optional<MegatronData> megatron, megatron_validation;
  if (!recipe.data_prefix.empty()) {
    const int64_t samples = recipe.trainer.max_steps() * recipe.trainer.accumulate_grad_batches() *
                            recipe.micro_batch * world_size;
    megatron.emplace(recipe.data_prefix, recipe.split, recipe.seq, recipe.seed, samples, vocab_size(model_config));
    // The split's validation part, when it has one ("969,30,1" does, "100,0,0" not).
    if (recipe.eval_every > 0 && split_matrix_from_string(recipe.split)[1].has_value()) {
      megatron_validation.emplace(recipe.data_prefix, recipe.split, recipe.seq, recipe.seed,
                                  recipe.eval_iters * recipe.micro_batch * world_size, vocab_size(model_config),
                                  DatasetSplit::kValid);
    }
  }
  // Byte-level text: the last 5% is held out for validation (when it holds a sequence).
  auto [train_bytes, heldout_bytes] = data.split_tail(0.05);
  const bool byte_validation = !megatron && recipe.eval_every > 0 && heldout_bytes.size() >= recipe.seq + 1 &&
                               train_bytes.size() >= recipe.seq + 1;
  if (byte_validation) data = train_bytes;
  TORCH_CHECK(!recipe.save_dir.empty(), "save-dir must not be empty");
  std::error_code error;
  TORCH_CHECK(!fs::exists(recipe.save_dir, error) || fs::is_directory(recipe.save_dir, error),
              "save-dir ", recipe.save_dir, " exists and is not a folder");
  if (!recipe.resume.empty() && !fs::is_directory(recipe.resume, error)) {
    const auto problem = regular_file_problem(recipe.resume, "resume: checkpoint");
    TORCH_CHECK(problem.empty(), problem);
  }
  TORCH_CHECK(recipe.resume.empty() || fs::exists(recipe.resume, error), "resume: ", recipe.resume,
              " does not exist");
  const int rank = data_parallel ? dist->rank : 0, world = data_parallel ? dist->world_size : 1;
  // ---- from here on the save-dir is written ----
  // One run per save-dir at a time (rank 0 holds it for a data-parallel job).
  std::optional<FolderLock> lock;
  if (rank == 0) lock.emplace(recipe.save_dir);
  // A folder that holds a run is continued only when asked (NeMo's AutoResume), never
  // overwritten: its metrics and checkpoints would mix with this run's.
  const auto existing = inspect_run_folder(recipe.save_dir, rank, world);
  TORCH_CHECK(!existing.holds_run() || !recipe.resume.empty() || recipe.resume_if_exists, "save-dir ",
              recipe.save_dir, " already holds a run (", existing.describe(), "); continue it with "
              "--resume ", recipe.save_dir, " (or --resume-if-exists), or start a new run in another "
              "--save-dir (or remove the folder)");
  std::string resume = recipe.resume;
  if (resume.empty() && recipe.resume_if_exists && existing.checkpoints > 0) resume = recipe.save_dir;
  // What fit resumes from: the file given, or the checkpoints folder, whose newest checkpoint
  // that every rank can load fit picks (the ranks agree on one step; it names what it skips).
  // `resume` is then this rank's own pick, for the checks below; with several ranks fit may go
  // back further. Where it is empty (no complete checkpoint), fit stops every rank naming it.
  std::string fit_from = resume;
  if (!resume.empty() && fs::is_directory(resume, error)) {
    const auto checkpoints = fs::path(resume) / "checkpoints";
    fit_from = fs::is_directory(checkpoints, error) ? checkpoints.string() : resume;
    // The save-dir's own pick inspect_run_folder made (each file it checks is read whole once).
    const bool own_folder = fs::equivalent(fit_from, fs::path(recipe.save_dir) / "checkpoints", error);
    resume = own_folder ? existing.newest_checkpoint : Trainer::latest_checkpoint(fit_from, rank, world);
  }
  // A run continues in its own folder: another folder's checkpoint resumed into one that holds
  // a run would splice the two runs' metrics and checkpoints. And from its newest checkpoint:
  // resumed from an older one, the newer ones would stay, and a later --resume of the folder
  // would pick them and drop what this run trains.
  if (existing.holds_run() && !resume.empty()) {
    const auto folder = fs::weakly_canonical(recipe.save_dir, error);
    const auto file = fs::weakly_canonical(resume, error);
    TORCH_CHECK(std::mismatch(folder.begin(), folder.end(), file.begin(), file.end()).first == folder.end(),
                "resume: ", resume, " is not in save-dir ", recipe.save_dir, ", which holds another run (",
                existing.describe(), "); resume a run in its own folder (--resume ", recipe.save_dir,
                "), or into a new --save-dir");
    const auto& newest = existing.newest_checkpoint;
    TORCH_CHECK(newest.empty() || fs::weakly_canonical(newest, error) == file, "resume: ", resume,
                " is older than ", newest, " in the same save-dir; resuming from it would leave the newer "
                "checkpoints to a later --resume of the folder. Move the newer ones away first, or resume "
                "into a new --save-dir");
  }

  // ---- build ----
  fs::create_directories(fs::path(recipe.save_dir) / "checkpoints", error);
  TORCH_CHECK(!error, "cannot create save-dir ", recipe.save_dir, ": ", error.message());
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  if (data_parallel) group = init_process_group(*dist);
  // Every rank builds the same initial model from the seed; only rank 0 prints and writes the
  // metrics and the picture (each rank writes its own checkpoint shard).
  std::ostream null_stream(nullptr);
  std::ostream& out = rank == 0 ? log : null_stream;
  if (fit_from.empty() && recipe.resume_if_exists && existing.holds_run()) {
    out << "gpt_pretrain: --resume-if-exists: " << recipe.save_dir << " holds no checkpoint to resume ("
        << existing.describe() << "); the run starts again from step 0 and replaces its metrics" << std::endl;
  }
  torch::manual_seed(recipe.seed);
  const Decoder model = [&] {
    std::optional<Fp8ModelInit> fp8_init;
    if (recipe.precision.fp8_params()) {
      fp8_init.emplace(true, true, recipe.precision.num_layers_at_start_in_bf16(),
                       recipe.precision.num_layers_at_end_in_bf16());
    }
    return Decoder(model_config);
  }();
  model.module().to(device);
  torch::optim::AdamW optimizer(model.module().parameters(), torch::optim::AdamWOptions(recipe.lr)
                                                         .betas({0.9, 0.95})
                                                         .weight_decay(recipe.weight_decay));
  auto trainer_options = recipe.trainer;
  trainer_options.checkpoint_dir((fs::path(recipe.save_dir) / "checkpoints").string());
  // Tokens of one micro-batch over all ranks (the progress line's tokens/s is the job's).
  const int64_t tokens_per_micro_batch = recipe.micro_batch * recipe.seq * world;
  trainer_options.tokens_per_micro_batch(tokens_per_micro_batch);
  const double flops_per_token = model.flops_per_token(recipe.seq);
  if (device.is_cuda()) {  // the progress line's TFLOP/s per GPU and MFU
    trainer_options.flops_per_token(flops_per_token)
        .peak_flops_per_device(dense_bf16_peak_flops(cuda_device_name(device.index() < 0 ? 0 : device.index())));
  }
  auto plugin = std::make_shared<MixedPrecisionPlugin>(recipe.precision);
  if (group) {
    plugin->set_process_group(group, DistributedOptimizerOptions()
                                         .overlap_grad_reduce(recipe.overlap_grad_reduce)
                                         .overlap_param_gather(recipe.overlap_param_gather)
                                         .bucket_size(recipe.bucket_size));
  }
  Trainer trainer(trainer_options, plugin);
  trainer.log = &out;
  // What an exact resume needs besides the state (the precision is checked by the Trainer).
  trainer.run_settings = {
      {"config", recipe.config_name},
      {"seed", std::to_string(recipe.seed)},
      {"data", megatron ? megatron->fingerprint() : data.fingerprint()},
      {"seq", std::to_string(recipe.seq)},
      {"micro_batch", std::to_string(recipe.micro_batch)},
      {"grad_accum", std::to_string(trainer_options.accumulate_grad_batches())},
      {"data_parallel_size", std::to_string(world)},
      {"steps", std::to_string(trainer_options.max_steps())},
      {"lr", c10::str(recipe.lr)},
      {"min_lr", c10::str(recipe.min_lr)},
      {"warmup_steps", std::to_string(recipe.warmup_steps)},
      {"weight_decay", c10::str(recipe.weight_decay)},
      {"gradient_clip_val", c10::str(trainer_options.gradient_clip_val())},
      {"exp_avg_dtype", c10::toString(recipe.precision.exp_avg_dtype())},
      {"exp_avg_sq_dtype", c10::toString(recipe.precision.exp_avg_sq_dtype())},
  };
  // Megatron data: step s reads the samples from s x the global batch on, in an order that
  // follows from each prefix's epoch count (sample_order); a resume that changed either would
  // read some samples twice and skip others.
  if (megatron) {
    trainer.run_settings["global_batch"] =
        std::to_string(recipe.micro_batch * trainer_options.accumulate_grad_batches() * world);
    trainer.run_settings["data_order"] = megatron->sample_order();
  }
  // Byte-level data validated on its last 5% trains on the rest: name that, not just "data".
  if (!megatron) trainer.run_settings["validation_holdout"] = byte_validation ? "the last 5% of the data" : "none";
  if (recipe.precision.fp8_enabled()) {  // the recipe itself is in the precision's name
    const auto& p = recipe.precision;
    trainer.run_settings.insert({{"fp8_margin", std::to_string(p.fp8_margin())},
                                 {"fp8_amax_history_len", std::to_string(p.fp8_amax_history_len())},
                                 {"fp8_amax_compute_algo", p.fp8_amax_compute_algo()},
                                 {"fp8_min_gemm_size", std::to_string(p.fp8_min_gemm_size())},
                                 {"num_layers_at_start_in_bf16", std::to_string(p.num_layers_at_start_in_bf16())},
                                 {"num_layers_at_end_in_bf16", std::to_string(p.num_layers_at_end_in_bf16())}});
    // The scale FP8 weights are written at: the other one writes other bytes from the same masters.
    if (p.fp8_params()) trainer.run_settings["fp8_params_scaling"] = p.fp8_params_scaling();
  }
  // The dtype gradients are summed in: across ranks, and across micro-batches on one GPU.
  if (world > 1 || trainer_options.accumulate_grad_batches() > 1) {
    trainer.run_settings["grad_reduce_in_fp32"] = recipe.precision.grad_reduce_in_fp32() ? "true" : "false";
  }
  for (const auto& name : recipe.allow_changes) {
    TORCH_CHECK(trainer.run_settings.count(name) > 0, "allow-changes: unknown setting \"", name,
                "\"; the settings a checkpoint records are ", [&] {
                  std::string names;
                  for (const auto& [key, value] : trainer.run_settings) names += (names.empty() ? "" : ", ") + key;
                  return names;
                }());
  }
  trainer.changeable_settings = recipe.allow_changes;
  trainer.changeable_settings_hint = "--allow-changes with their names";
  StopOnSignal stop_on_signal(trainer);
  auto schedule = std::make_shared<LearningRateSchedule>(optimizer, recipe);
  const auto metrics_path = (fs::path(recipe.save_dir) / "metrics.jsonl").string();
  trainer.callbacks.push_back(schedule);
  auto timer = std::make_shared<StepTimer>();
  trainer.callbacks.push_back(timer);
  std::shared_ptr<CommunicationTimer> communication;
  if (group && device.is_cuda()) {
    communication = std::make_shared<CommunicationTimer>(*plugin);
    trainer.callbacks.push_back(communication);
  }
  if (!recipe.profile_dir.empty()) {
    const auto dir = rank == 0 ? fs::path(recipe.profile_dir) : fs::path(recipe.profile_dir) / ("rank" + std::to_string(rank));
    trainer.callbacks.push_back(
        std::make_shared<StepProfiler>(dir.string(), recipe.profile_first_step, recipe.profile_steps));
  }
  std::shared_ptr<Evaluator> evaluator;
  if (byte_validation || megatron_validation) {
    const auto heldout = heldout_bytes;
    const auto* valid = megatron_validation ? &*megatron_validation : nullptr;
    evaluator = std::make_shared<Evaluator>(
        recipe.eval_every, recipe.eval_iters,
        [&, heldout, valid](int64_t k) {
          return valid != nullptr ? valid->batch(k * world + rank, recipe.micro_batch, device)
                                  : heldout.batch(recipe.seed + 1, /*step=*/k, /*micro_batch=*/rank, recipe.micro_batch,
                                                  recipe.seq, device);
        },
        model, vocab_size(model_config), out);
    trainer.callbacks.push_back(evaluator);
  } else if (recipe.eval_every > 0) {
    out << "gpt_pretrain: no validation: " << (megatron ? "the split " + recipe.split + " has no validation part"
                                                         : "the held-out 5% of the data is shorter than a sequence")
        << std::endl;
  }
  if (rank == 0) {
    trainer.callbacks.push_back(std::make_shared<MetricsWriter>(
        metrics_path, *schedule, tokens_per_micro_batch * trainer_options.accumulate_grad_batches(),
        flops_per_token / static_cast<double>(world), trainer_options.peak_flops_per_device(),
        evaluator.get()));
  }

  out << "gpt_pretrain: config " << recipe.config_name << " (" << model.parameter_count() / 1e6
      << " M parameters), precision " << trainer.plugins->name() << ", device " << device
      << ", data " << (megatron ? megatron->source() : data.source() + " (" + std::to_string(data.size()) + " bytes)")
      << ", " << trainer_options.max_steps()
      << " steps of " << trainer_options.accumulate_grad_batches() << " x " << recipe.micro_batch
      << " x " << recipe.seq << " tokens" << (world > 1 ? " on each of " + std::to_string(world) + " data-parallel ranks" : "")
      << (fit_from.empty() ? ""
          : fit_from == resume || (world == 1 && !resume.empty())
              ? ", resuming from " + resume
              : ", resuming from the newest complete checkpoint in " + fit_from +
                    (world > 1 ? " that every rank can load" : ""));
  if (const auto& r = recompute(model_config); r.method() != RecomputeMethod::kNone) {
    out << ", activations recomputed (" << to_string(r.method()) << ", " << r.num_layers() << " layer"
        << (r.num_layers() == 1 ? "" : "s") << ")";
  }
  if (const AdamMomentDtypes moments{recipe.precision.exp_avg_dtype(), recipe.precision.exp_avg_sq_dtype()};
      !moments.is_float32()) {
    out << ", Adam moments in " << c10::toString(moments.exp_avg) << " / " << c10::toString(moments.exp_avg_sq);
  }
  out << std::endl;
#ifdef AMP8_HAS_CUDA_ALLOCATOR
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
#endif

  const AttentionBackendGuard attention_backend(recipe.attention_backend);
  const Fp8GemmAlgoSelectionGuard gemm_algorithms(recipe.fp8_gemm_autotune ? Fp8GemmAlgoSelection::kFastestMeasured
                                                                            : Fp8GemmAlgoSelection::kHeuristic);
  const auto vocab = vocab_size(model_config);
  const auto start = std::chrono::steady_clock::now();
  // The host part (the micro-batch's tokens, on the device) and the device part (the loss):
  // split so that --cuda-graph can capture the second once and replay it.
  GraphableStep step;
  step.batch = [&](const TrainStepInput& in) {
    // Rank r draws micro-batches r·A … r·A + A−1 of the step's global batch.
    const int64_t micro = rank * trainer_options.accumulate_grad_batches() + in.micro_batch;
    auto [inputs, targets] =
        megatron ? megatron->batch((in.step * trainer_options.accumulate_grad_batches() + in.micro_batch) * world + rank,
                                   recipe.micro_batch, device)
                 : data.batch(recipe.seed, in.step, micro, recipe.micro_batch, recipe.seq, device);
    return std::vector<torch::Tensor>{inputs, targets};
  };
  step.loss = [&](const std::vector<torch::Tensor>& batch, PrecisionPlugin& precision) {
    auto logits = precision.convert_output(model.forward(precision.convert_input(batch[0])));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}), batch[1].reshape({-1}));
  };
  trainer.fit(model.module(), optimizer, step, fit_from);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  PretrainResult result;
  result.rank = rank;
  result.stopped = trainer.stopped();
  result.stop_signal = stop_on_signal.received();
  result.last_checkpoint = trainer.last_checkpoint();
  result.start_step = trainer.global_step() - static_cast<int64_t>(trainer.history().size());
  result.nothing_to_do = trainer.history().empty() && !trainer.stopped();
  result.history = trainer.history();
  result.parameters = model.parameter_count();
  result.precision = trainer.plugins->name();
  result.metrics_path = metrics_path;
  if (evaluator) {
    result.validation = evaluator->points();
    result.final_val_loss = evaluator->points().empty() ? NAN : evaluator->points().back().second;
  }
  const size_t tail = std::min<size_t>(10, result.history.size());
  if (tail == 0) result.final_loss = std::numeric_limits<double>::quiet_NaN();
  for (size_t i = result.history.size() - tail; i < result.history.size(); ++i) {
    result.final_loss += result.history[i].loss / static_cast<double>(tail);
  }
  result.tokens_per_s = seconds > 0 ? static_cast<double>(result.history.size()) *
                                          static_cast<double>(tokens_per_micro_batch) *
                                          static_cast<double>(trainer_options.accumulate_grad_batches()) / seconds
                                    : 0.0;
  const double step_seconds = timer->steady_step_seconds();
  result.steady_tokens_per_s =
      step_seconds > 0 ? static_cast<double>(tokens_per_micro_batch * trainer_options.accumulate_grad_batches()) / step_seconds
                       : 0.0;
#ifdef AMP8_HAS_CUDA_ALLOCATOR
  if (device.is_cuda()) {
    const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    const auto allocated =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index())
            .allocated_bytes[aggregate];
    result.peak_memory_bytes = static_cast<double>(allocated.peak);
    result.resident_memory_bytes = static_cast<double>(allocated.current);
  }
#endif
  if (communication) {
    const auto steady = communication->steady();
    result.reduce_wait_ms = steady.reduce_ms;
    result.gather_wait_ms = steady.gather_ms;
    result.reduce_bytes = static_cast<double>(steady.reduce_bytes);
    result.gather_bytes = static_cast<double>(steady.gather_bytes);
    if (rank == 0) {
      out << "gpt_pretrain: data-parallel communication per step (median of the second half): "
          << "waited " << result.reduce_wait_ms << " ms for the reduce-scatter of "
          << result.reduce_bytes / 1e6 << " MB after the backward pass (overlap_grad_reduce "
          << (recipe.overlap_grad_reduce ? "on" : "off") << ", buckets of " << recipe.bucket_size
          << " elements), " << result.gather_wait_ms << " ms for the all-gather of "
          << result.gather_bytes / 1e6 << " MB ("
          << (recipe.overlap_param_gather ? "overlap_param_gather on: what the forward pass did not hide"
                                          : "after the step")
          << ")" << std::endl;
    }
  }
  result.picture_path = (fs::path(recipe.save_dir) / "loss.svg").string();
  if (group) group->shutdown();  // NCCL's communicators, before the process exits
  if (rank == 0) write_loss_svg(result.picture_path, {read_loss_curve(result.precision, metrics_path)},
                 recipe.config_name + " pretraining loss (" + result.precision + ")");
  return result;
}

}  // namespace amp8::recipes
