#include "recipes/gpt/megatron_data.h"

#include "recipes/gpt/data.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <sstream>
#include <vector>

namespace amp8::recipes {

MegatronData::MegatronData(const std::string& blend, const std::string& split, int64_t seq,
                           uint64_t seed, int64_t num_samples, int64_t vocab_size, DatasetSplit part)
    : blend_(blend), split_(split), vocab_size_(vocab_size), part_(part) {
  TORCH_CHECK(vocab_size >= 1, "vocab-size must be >= 1 with --data-prefix, got ", vocab_size);
  const auto options = GptDatasetOptions(seq).random_seed(static_cast<int64_t>(seed)).split(split);
  const std::vector<BlendComponent> components = parse_blend(blend);
  if (components.size() == 1 && !components.front().weight) {
    single_ = std::make_shared<GptDataset>(std::make_shared<IndexedDataset>(components.front().path_prefix), part,
                                           num_samples, options);
  } else {
    blended_ = std::make_shared<BlendedGptDataset>(components, part, num_samples, options);
  }
  // Only an unweighted blend can hold fewer: it is one epoch of each prefix.
  TORCH_CHECK(size() >= num_samples, "data-prefix \"", blend, "\": the unweighted blend holds ", size(), " ",
              dataset_split_name(part), " samples (one epoch of each prefix), fewer than the ", num_samples,
              " the run draws: weight the prefixes (\"0.5 a 0.5 b\") or draw fewer (--steps, --micro-batch, ",
              "--eval-iters)");
  std::ostringstream identity;
  identity << blend << " split " << split;
  for (const auto& component : components) {
    const std::string& prefix = component.path_prefix;
    std::error_code error;
    identity << "; " << std::filesystem::path(prefix).filename().string() << ": "
             << std::filesystem::file_size(prefix + ".bin", error) << " + "
             << std::filesystem::file_size(prefix + ".idx", error) << " bytes";
  }
  fingerprint_ = identity.str();
}

std::pair<torch::Tensor, torch::Tensor> MegatronData::batch(int64_t index, int64_t batch_size,
                                                                 const torch::Device& device) const {
  std::vector<torch::Tensor> tokens, labels;
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t sample = index * batch_size + b;
    auto [t, l] = single_ ? single_->tokens_and_labels(sample) : blended_->tokens_and_labels(sample);
    tokens.push_back(t);
    labels.push_back(l);
  }
  auto inputs = torch::stack(tokens), targets = torch::stack(labels);
  const int64_t largest = std::max(inputs.max().item<int64_t>(), targets.max().item<int64_t>());
  TORCH_CHECK(largest < vocab_size_, "data-prefix ", blend_, ": token id ", largest, " in micro-batch ", index,
              " is not below the model's vocabulary size ", vocab_size_,
              " (--vocab-size, rounded up to a multiple of 128)");
  // Signed token types (int8 ... int64, float) can hold negative ids, which the embedding would
  // fail on without naming the data.
  const int64_t smallest = std::min(inputs.min().item<int64_t>(), targets.min().item<int64_t>());
  TORCH_CHECK(smallest >= 0, "data-prefix ", blend_, ": token id ", smallest, " in micro-batch ", index,
              " is negative (a corrupt .bin, or one written with another dtype than its .idx says?)");
  return {copy_to_device(inputs, device), copy_to_device(targets, device)};
}

int64_t MegatronData::size() const { return single_ ? single_->size() : blended_->size(); }

std::string MegatronData::sample_order() const {
  const auto describe = [](const GptDataset& dataset) {
    return "epochs " + std::to_string(dataset.num_epochs()) +
           (dataset.separate_final_epoch() ? ", final epoch apart" : "");
  };
  if (single_) return describe(*single_);
  std::string order;
  for (const auto& dataset : blended_->datasets()) {
    order += (order.empty() ? "" : "; ") + std::filesystem::path(dataset->indexed_dataset().path_prefix()).filename().string() + ": " +
             describe(*dataset);
  }
  return order;
}

std::string MegatronData::source() const {
  return "megatron " + blend_ + " (split " + split_ + ", " + std::to_string(size()) + " " +
         dataset_split_name(part_) + " samples)";
}

std::string MegatronData::fingerprint() const { return fingerprint_; }

}  // namespace amp8::recipes
