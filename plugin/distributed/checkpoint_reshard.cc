#include "plugin/distributed/distributed_optimizer.h"

// DistributedOptimizer's checkpoint layout, and loading a checkpoint written by another number
// of ranks.
//
// A torch::optim archive holds "state" (one sub-archive per parameter, keyed by the address of
// the parameter's TensorImpl when it was saved, each field an IValue) and "param_groups" (per
// group the keys of its parameters, in order, and the group's options). The layout tells which
// piece of which parameter each saved key was. load_resharded builds the archive this rank's
// optimizer would have saved: its own masters' keys, each piece's fields cut from the saved
// pieces that overlap it, the options of rank 0's file; then hands it to optimizer.load().

#include <torch/torch.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <utility>

namespace amp8 {
namespace {

// One master of a saved file.
struct SavedPiece {
  int64_t param = 0, offset = 0, numel = 0, group = 0;
  torch::Tensor master;  // float32, flattened; undefined: the model's own parameter was the master
  std::vector<std::pair<std::string, c10::IValue>> state;  // empty: the optimizer had none yet
};

std::string state_key(const torch::Tensor& param) {
  return std::to_string(reinterpret_cast<size_t>(param.unsafeGetTensorImpl()));
}

int64_t read_count(torch::serialize::InputArchive& archive, const std::string& name, const std::string& where) {
  torch::Tensor value;
  TORCH_CHECK(archive.try_read(name, value), where, " lacks ", name);
  return value.item<int64_t>();
}

torch::serialize::InputArchive read_archive(torch::serialize::InputArchive& archive, const std::string& name,
                                            const std::string& where) {
  torch::serialize::InputArchive child;
  TORCH_CHECK(archive.try_read(name, child), where, " lacks ", name);
  return child;
}

// Every value of `archive` (its IValues: a torch::optim state entry or a group's options).
std::vector<std::pair<std::string, c10::IValue>> read_values(torch::serialize::InputArchive& archive) {
  std::vector<std::pair<std::string, c10::IValue>> values;
  for (const auto& name : archive.keys()) {
    c10::IValue value;
    TORCH_CHECK(archive.try_read(name, value), "load_resharded: cannot read optimizer value ", name);
    values.emplace_back(name, std::move(value));
  }
  return values;
}

// A state field that holds one value per element of its piece (exp_avg, momentum_buffer, ...).
bool per_element(const c10::IValue& value, int64_t numel) {
  return value.isTensor() && value.toTensor().defined() && value.toTensor().dim() > 0 &&
         value.toTensor().numel() == numel;
}

}  // namespace

void DistributedOptimizer::save_layout(torch::serialize::OutputArchive& archive) const {
  auto pieces = torch::empty({static_cast<int64_t>(pieces_.size()), 4}, torch::kLong);
  auto rows = pieces.accessor<int64_t, 2>();
  for (size_t i = 0; i < pieces_.size(); ++i) {
    rows[i][0] = static_cast<int64_t>(pieces_[i].param);
    rows[i][1] = pieces_[i].offset;
    rows[i][2] = pieces_[i].master.numel();
    rows[i][3] = pieces_[i].group;
  }
  std::vector<int64_t> numels;
  for (const auto& param : params_) numels.push_back(param.model.numel());
  archive.write("layout.pieces", pieces, /*is_buffer=*/true);
  archive.write("layout.param_numels", torch::tensor(numels, torch::kLong), /*is_buffer=*/true);
}

void DistributedOptimizer::load_resharded(std::vector<CheckpointShard>& shards, torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(connected_, "DistributedOptimizer::load_resharded: connect first");
  TORCH_CHECK(!shards.empty(), "DistributedOptimizer::load_resharded: no checkpoint shards");
  const auto num_groups = static_cast<int64_t>(optimizer.param_groups().size());
  std::vector<std::vector<SavedPiece>> saved(params_.size());  // per parameter, its saved pieces
  std::vector<torch::serialize::InputArchive> options;          // of rank 0's file, per group
  c10::IValue pytorch_version;

  // ---- read every file: its pieces, their masters and optimizer state ----
  for (size_t j = 0; j < shards.size(); ++j) {
    const auto where = "load_resharded: the checkpoint file of rank " + std::to_string(j) + " of " +
                       std::to_string(shards.size());
    auto& plugin = shards[j].plugin;
    auto& optimizer_archive = shards[j].optimizer;
    if (j == 0) {
      TORCH_CHECK(optimizer_archive.try_read("pytorch_version", pytorch_version), where,
                  " holds no torch::optim optimizer state (no pytorch_version)");
    }
    // Each group's saved keys, in order.
    auto groups_archive = read_archive(optimizer_archive, "param_groups", where);
    const auto saved_groups = read_count(groups_archive, "param_groups/size", where);
    TORCH_CHECK(saved_groups == num_groups, where, ": its optimizer has ", saved_groups,
                " param group(s), this one ", num_groups);
    std::vector<std::vector<std::string>> keys(num_groups);
    for (int64_t g = 0; g < num_groups; ++g) {
      auto group = read_archive(groups_archive, "param_groups/" + std::to_string(g), where);
      const auto size = read_count(group, "params/size", where);
      for (int64_t i = 0; i < size; ++i) {
        c10::IValue key;
        TORCH_CHECK(group.try_read("params/" + std::to_string(i), key) && key.isString(), where, " lacks key ", i,
                    " of param group ", g);
        keys[g].push_back(key.toStringRef());
      }
      if (j == 0) options.push_back(read_archive(group, "options", where));
    }
    // The pieces, from the layout.
    const auto num_masters = read_count(plugin, "num_masters", where);
    torch::Tensor layout, numels;
    TORCH_CHECK(plugin.try_read("layout.pieces", layout, /*is_buffer=*/true) &&
                    plugin.try_read("layout.param_numels", numels, /*is_buffer=*/true),
                where, " has no layout.pieces (written before amp8 recorded where its masters sit): resume it "
                "with the ", shards.size(), " rank(s) that wrote it");
    TORCH_CHECK(layout.dim() == 2 && layout.size(0) == num_masters && layout.size(1) == 4, where,
                ": layout.pieces must be ", num_masters, " x 4, got ", layout.sizes());
    layout = layout.to(torch::kCPU, torch::kLong);
    const auto rows = layout.accessor<int64_t, 2>();
    std::vector<SavedPiece> pieces(num_masters);
    for (int64_t k = 0; k < num_masters; ++k) {
      pieces[k].param = rows[k][0], pieces[k].offset = rows[k][1], pieces[k].numel = rows[k][2];
      pieces[k].group = rows[k][3];
    }
    numels = numels.to(torch::kCPU, torch::kLong);
    TORCH_CHECK(numels.numel() == static_cast<int64_t>(params_.size()), where, ": the checkpoint's model has ",
                numels.numel(), " parameters, this one ", params_.size());
    for (size_t p = 0; p < params_.size(); ++p) {
      TORCH_CHECK(numels[p].item<int64_t>() == params_[p].model.numel(), where, ": parameter ", p, " has ",
                  numels[p].item<int64_t>(), " elements in the checkpoint, ", params_[p].model.numel(), " here");
    }
    // Saved key of each piece: the pieces of group g, in master order, are the group's params.
    std::vector<size_t> next(num_groups, 0);
    auto state_archive = read_archive(optimizer_archive, "state", where);
    for (int64_t k = 0; k < num_masters; ++k) {
      auto& piece = pieces[k];
      TORCH_CHECK(piece.param >= 0 && piece.param < static_cast<int64_t>(params_.size()) && piece.offset >= 0 &&
                      piece.numel > 0 && piece.offset + piece.numel <= params_[piece.param].model.numel() &&
                      piece.group >= 0 && piece.group < num_groups,
                  where, ": layout.pieces row ", k, " (param ", piece.param, ", offset ", piece.offset, ", numel ",
                  piece.numel, ", group ", piece.group, ") does not fit this model and optimizer");
      TORCH_CHECK(next[piece.group] < keys[piece.group].size(), where, ": param group ", piece.group,
                  " holds fewer parameters than the layout puts in it");
      const auto& key = keys[piece.group][next[piece.group]++];
      torch::serialize::InputArchive entry;
      if (state_archive.try_read(key, entry)) piece.state = read_values(entry);
      torch::Tensor master;
      if (plugin.try_read("master." + std::to_string(k), master, /*is_buffer=*/true)) {
        TORCH_CHECK(master.scalar_type() == at::kFloat && master.numel() == piece.numel, where, ": master.", k,
                    " must be float32 with ", piece.numel, " elements, got ", c10::toString(master.scalar_type()),
                    " of shape ", master.sizes());
        piece.master = master.reshape(-1);
      } else {
        // Only a float32 parameter on one rank is its own master: the model archive holds it.
        TORCH_CHECK(shards.size() == 1 && params_[piece.param].model.scalar_type() == at::kFloat &&
                        !params_[piece.param].fp8_meta,
                    where, " lacks master.", k);
      }
      saved[piece.param].push_back(std::move(piece));
    }
    for (int64_t g = 0; g < num_groups; ++g) {
      TORCH_CHECK(next[g] == keys[g].size(), where, ": param group ", g, " holds ", keys[g].size(),
                  " parameters, the layout puts ", next[g], " in it");
    }
  }

  // ---- cut this rank's pieces from them ----
  std::vector<torch::Tensor> masters(pieces_.size());
  std::vector<std::vector<std::pair<std::string, c10::IValue>>> states(pieces_.size());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const auto& piece = pieces_[i];
    const int64_t begin = piece.offset, numel = piece.master.numel(), end = begin + numel;
    const auto name = "parameter " + std::to_string(piece.param) + " [" + std::to_string(begin) + ", " +
                      std::to_string(end) + ")";
    struct Overlap {
      const SavedPiece* saved;
      int64_t from, to;  // in the parameter's flattened elements
    };
    std::vector<Overlap> overlaps;
    for (const auto& s : saved[piece.param]) {
      const auto from = std::max(begin, s.offset), to = std::min(end, s.offset + s.numel);
      if (from >= to) continue;
      overlaps.push_back({&s, from, to});
    }
    // The saved pieces must tile the range: each element from exactly one (a gap would be left
    // uninitialised, an overlap means the files are not one checkpoint's).
    std::sort(overlaps.begin(), overlaps.end(), [](const Overlap& a, const Overlap& b) { return a.from < b.from; });
    int64_t reached = begin;
    for (const auto& o : overlaps) {
      TORCH_CHECK(o.from == reached, "load_resharded: the checkpoint's pieces of ", name, " ",
                  o.from > reached ? "leave out" : "hold twice", " element ", std::min(o.from, reached),
                  " (the files are not one checkpoint?)");
      reached = o.to;
    }
    TORCH_CHECK(reached == end, "load_resharded: the checkpoint's pieces of ", name, " leave out element ", reached,
                " (the files are not one checkpoint?)");
    auto master = torch::empty({numel}, torch::kFloat);
    for (const auto& o : overlaps) {
      const auto& source = o.saved->master.defined() ? o.saved->master
                                                     : params_[piece.param].model.detach().reshape(-1);
      master.narrow(0, o.from - begin, o.to - o.from).copy_(source.narrow(0, o.from - o.saved->offset, o.to - o.from));
    }
    masters[i] = master;

    const bool has_state = !overlaps.front().saved->state.empty();
    for (const auto& o : overlaps) {
      TORCH_CHECK(o.saved->state.empty() != has_state, "load_resharded: ", name, ": some of its saved pieces have "
                  "optimizer state and some none");
    }
    for (const auto& [field, value] : overlaps.front().saved->state) {
      if (!per_element(value, overlaps.front().saved->numel)) {
        TORCH_CHECK(!value.isTensor() || value.toTensor().dim() == 0, "load_resharded: ", name,
                    ": optimizer state \"", field, "\" of shape ", value.toTensor().sizes(), " is neither one value "
                    "per element nor a scalar; this optimizer's state cannot be resharded");
        states[i].emplace_back(field, value);  // a scalar (step): the same in every piece
        continue;
      }
      auto joined = torch::empty({numel}, value.toTensor().options().device(torch::kCPU));
      for (const auto& o : overlaps) {
        const auto found = std::find_if(o.saved->state.begin(), o.saved->state.end(),
                                        [&](const auto& item) { return item.first == field; });
        TORCH_CHECK(found != o.saved->state.end() && per_element(found->second, o.saved->numel),
                    "load_resharded: ", name, ": optimizer state \"", field, "\" is missing from a saved piece");
        joined.narrow(0, o.from - begin, o.to - o.from)
            .copy_(found->second.toTensor().reshape(-1).narrow(0, o.from - o.saved->offset, o.to - o.from));
      }
      states[i].emplace_back(field, joined.view(piece.master.sizes()).to(piece.master.device()));
    }
  }

  // ---- the archive this rank's optimizer would have saved, then load it ----
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive state_archive(archive.compilation_unit());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    if (states[i].empty()) continue;
    torch::serialize::OutputArchive entry(archive.compilation_unit());
    for (const auto& [field, value] : states[i]) entry.write(field, value);
    state_archive.write(state_key(pieces_[i].master), entry);
  }
  torch::serialize::OutputArchive groups_archive(archive.compilation_unit());
  groups_archive.write("param_groups/size", torch::tensor(num_groups));
  for (int64_t g = 0; g < num_groups; ++g) {
    torch::serialize::OutputArchive group(archive.compilation_unit()), group_options(archive.compilation_unit());
    const auto params = optimizer.param_groups()[g].params();
    group.write("params/size", torch::tensor(static_cast<int64_t>(params.size())));
    for (size_t i = 0; i < params.size(); ++i) group.write("params/" + std::to_string(i), c10::IValue(state_key(params[i])));
    for (const auto& [field, value] : read_values(options[g])) group_options.write(field, value);
    group.write("options", group_options);
    groups_archive.write("param_groups/" + std::to_string(g), group);
  }
  archive.write("pytorch_version", pytorch_version);
  archive.write("state", state_archive);
  archive.write("param_groups", groups_archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  const auto serialized = bytes.str();
  torch::serialize::InputArchive rebuilt;
  rebuilt.load_from(serialized.data(), serialized.size());
  optimizer.load(rebuilt);

  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    if (!master_is_model(i)) pieces_[i].master.copy_(masters[i].view(pieces_[i].master.sizes()));
  }
  masters_loaded();
}

}  // namespace amp8
