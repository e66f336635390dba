#include "recipes/data/blended_dataset.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <tuple>

namespace amp8::recipes {
namespace {

// numpy's pairwise_sum for float64 (numpy/_core/src/umath/loops_utils.h.src).
double numpy_pairwise_sum(const double* values, int64_t count) {
  constexpr int64_t kBlockSize = 128;
  if (count < 8) {
    double sum = 0.0;
    for (int64_t i = 0; i < count; ++i) sum += values[i];
    return sum;
  }
  if (count <= kBlockSize) {
    double partial[8];
    for (int j = 0; j < 8; ++j) partial[j] = values[j];
    int64_t i = 8;
    for (; i < count - (count % 8); i += 8) {
      for (int j = 0; j < 8; ++j) partial[j] += values[i + j];
    }
    double sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
                 ((partial[4] + partial[5]) + (partial[6] + partial[7]));
    for (; i < count; ++i) sum += values[i];
    return sum;
  }
  int64_t half = count / 2;
  half -= half % 8;
  return numpy_pairwise_sum(values, half) + numpy_pairwise_sum(values + half, count - half);
}

}  // namespace

std::vector<BlendComponent> parse_blend(const std::string& blend) {
  std::istringstream stream(blend);
  std::vector<std::string> words;
  for (std::string word; stream >> word;) words.push_back(word);
  TORCH_CHECK(!words.empty(), "blend \"", blend,
              "\": expected prefixes (\"path/a path/b\") or weight/prefix pairs (\"0.3 path/a 0.7 path/b\")");

  // Megatron reads the first word of each pair as a weight when it is a number.
  auto number = [](const std::string& word) -> std::optional<double> {
    char* end = nullptr;
    const double value = std::strtod(word.c_str(), &end);
    if (end != word.c_str() + word.size()) return std::nullopt;
    return value;
  };
  size_t numeric = 0;
  if (words.size() % 2 == 0) {
    for (size_t i = 0; i < words.size(); i += 2) numeric += number(words[i]).has_value();
  }
  std::vector<BlendComponent> components;
  if (numeric == 0) {
    for (const std::string& word : words) components.push_back({std::nullopt, word});
  } else {
    for (size_t i = 0; i < words.size(); i += 2) {
      const std::optional<double> weight = number(words[i]);
      TORCH_CHECK(weight.has_value(), "blend \"", blend, "\": expected a weight before prefix \"",
                  words[i + 1], "\" as before the others, got \"", words[i],
                  "\" (give every prefix a weight, or none)");
      TORCH_CHECK(std::isfinite(*weight) && *weight > 0, "blend \"", blend,
                  "\": expected a positive weight before prefix \"", words[i + 1], "\", got \"",
                  words[i], "\"");
      components.push_back({weight, words[i + 1]});
    }
  }
  TORCH_CHECK(components.size() < 32767, "blend \"", blend,
              "\": expected fewer than 32767 prefixes (Megatron's int16 dataset index), got ",
              components.size());
  return components;
}

std::vector<double> normalize_blend_weights(const std::vector<double>& weights) {
  const double total = numpy_pairwise_sum(weights.data(), static_cast<int64_t>(weights.size()));
  TORCH_CHECK(total > 0.0, "expected blend weights with a positive sum, got ", total);
  std::vector<double> normalized;
  normalized.reserve(weights.size());
  for (double weight : weights) normalized.push_back(weight / total);
  return normalized;
}

std::pair<std::vector<int16_t>, std::vector<int64_t>> build_blending_indices(
    const std::vector<double>& normalized_weights, int64_t size) {
  TORCH_CHECK(!normalized_weights.empty(), "expected at least one blend weight");
  TORCH_CHECK(size >= 0, "expected a non-negative blend size, got ", size);
  std::vector<int16_t> dataset_index(static_cast<size_t>(size));
  std::vector<int64_t> dataset_sample_index(static_cast<size_t>(size));
  std::vector<int64_t> drawn(normalized_weights.size(), 0);
  for (int64_t sample = 0; sample < size; ++sample) {
    const double progress = std::max(static_cast<double>(sample), 1.0);
    size_t most_behind = 0;
    double largest_error = normalized_weights[0] * progress - static_cast<double>(drawn[0]);
    for (size_t dataset = 1; dataset < normalized_weights.size(); ++dataset) {
      const double error =
          normalized_weights[dataset] * progress - static_cast<double>(drawn[dataset]);
      if (error > largest_error) {
        largest_error = error;
        most_behind = dataset;
      }
    }
    dataset_index[sample] = static_cast<int16_t>(most_behind);
    dataset_sample_index[sample] = drawn[most_behind]++;
  }
  return {std::move(dataset_index), std::move(dataset_sample_index)};
}

BlendedGptDataset::BlendedGptDataset(const std::vector<BlendComponent>& blend, DatasetSplit split,
                                     int64_t size, GptDatasetOptions options,
                                     double mid_level_dataset_surplus) {
  TORCH_CHECK(!blend.empty(), "BlendedGptDataset: expected at least one blend component");
  TORCH_CHECK(size >= 0, "BlendedGptDataset: size must be >= 0, got ", size);
  TORCH_CHECK(mid_level_dataset_surplus >= 0.0, "mid_level_dataset_surplus must be >= 0, got ",
              mid_level_dataset_surplus);

  const bool weighted = blend.front().weight.has_value();
  for (const BlendComponent& component : blend) {
    TORCH_CHECK(component.weight.has_value() == weighted, "BlendedGptDataset: expected a weight for every ",
                "component or for none; ", component.path_prefix, (weighted ? " has none" : " has one"));
  }
  std::vector<double> blending_weights;
  int64_t blended_size = 0;
  if (weighted) {
    // First, the builder's normalized weights and the samples it plans (target) and builds
    // (target plus surplus) per prefix.
    std::vector<double> weights;
    for (const BlendComponent& component : blend) weights.push_back(*component.weight);
    const std::vector<double> builder_weights = normalize_blend_weights(weights);
    for (size_t i = 0; i < blend.size(); ++i) {
      const double target = std::ceil(static_cast<double>(size) * builder_weights[i]);
      const auto buffered =
          static_cast<int64_t>(std::ceil(target * (1.0 + mid_level_dataset_surplus)));
      blended_size += static_cast<int64_t>(target);
      datasets_.push_back(std::make_shared<const GptDataset>(
          std::make_shared<const IndexedDataset>(blend[i].path_prefix), split, buffered, options));
    }
    // BlendedDataset normalizes the (already normalized) weights once more, which can move
    // their last bits, so this does too.
    blending_weights = builder_weights;
  } else {
    // First, one epoch of each prefix's split; their sample counts are the weights.
    std::vector<double> epoch_sizes;
    int64_t total = 0;
    for (const BlendComponent& component : blend) {
      datasets_.push_back(std::make_shared<const GptDataset>(
          std::make_shared<const IndexedDataset>(component.path_prefix), split, std::nullopt, options));
      epoch_sizes.push_back(static_cast<double>(datasets_.back()->size()));
      total += datasets_.back()->size();
    }
    blending_weights = epoch_sizes;
    blended_size = std::min(size, total);
  }

  // Next, the blending indices.
  std::tie(dataset_index_, dataset_sample_index_) =
      build_blending_indices(normalize_blend_weights(blending_weights), blended_size);

  // Finally, no component may be asked for more samples than it holds.
  std::vector<int64_t> requested(datasets_.size(), 0);
  for (int16_t dataset : dataset_index_) ++requested[dataset];
  for (size_t i = 0; i < datasets_.size(); ++i) {
    TORCH_CHECK(requested[i] <= datasets_[i]->size(), "the ", dataset_split_name(split),
                " blend asks ", blend[i].path_prefix, " for ", requested[i],
                " samples, more than its ", datasets_[i]->size(),
                ": raise mid_level_dataset_surplus (now ", mid_level_dataset_surplus, ")");
  }
}

std::pair<int16_t, int64_t> BlendedGptDataset::locate(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < size(), "BlendedGptDataset: expected a sample index in [0, ",
              size(), "), got ", index);
  return {dataset_index_[index], dataset_sample_index_[index]};
}

torch::Tensor BlendedGptDataset::sample(int64_t index) const {
  const auto [dataset, sample_in_dataset] = locate(index);
  return datasets_[dataset]->sample(sample_in_dataset);
}

std::pair<torch::Tensor, torch::Tensor> BlendedGptDataset::tokens_and_labels(int64_t index) const {
  const auto [dataset, sample_in_dataset] = locate(index);
  return datasets_[dataset]->tokens_and_labels(sample_in_dataset);
}

}  // namespace amp8::recipes
