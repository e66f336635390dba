#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "recipes/data/gpt_dataset.h"
#include "recipes/data/indexed_dataset.h"

namespace amp8::recipes {

/// One prefix of a blend, with its weight in a weighted blend.
struct BlendComponent {
  std::optional<double> weight;  // nullopt in an unweighted blend: every component's or none
  std::string path_prefix;
};

/// Megatron's blend list (--data-path, utils.py get_blend_from_list), whitespace-separated:
/// weight/prefix pairs ("0.3 path/a 0.7 path/b"), or prefixes only ("path/a path/b", blended by
/// their sizes; one prefix is a plain dataset). Like Megatron, an odd number of words or pairs
/// whose first words are all non-numbers are prefixes. Throws naming `blend` when it is empty,
/// when some pairs have a weight and others do not, or when a weight is not positive and finite.
std::vector<BlendComponent> parse_blend(const std::string& blend);

/// numpy's `normalize` (megatron/core/datasets/utils.py): weights / numpy.sum(weights), with
/// numpy's pairwise summation, so the blend weights match Megatron's to the last bit.
std::vector<double> normalize_blend_weights(const std::vector<double>& weights);

/// helpers.cpp `build_blending_indices`: for each of `size` samples, the dataset whose drawn
/// share lags its weight the most, and that dataset's next sample. Returns (dataset_index,
/// dataset_sample_index), each of `size` entries.
std::pair<std::vector<int16_t>, std::vector<int64_t>> build_blending_indices(
    const std::vector<double>& normalized_weights, int64_t size);

/// Megatron-Core's BlendedDataset over GPTDatasets for one split, built the way
/// BlendedMegatronDatasetBuilder builds a blend with a sample count `size`, and blended sample i
/// is sample dataset_sample_index[i] of dataset dataset_index[i]:
/// - weighted: each prefix gets a GptDataset (same options, its own split range) of
///   ceil(ceil(size * weight) * (1 + surplus)) samples, and the blend holds
///   sum(ceil(size * weight)) samples;
/// - unweighted: each prefix gets one epoch of its split, the blend's weights are those epochs'
///   sample counts, and it holds min(size, their sum) samples (so it may hold fewer than `size`).
class BlendedGptDataset {
 public:
  /// Opens every prefix of `blend`. Throws when a component's GptDataset would be asked for
  /// more samples than it holds (raise mid_level_dataset_surplus, as Megatron says), and on any
  /// error of IndexedDataset or GptDataset.
  BlendedGptDataset(const std::vector<BlendComponent>& blend, DatasetSplit split, int64_t size,
                    GptDatasetOptions options, double mid_level_dataset_surplus = 0.005);

  int64_t size() const { return static_cast<int64_t>(dataset_index_.size()); }

  /// GptDataset::sample of the component dataset that blended sample `index` comes from.
  torch::Tensor sample(int64_t index) const;
  /// GptDataset::tokens_and_labels of that component dataset.
  std::pair<torch::Tensor, torch::Tensor> tokens_and_labels(int64_t index) const;

  /// The per-prefix GPT datasets, in blend order.
  const std::vector<std::shared_ptr<const GptDataset>>& datasets() const { return datasets_; }
  const std::vector<int16_t>& dataset_index() const { return dataset_index_; }
  const std::vector<int64_t>& dataset_sample_index() const { return dataset_sample_index_; }

 private:
  std::pair<int16_t, int64_t> locate(int64_t index) const;

  std::vector<std::shared_ptr<const GptDataset>> datasets_;
  std::vector<int16_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
};

}  // namespace amp8::recipes
