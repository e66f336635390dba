#include "plugin/training/trainer.h"

// The Trainer's checkpoint files: their names, what one holds, saving (atomically, through
// plugin/training/checkpoint.h), loading (checked, undone on failure) and finding the newest.

#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/StringUtil.h>
#include <torch/cuda.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <regex>
#include <sstream>
#include <tuple>

#include "plugin/modules/fp8_layer_norm.h"
#include "plugin/modules/fp8_linear.h"
#include "plugin/training/checkpoint.h"

namespace amp8 {
namespace {

constexpr int64_t kCheckpointVersion = 1;
// Trainer::run_settings in the trainer archive: "setting.<name>" -> the value as a string.
const std::string kSettingPrefix = "setting.";

std::vector<at::Generator> default_generators() {
  std::vector<at::Generator> generators{at::detail::getDefaultCPUGenerator()};
  const auto cuda_devices = static_cast<int64_t>(torch::cuda::device_count());
  for (int64_t i = 0; i < cuda_devices; ++i) {
    generators.push_back(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, i)));
  }
  return generators;
}

void save_rng_states(torch::serialize::OutputArchive& archive) {
  const auto generators = default_generators();
  archive.write("num_rng_states", torch::tensor({static_cast<int64_t>(generators.size())}));
  for (size_t i = 0; i < generators.size(); ++i) {
    auto generator = generators[i];
    std::lock_guard<std::mutex> lock(generator.mutex());
    archive.write("rng_state." + std::to_string(i), generator.get_state());
  }
}

void load_rng_states(torch::serialize::InputArchive& archive) {
  torch::Tensor count;
  TORCH_CHECK(archive.try_read("num_rng_states", count), "checkpoint: the trainer state has no RNG states");
  auto generators = default_generators();
  // A checkpoint from a machine with another GPU count restores what both have.
  const auto n = std::min<int64_t>(count.item<int64_t>(), generators.size());
  for (int64_t i = 0; i < n; ++i) {
    torch::Tensor state;
    TORCH_CHECK(archive.try_read("rng_state." + std::to_string(i), state),
                "checkpoint: RNG state ", i, " is missing");
    std::lock_guard<std::mutex> lock(generators[i].mutex());
    generators[i].set_state(state);
  }
}

// Where the missing piece belongs to an FP8 module that convert_module put into a Sequential
// (the only place it fuses), the likely cause: a checkpoint of the other module layout. The same
// modules built by a model itself (GptModel's) get no hint: fusion does not rename them.
std::string fusion_hint(const torch::nn::Module& module, const torch::nn::Module* parent) {
  const bool converted = dynamic_cast<const Fp8LayerNormLinearImpl*>(&module) != nullptr ||
                         dynamic_cast<const Fp8LayerNormMLPImpl*>(&module) != nullptr ||
                         dynamic_cast<const Fp8LinearImpl*>(&module) != nullptr ||
                         dynamic_cast<const Fp8LayerNormImpl*>(&module) != nullptr;
  const bool in_sequential =
      parent != nullptr && dynamic_cast<const torch::nn::SequentialImpl*>(parent) != nullptr;
  return converted && in_sequential
             ? " (under FP8, convert_module fuses a Sequential's LayerNorm -> Linear (-> GELU(tanh) -> "
               "Linear) into one module, which changes the module names: a checkpoint of the other "
               "layout, saved before amp8 fused these runs or with another fp8_fuse_modules, loads "
               "with the fp8_fuse_modules of the run that saved it)"
             : "";
}

// Every parameter and buffer of `module` (recursively) must be in the archive with its shape
// and dtype: torch's loader would silently take another shape. `parent` holds `module` (null
// for the model).
void check_module_archive(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                          const std::string& path, const std::string& prefix,
                          const torch::nn::Module* parent = nullptr) {
  auto check = [&](const std::string& name, const torch::Tensor& expected, bool is_buffer) {
    if (!expected.defined()) return;
    torch::Tensor stored;
    TORCH_CHECK(archive.try_read(name, stored, is_buffer), "checkpoint ", path, ": ",
                prefix + name, " is missing", fusion_hint(module, parent));
    TORCH_CHECK(stored.sizes() == expected.sizes() && stored.scalar_type() == expected.scalar_type(),
                "checkpoint ", path, ": ", prefix + name, " is ", stored.scalar_type(), " ",
                stored.sizes(), ", the model's is ", expected.scalar_type(), " ", expected.sizes());
  };
  for (const auto& item : module.named_parameters(/*recurse=*/false)) check(item.key(), item.value(), false);
  for (const auto& item : module.named_buffers(/*recurse=*/false)) check(item.key(), item.value(), true);
  for (const auto& item : module.named_children()) {
    torch::serialize::InputArchive child;
    TORCH_CHECK(archive.try_read(item.key(), child), "checkpoint ", path, ": module ",
                prefix + item.key(), " is missing", fusion_hint(module, parent));
    check_module_archive(*item.value(), child, path, prefix + item.key() + ".", &module);
  }
}

// The state a load changes, kept in memory so a failed load can be undone.
class Snapshot {
 public:
  Snapshot(torch::nn::Module& model, torch::optim::Optimizer& optimizer, PrecisionPlugin& plugin) {
    torch::NoGradGuard no_grad;
    for (const auto& t : model.parameters()) tensors_.emplace_back(t, t.detach().clone());
    for (const auto& t : model.buffers()) tensors_.emplace_back(t, t.detach().clone());
    optimizer_ = serialize([&](auto& archive) { optimizer.save(archive); });
    plugin_ = serialize([&](auto& archive) { plugin.save(archive); });
  }
  void restore(torch::nn::Module& model, torch::optim::Optimizer& optimizer, PrecisionPlugin& plugin) {
    torch::NoGradGuard no_grad;
    for (auto& [target, saved] : tensors_) target.set_data(saved);
    torch::serialize::InputArchive optimizer_archive, plugin_archive;
    optimizer_archive.load_from(optimizer_.data(), optimizer_.size());
    optimizer.load(optimizer_archive);
    plugin_archive.load_from(plugin_.data(), plugin_.size());
    plugin.load(plugin_archive);
  }

 private:
  template <typename Fn>
  static std::string serialize(Fn&& fill) {
    torch::serialize::OutputArchive archive;
    fill(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    return bytes.str();
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> tensors_;
  std::string optimizer_, plugin_;
};

}  // namespace

bool Trainer::saves_last() const { return options.save_last() && !options.checkpoint_dir().empty(); }

std::string Trainer::step_checkpoint_path() const {
  const auto name = checkpoint_name(global_step_, plugins->data_parallel_rank(), plugins->data_parallel_size());
  return (std::filesystem::path(options.checkpoint_dir()) / name).string();
}

void Trainer::save_step_checkpoint(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  const auto path = step_checkpoint_path();
  try {
    save_checkpoint(path, model, optimizer);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "Trainer: the checkpoint of step ", global_step_, " could not be saved; the "
                "training state is intact in memory and the earlier checkpoints are untouched",
                last_checkpoint_.empty() ? std::string() : " (newest: " + last_checkpoint_ + ")", ": ",
                e.what_without_backtrace());
  }
  last_checkpoint_ = path;
  for (auto& callback : callbacks) callback->on_save_checkpoint(*this, path);
}

std::string Trainer::save_last_good_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  if (!saves_last() && options.every_n_train_steps() == 0) return "";
  const auto path = step_checkpoint_path();
  if (std::filesystem::exists(path)) return " (saved in " + path + ")";
  try {
    save_step_checkpoint(model, optimizer);
  } catch (const c10::Error& e) {
    return " (saving them failed: " + std::string(e.what_without_backtrace()) + ")";
  }
  return " (saved in " + path + ")";
}

torch::serialize::OutputArchive Trainer::checkpoint_archive(torch::nn::Module& model,
                                                            torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive, plugin_archive,
      trainer_archive;
  plugins->finish_param_gather();  // the parameters a step left in flight, final before they are read
  archive.write("amp8_checkpoint_version", torch::tensor({kCheckpointVersion}));
  model.save(model_archive);
  optimizer.save(optimizer_archive);
  plugins->save(plugin_archive);
  trainer_archive.write("global_step", torch::tensor({global_step_}));
  trainer_archive.write("precision", c10::IValue(plugins->name()));
  for (const auto& [name, value] : run_settings) {
    trainer_archive.write(kSettingPrefix + name, c10::IValue(value));
  }
  save_rng_states(trainer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("plugin", plugin_archive);
  archive.write("trainer", trainer_archive);
  return archive;
}

std::string Trainer::save_checkpoint(const std::string& path, torch::nn::Module& model,
                                     torch::optim::Optimizer& optimizer) {
  auto archive = checkpoint_archive(model, optimizer);
  save_atomically(archive, path);
  return path;
}

void Trainer::load_checkpoint(const std::string& path, torch::nn::Module& model,
                              torch::optim::Optimizer& optimizer) {
  connect(model, optimizer);
  plugins->finish_param_gather();  // no all-gather may write the parameters the load replaces
  torch::serialize::InputArchive archive, model_archive, optimizer_archive, plugin_archive,
      trainer_archive;
  load_archive(archive, path);
  torch::Tensor version, step;
  TORCH_CHECK(archive.try_read("amp8_checkpoint_version", version),
              "checkpoint ", path, " is not an amp8 checkpoint (no amp8_checkpoint_version)");
  TORCH_CHECK(version.item<int64_t>() == kCheckpointVersion, "checkpoint ", path, " has version ",
              version.item<int64_t>(), ", this amp8 reads version ", kCheckpointVersion);
  TORCH_CHECK(archive.try_read("model", model_archive) &&
                  archive.try_read("optimizer", optimizer_archive) &&
                  archive.try_read("plugin", plugin_archive) &&
                  archive.try_read("trainer", trainer_archive),
              "checkpoint ", path, " lacks one of model / optimizer / plugin / trainer");
  TORCH_CHECK(trainer_archive.try_read("global_step", step), "checkpoint ", path,
              " lacks trainer/global_step");
  c10::IValue precision;
  TORCH_CHECK(trainer_archive.try_read("precision", precision) && precision.isString(),
              "checkpoint ", path, " lacks trainer/precision");
  TORCH_CHECK(precision.toStringRef() == plugins->name(), "checkpoint ", path,
              ": the checkpoint was written with precision \"", precision.toStringRef(),
              "\", this plugin is \"", plugins->name(), "\"");
  std::string differences;
  for (const auto& [name, value] : run_settings) {
    c10::IValue stored;
    if (!trainer_archive.try_read(kSettingPrefix + name, stored) || !stored.isString()) continue;
    if (stored.toStringRef() == value || changeable_settings.count(name) > 0) continue;
    differences += (differences.empty() ? "" : ", ") + name + " " + stored.toStringRef() +
                   " (this run: " + value + ")";
  }
  TORCH_CHECK(differences.empty(), "checkpoint ", path, " was written with other settings: ",
              differences, "; an exact resume needs the same ones (to resume anyway, allow them by "
              "name: ", changeable_settings_hint, ")");
  check_module_archive(model, model_archive, path, "");
  // Written by another number of data-parallel ranks: every rank's file of that step.
  const int written_by = plugins->checkpoint_world_size(plugin_archive);
  const int rank = plugins->data_parallel_rank(), world_size = plugins->data_parallel_size();
  std::vector<torch::serialize::InputArchive> shard_plugins, shard_optimizers;
  torch::serialize::InputArchive rng_archive;
  if (written_by != world_size) {
    const auto folder = std::filesystem::path(path).parent_path();
    const auto name = std::filesystem::path(path).filename().string();
    const auto parsed = parse_checkpoint_name(name);
    TORCH_CHECK(parsed.has_value() && parsed->step == step.item<int64_t>() && parsed->world_size == written_by,
                "checkpoint ", path, " was written by ", written_by, " data-parallel rank(s), this run has ",
                world_size, "; its other ranks' files are found by the names the Trainer gives them (",
                checkpoint_name(step.item<int64_t>(), 0, written_by), ", ...), and this file is named otherwise");
    for (int j = 0; j < written_by; ++j) {
      const auto shard_path = (folder / checkpoint_name(step.item<int64_t>(), j, written_by)).string();
      torch::serialize::InputArchive shard, shard_plugin, shard_optimizer, shard_trainer;
      load_archive(shard, shard_path);
      torch::Tensor shard_step;
      TORCH_CHECK(shard.try_read("plugin", shard_plugin) && shard.try_read("optimizer", shard_optimizer) &&
                      shard.try_read("trainer", shard_trainer) && shard_trainer.try_read("global_step", shard_step) &&
                      shard_step.item<int64_t>() == step.item<int64_t>(),
                  "checkpoint ", shard_path, " is not a file of the same checkpoint as ", path);
      shard_plugins.push_back(std::move(shard_plugin));
      shard_optimizers.push_back(std::move(shard_optimizer));
      // The random state of rank (this rank mod N): data order and dropout continue as one of
      // the old ranks' would (an exact resume needs the same world size).
      if (j == rank % written_by) rng_archive = std::move(shard_trainer);
    }
  }
  // Everything or nothing: the state before the load is kept (in memory) until the load is
  // through, and put back if any part of it throws.
  Snapshot snapshot(model, optimizer, *plugins);
  try {
    if (written_by == world_size) {
      plugins->load(plugin_archive);  // checks the precision and the masters first
      model.load(model_archive);
      optimizer.load(optimizer_archive);
      load_rng_states(trainer_archive);
    } else {
      model.load(model_archive);  // first: a float32 parameter may have been its own master
      plugins->load_resharded(shard_plugins, shard_optimizers, optimizer);
      load_rng_states(rng_archive);
    }
  } catch (const c10::Error& e) {
    snapshot.restore(model, optimizer, *plugins);
    TORCH_CHECK(false, "checkpoint ", path, " could not be loaded, nothing was changed: ",
                e.what_without_backtrace());
  } catch (const std::exception& e) {  // LibTorch's readers throw std::runtime_error too
    snapshot.restore(model, optimizer, *plugins);
    TORCH_CHECK(false, "checkpoint ", path, " could not be loaded, nothing was changed: ", e.what());
  }
  global_step_ = step.item<int64_t>();
}

std::string Trainer::checkpoint_name(int64_t step, int rank, int world_size) {
  char name[64];
  if (world_size <= 1) {
    std::snprintf(name, sizeof(name), "step_%08lld.ckpt", static_cast<long long>(step));
  } else {
    std::snprintf(name, sizeof(name), "step_%08lld-rank%d-of-%d.ckpt", static_cast<long long>(step), rank,
                  world_size);
  }
  return name;
}

std::optional<Trainer::CheckpointName> Trainer::parse_checkpoint_name(const std::string& name) {
  // The digit counts keep std::stoll in range for any name a folder may hold.
  static const std::regex pattern(R"(step_(\d{1,18})(?:-rank(\d{1,10})-of-(\d{1,10}))?\.ckpt)");
  std::smatch match;
  if (!std::regex_match(name, match, pattern)) return std::nullopt;
  const int64_t rank = match[2].matched ? std::stoll(match[2].str()) : 0;
  const int64_t world_size = match[3].matched ? std::stoll(match[3].str()) : 1;
  if (world_size < 1 || world_size > std::numeric_limits<int>::max() || rank >= world_size ||
      (match[3].matched && world_size == 1)) {
    return std::nullopt;
  }
  return CheckpointName{std::stoll(match[1].str()), static_cast<int>(rank), static_cast<int>(world_size)};
}

std::string Trainer::latest_checkpoint(const std::string& folder, int rank, int world_size,
                                       std::vector<std::string>* skipped, int64_t at_most_step) {
  // Every checkpoint in the folder: (step, world size that wrote it) -> the ranks' files.
  std::map<std::pair<long long, int>, std::map<int, std::string>> checkpoints;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(folder, error)) {
    if (!entry.is_regular_file(error)) continue;
    const auto parsed = parse_checkpoint_name(entry.path().filename().string());
    if (parsed && parsed->step <= at_most_step) {
      checkpoints[{parsed->step, parsed->world_size}][parsed->rank] = entry.path().string();
    }
  }
  // Newest step first; at one step, one written by this world size first.
  std::vector<std::pair<long long, int>> order;
  for (const auto& [key, files] : checkpoints) order.push_back(key);
  std::sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first > b.first;
    return (a.second == std::max(world_size, 1)) > (b.second == std::max(world_size, 1));
  });
  for (const auto& key : order) {
    const auto& files = checkpoints[key];
    const int writers = key.second;
    if (writers == std::max(world_size, 1)) {
      // Same world size: this rank's own file, intact, and every other rank's file there. A
      // file is renamed into place whole, so one that is there was written to its end; one
      // that is missing (a run stopped between the ranks' saves) makes every rank pass over
      // the step alike, where only the ranks without a file would otherwise go back.
      std::string problem;
      for (int j = 0; j < writers && problem.empty(); ++j) {
        if (files.count(j) == 0) {
          problem = (std::filesystem::path(folder) / checkpoint_name(key.first, j, writers)).string() + " is missing";
        }
      }
      if (problem.empty()) {
        const auto& own = files.at(writers == 1 ? 0 : rank);
        problem = checkpoint_file_problem(own);
        if (problem.empty()) return own;
      }
      if (skipped != nullptr) skipped->push_back(problem);
      continue;
    }
    // Another world size: every rank's file, intact (load_checkpoint reads them all).
    std::string problem;
    for (int j = 0; j < writers && problem.empty(); ++j) {
      const auto file = files.find(j);
      problem = file == files.end()
                    ? (std::filesystem::path(folder) / checkpoint_name(key.first, j, writers)).string() + " is missing"
                    : checkpoint_file_problem(file->second);
    }
    if (problem.empty()) return files.at(0);
    if (skipped != nullptr) skipped->push_back(problem);
  }
  return "";
}

std::string Trainer::agreed_latest_checkpoint(const std::string& folder, PrecisionPlugin& plugin,
                                              const torch::Device& device, std::ostream& log) {
  const int rank = plugin.data_parallel_rank(), world = plugin.data_parallel_size();
  // The pick's step and the world size that wrote it ({-1, 0}: none).
  auto pick = [](const std::string& path) -> std::pair<int64_t, int64_t> {
    if (path.empty()) return {-1, 0};
    const auto name = parse_checkpoint_name(std::filesystem::path(path).filename().string());
    return {name->step, name->world_size};
  };
  // Every rank's pick, through the one collective a plugin has: rank r's values in slots r and
  // world + r of zeros, averaged, times the world size (exact for values below 2^50).
  auto every_rank = [&](std::pair<int64_t, int64_t> mine) {
    auto slots = torch::zeros({2 * world}, torch::dtype(torch::kDouble));
    slots[rank] = static_cast<double>(mine.first);
    slots[world + rank] = static_cast<double>(mine.second);
    const auto mean = plugin.data_parallel_mean(slots.to(device)).cpu();
    std::vector<int64_t> steps(world), writers(world);
    for (int r = 0; r < world; ++r) {
      steps[r] = std::llround(mean[r].item<double>() * world);
      writers[r] = std::llround(mean[world + r].item<double>() * world);
    }
    return std::pair{steps, writers};
  };
  auto all_equal = [](const std::vector<int64_t>& v) {
    return std::all_of(v.begin(), v.end(), [&](int64_t x) { return x == v.front(); });
  };
  std::vector<std::string> skipped;
  std::string path = latest_checkpoint(folder, rank, world, &skipped);
  bool went_back = !skipped.empty();
  auto log_skipped = [&] {
    for (const auto& line : skipped) log << "Trainer: skipping checkpoint " << line << std::endl;
    skipped.clear();
  };
  log_skipped();
  if (world > 1) {
    // Each round every rank's step is at most the oldest of the last round's: the oldest falls
    // until all agree (or some rank has none left), the same number of rounds on every rank.
    std::string bound = "";  // " at or below step N" after the first round
    std::vector<int64_t> steps, writers;
    for (std::tie(steps, writers) = every_rank(pick(path)); !all_equal(steps);
         std::tie(steps, writers) = every_rank(pick(path))) {
      const auto oldest = std::min_element(steps.begin(), steps.end());
      TORCH_CHECK(*oldest >= 0, "Trainer::fit: data-parallel rank ", oldest - steps.begin(),
                  " has no complete checkpoint in ", folder, bound, " that it can load (the ranks' picks: steps ",
                  c10::Join(", ", steps), ", -1 for none); every rank must resume from one step");
      bound = c10::str(" at or below step ", *oldest);
      if (pick(path).first == *oldest) continue;
      log << "Trainer: the data-parallel ranks would resume from steps " << c10::Join(", ", steps) << "; rank "
          << rank << " goes back to step " << *oldest << " or before, with them" << std::endl;
      path = latest_checkpoint(folder, rank, world, &skipped, *oldest);
      log_skipped();
      went_back = true;
    }
    // One step, but not one checkpoint: files of that step written by two world sizes, a rank
    // whose own file is corrupt taking the other's (rebuilt from them while the others load
    // their shards). Not resumed from a mix.
    TORCH_CHECK(all_equal(writers), "Trainer::fit: at step ", steps.front(), " in ", folder,
                " the data-parallel ranks would load checkpoints written by different numbers of ranks (",
                c10::Join(", ", writers), "): a rank's own file of the step is unreadable, and a checkpoint of the "
                "same step written by another world size is there; move one of the two away");
  }
  if (went_back && !path.empty()) log << "Trainer: resuming from the previous complete checkpoint " << path << std::endl;
  return path;
}

}  // namespace amp8
