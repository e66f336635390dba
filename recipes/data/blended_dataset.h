#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "recipes/data/gpt_dataset.h"
#include "recipes/data/indexed_dataset.h"

namespace amp8::recipes {

/// One weighted prefix of a blend.
struct BlendComponent {
  double weight = 0.0;
  std::string path_prefix;
};

/// Megatron's weighted blend list (--data-path "0.3 path/a 0.7 path/b", utils.py
/// get_blend_from_list): whitespace-separated weight/prefix pairs. Throws naming `blend` unless
/// it holds at least one pair, every weight is a positive number and every prefix is non-empty.
/// (Megatron's unweighted form, prefixes only, blended by dataset size, is not supported.)
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
/// BlendedMegatronDatasetBuilder builds a weighted blend with a sample count: each prefix gets a
/// GptDataset (same options, its own split range) of ceil(ceil(size * weight) * (1 + surplus))
/// samples, the blend holds sum(ceil(size * weight)) samples, and blended sample i is sample
/// dataset_sample_index[i] of dataset dataset_index[i].
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
