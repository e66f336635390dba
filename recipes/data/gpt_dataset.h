#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "recipes/data/indexed_dataset.h"
#include "recipes/data/numpy_random_state.h"

namespace amp8::recipes {

/// Megatron's `Split` enum: the three splits a split string such as "969,30,1" weighs.
enum class DatasetSplit { kTrain = 0, kValid = 1, kTest = 2 };

/// "train", "valid" or "test", as Megatron names the splits.
const char* dataset_split_name(DatasetSplit split);

/// Megatron's split matrix (blended_megatron_dataset_config.py: parse_and_normalize_split, then
/// convert_split_vector_to_split_matrix): the numbers in `split` ("969,30,1", "99,1", "1") are
/// padded with zeros to three, normalized to sum 1, and accumulated into [begin, end) book-ends
/// of [0, 1], one per split; a split of weight 0 has none. Throws naming `split` when it holds
/// more than three numbers, a malformed number, or only zeros.
std::array<std::optional<std::pair<double, double>>, 3> split_matrix_from_string(
    const std::string& split);

/// The [begin, end) sequence range of `which` among `num_sequences` sequences
/// (blended_megatron_dataset_builder.py: round(book-end * num_sequences), rounding half to
/// even as Python's round does), or nullopt when the split has weight 0.
std::optional<std::pair<int64_t, int64_t>> split_sequence_range(const std::string& split,
                                                                DatasetSplit which,
                                                                int64_t num_sequences);

/// gpt_dataset.py `_build_document_index`: `documents` repeated `num_epochs` times and shuffled
/// with `random_state`; with `separate_final_epoch`, the first num_epochs - 1 epochs are
/// shuffled together and the final epoch on its own after them.
std::vector<int32_t> build_document_index(const std::vector<int32_t>& documents, int64_t num_epochs,
                                          NumpyRandomState& random_state,
                                          bool separate_final_epoch);

/// Where a sample starts (or, for the next sample, ends): the entry of the document index and
/// the token offset inside that entry's sequence. One row of Megatron's sample index.
struct SampleBoundary {
  int64_t document_index_entry = 0;
  int64_t token_offset = 0;
  bool operator==(const SampleBoundary&) const = default;
};

/// helpers.cpp `build_sample_idx`: walks the document index, cutting it into samples of
/// `sequence_length` tokens (plus `add_extra_token_to_sequence`, the token the last label needs,
/// which the next sample starts on again). Returns num_samples + 1 boundaries, where num_samples
/// is (num_epochs * tokens_per_epoch - extra) / sequence_length, rounded down when
/// `drop_last_partial_sequence`, else up (in float, as helpers.cpp does). Throws unless
/// sequence_length > 1, num_epochs > 0 and tokens_per_epoch > 1.
std::vector<SampleBoundary> build_sample_index(const std::vector<int32_t>& sequence_lengths,
                                               const std::vector<int32_t>& document_index,
                                               int64_t sequence_length, int64_t num_epochs,
                                               int64_t tokens_per_epoch,
                                               bool drop_last_partial_sequence,
                                               bool add_extra_token_to_sequence);

/// gpt_dataset.py `_build_shuffle_index`: [0, num_samples) shuffled, followed by
/// [num_samples, total_size) shuffled on its own.
std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size,
                                         NumpyRandomState& random_state);

/// The knobs of Megatron-Core's GPTDatasetConfig that decide which tokens a sample holds.
struct GptDatasetOptions {
  explicit GptDatasetOptions(int64_t sequence_length) : sequence_length_(sequence_length) {}
  /// Tokens per sample (Megatron's --seq-length). Must be > 1.
  TORCH_ARG(int64_t, sequence_length);
  /// Seed of the numpy RandomState that shuffles documents and samples (--seed). Default: 1234.
  TORCH_ARG(int64_t, random_seed) = 1234;
  /// Train/valid/test weights (--split). Default: "969, 30, 1".
  TORCH_ARG(std::string, split) = "969, 30, 1";
  /// Draw sequence_length + 1 tokens per sample, so tokens and labels are both sequence_length
  /// long. Default: true.
  TORCH_ARG(bool, add_extra_token_to_sequence) = true;
  /// Drop the final partial sample of the validation split (train always drops it).
  /// Default: true.
  TORCH_ARG(bool, drop_last_partial_validation_sequence) = true;
};

/// Megatron-Core's GPTDataset (megatron/core/datasets/gpt_dataset.py) over one IndexedDataset
/// and one split, drawing the same samples in the same order: the split's sequences (Megatron's
/// GPT "documents" are the .idx sequences) are repeated for as many epochs as `num_samples`
/// needs (one epoch when nullopt), shuffled into the document index, cut into samples by the
/// sample index, and the samples shuffled by the shuffle index, all with one numpy RandomState.
///
/// A blend of prefixes (weighted, or by size) is BlendedGptDataset (blended_dataset.h). Not covered: the
/// on-disk index cache, and multimodal sequence modes.
class GptDataset {
 public:
  /// Builds the three indices. Throws naming the dataset and split when the split is empty or
  /// holds fewer than 2 tokens, and on bad options.
  GptDataset(std::shared_ptr<const IndexedDataset> dataset, DatasetSplit split,
             std::optional<int64_t> num_samples, GptDatasetOptions options);

  /// The number of samples (Megatron's len(dataset)); at least num_samples when one was given.
  int64_t size() const { return static_cast<int64_t>(sample_index_.size()) - 1; }

  /// The raw window of sample `index` (GPTDataset._query_document_sample_shuffle_indices):
  /// int64 [sequence_length + extra], tokens across sequence boundaries, padded with -1
  /// (Megatron's pad id) only for a final partial sample kept by
  /// drop_last_partial_validation_sequence=false. Throws unless 0 <= index < size().
  torch::Tensor sample(int64_t index) const;

  /// What GPTDataset.__getitem__ returns as "tokens" and "labels", int64 [sequence_length]
  /// each: with the extra token, window[:-1] and window[1:]; without it, the window and the
  /// window shifted left by one with a pad last. Pads are replaced by 0, as Megatron does;
  /// Megatron's loss mask, which takes them out of the loss, is not made here (gpt_pretrain keeps
  /// the defaults add_extra_token_to_sequence and drop_last_partial_validation_sequence, under
  /// which no sample holds a pad).
  std::pair<torch::Tensor, torch::Tensor> tokens_and_labels(int64_t index) const;

  const IndexedDataset& indexed_dataset() const { return *dataset_; }
  DatasetSplit split() const { return split_; }
  const GptDatasetOptions& options() const { return options_; }
  /// The [begin, end) range of sequences this split exposes.
  std::pair<int64_t, int64_t> sequence_range() const { return sequence_range_; }
  int64_t num_epochs() const { return num_epochs_; }
  /// Whether the final epoch is shuffled apart (it supplies fewer than 80% of an epoch's
  /// samples). The three indices follow from the data, the seed, num_epochs and this alone.
  bool separate_final_epoch() const { return separate_final_epoch_; }
  const std::vector<int32_t>& document_index() const { return document_index_; }
  const std::vector<SampleBoundary>& sample_index() const { return sample_index_; }
  const std::vector<int64_t>& shuffle_index() const { return shuffle_index_; }

 private:
  std::shared_ptr<const IndexedDataset> dataset_;
  DatasetSplit split_;
  GptDatasetOptions options_;
  std::pair<int64_t, int64_t> sequence_range_;
  int64_t num_epochs_ = 1;
  bool separate_final_epoch_ = false;
  std::vector<int32_t> document_index_;
  std::vector<SampleBoundary> sample_index_;
  std::vector<int64_t> shuffle_index_;
};

}  // namespace amp8::recipes
