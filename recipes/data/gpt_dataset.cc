#include "recipes/data/gpt_dataset.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <limits>

namespace amp8::recipes {
namespace {

constexpr int64_t kPadTokenId = -1;  // megatron_dataset.py _PAD_TOKEN_ID
constexpr double kSeparateFinalEpochThreshold = 0.80;

// parse_and_normalize_split: Megatron reads every run of [.0-9] as a number, so any other
// characters (commas, spaces, slashes) separate them.
std::vector<double> parse_split_weights(const std::string& split) {
  std::vector<double> weights;
  size_t position = 0;
  while (position < split.size()) {
    const auto is_number_char = [](char c) { return c == '.' || (c >= '0' && c <= '9'); };
    if (!is_number_char(split[position])) {
      ++position;
      continue;
    }
    size_t end = position;
    while (end < split.size() && is_number_char(split[end])) ++end;
    const std::string number = split.substr(position, end - position);
    char* parsed_end = nullptr;
    const double weight = std::strtod(number.c_str(), &parsed_end);
    TORCH_CHECK(parsed_end == number.c_str() + number.size(), "split \"", split,
                "\": expected comma-separated numbers such as \"969,30,1\", got \"", number, "\"");
    weights.push_back(weight);
    position = end;
  }
  TORCH_CHECK(weights.size() <= 3, "split \"", split,
              "\": expected at most three weights (train, valid, test), got ", weights.size());
  weights.resize(3, 0.0);
  return weights;
}

// The sample count helpers.cpp computes; the partial case divides in float, as it does.
int64_t num_samples_for(int64_t num_epochs, int64_t tokens_per_epoch, int64_t sequence_length,
                        bool drop_last_partial_sequence, int64_t extra_token) {
  const int64_t usable_tokens = num_epochs * tokens_per_epoch - extra_token;
  if (drop_last_partial_sequence) return usable_tokens / sequence_length;
  return static_cast<int64_t>(
      std::ceil(static_cast<float>(usable_tokens) / static_cast<float>(sequence_length)));
}

}  // namespace

const char* dataset_split_name(DatasetSplit split) {
  switch (split) {
    case DatasetSplit::kTrain:
      return "train";
    case DatasetSplit::kValid:
      return "valid";
    case DatasetSplit::kTest:
      return "test";
  }
  return "unknown";
}

std::array<std::optional<std::pair<double, double>>, 3> split_matrix_from_string(
    const std::string& split) {
  const std::vector<double> weights = parse_split_weights(split);
  // numpy.sum of three values adds them left to right, as here.
  double total = 0.0;
  for (double weight : weights) total += weight;
  TORCH_CHECK(total > 0.0, "split \"", split, "\": expected at least one positive weight");

  std::array<std::optional<std::pair<double, double>>, 3> matrix;
  double begin = 0.0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const double end = begin + weights[i] / total;
    if (end > begin) matrix[i] = std::make_pair(begin, end);
    begin = end;
  }
  return matrix;
}

std::optional<std::pair<int64_t, int64_t>> split_sequence_range(const std::string& split,
                                                                DatasetSplit which,
                                                                int64_t num_sequences) {
  const auto bookends = split_matrix_from_string(split)[static_cast<size_t>(which)];
  if (!bookends) return std::nullopt;
  // Python's round() rounds half to even, as nearbyint does in the default rounding mode.
  const auto scaled = [num_sequences](double fraction) {
    return static_cast<int64_t>(std::nearbyint(fraction * static_cast<double>(num_sequences)));
  };
  return std::make_pair(scaled(bookends->first), scaled(bookends->second));
}

std::vector<int32_t> build_document_index(const std::vector<int32_t>& documents, int64_t num_epochs,
                                          NumpyRandomState& random_state,
                                          bool separate_final_epoch) {
  TORCH_CHECK(num_epochs >= 1, "expected at least one epoch, got ", num_epochs);
  if (!separate_final_epoch || num_epochs == 1) {
    std::vector<int32_t> document_index;
    document_index.reserve(documents.size() * static_cast<size_t>(num_epochs));
    for (int64_t epoch = 0; epoch < num_epochs; ++epoch) {
      document_index.insert(document_index.end(), documents.begin(), documents.end());
    }
    random_state.shuffle(document_index);
    return document_index;
  }
  std::vector<int32_t> document_index =
      build_document_index(documents, num_epochs - 1, random_state, false);
  const std::vector<int32_t> final_epoch = build_document_index(documents, 1, random_state, false);
  document_index.insert(document_index.end(), final_epoch.begin(), final_epoch.end());
  return document_index;
}

std::vector<SampleBoundary> build_sample_index(const std::vector<int32_t>& sequence_lengths,
                                               const std::vector<int32_t>& document_index,
                                               int64_t sequence_length, int64_t num_epochs,
                                               int64_t tokens_per_epoch,
                                               bool drop_last_partial_sequence,
                                               bool add_extra_token_to_sequence) {
  TORCH_CHECK(sequence_length > 1, "sequence_length must be > 1, got ", sequence_length);
  TORCH_CHECK(num_epochs > 0, "num_epochs must be > 0, got ", num_epochs);
  TORCH_CHECK(tokens_per_epoch > 1, "expected more than one token per epoch, got ",
              tokens_per_epoch);
  TORCH_CHECK(!document_index.empty(), "expected a non-empty document index");
  for (int32_t sequence : document_index) {
    TORCH_CHECK(sequence >= 0 && static_cast<size_t>(sequence) < sequence_lengths.size(),
                "document index entry ", sequence, " is not a sequence: expected [0, ",
                sequence_lengths.size(), ")");
  }
  const int64_t extra_token = add_extra_token_to_sequence ? 1 : 0;
  const int64_t num_samples = num_samples_for(num_epochs, tokens_per_epoch, sequence_length,
                                              drop_last_partial_sequence, extra_token);
  TORCH_CHECK(num_samples >= 0, "expected a non-negative number of samples, got ", num_samples);

  std::vector<SampleBoundary> sample_index;
  sample_index.reserve(static_cast<size_t>(num_samples) + 1);
  const auto last_entry = static_cast<int64_t>(document_index.size()) - 1;
  int64_t entry = 0;
  int64_t offset = 0;
  sample_index.push_back({entry, offset});
  while (static_cast<int64_t>(sample_index.size()) <= num_samples) {
    int64_t remaining = sequence_length + extra_token;
    while (remaining != 0) {
      const int64_t available = sequence_lengths[document_index[entry]] - offset;
      remaining -= available;
      if (remaining <= 0) {
        // The next sample starts on this sample's extra token, hence "- extra_token".
        offset += remaining + available - extra_token;
        remaining = 0;
      } else {
        if (entry == last_entry) {
          offset = sequence_lengths[document_index[entry]] - extra_token;
          break;
        }
        ++entry;
        offset = 0;
      }
    }
    sample_index.push_back({entry, offset});
  }
  return sample_index;
}

std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size,
                                         NumpyRandomState& random_state) {
  TORCH_CHECK(0 <= num_samples && num_samples <= total_size,
              "expected 0 <= num_samples <= total_size, got ", num_samples, " and ", total_size);
  std::vector<int64_t> first(static_cast<size_t>(num_samples));
  for (int64_t i = 0; i < num_samples; ++i) first[i] = i;
  random_state.shuffle(first);
  if (num_samples == total_size) return first;
  std::vector<int64_t> last(static_cast<size_t>(total_size - num_samples));
  for (int64_t i = num_samples; i < total_size; ++i) last[i - num_samples] = i;
  random_state.shuffle(last);
  first.insert(first.end(), last.begin(), last.end());
  return first;
}

GptDataset::GptDataset(std::shared_ptr<const IndexedDataset> dataset, DatasetSplit split,
                       std::optional<int64_t> num_samples, GptDatasetOptions options)
    : dataset_(std::move(dataset)), split_(split), options_(std::move(options)) {
  TORCH_CHECK(dataset_ != nullptr, "GptDataset: expected an IndexedDataset, got null");
  const std::string where = dataset_->path_prefix() + " (" + dataset_split_name(split_) + ")";
  const int64_t sequence_length = options_.sequence_length();
  TORCH_CHECK(sequence_length > 1, where, ": sequence_length must be > 1, got ", sequence_length);
  TORCH_CHECK(!num_samples || *num_samples >= 0, where, ": num_samples must be >= 0, got ",
              *num_samples);
  TORCH_CHECK(dataset_->num_sequences() <= std::numeric_limits<int32_t>::max(), where,
              ": expected at most 2^31 - 1 sequences (Megatron's int32 document index), got ",
              dataset_->num_sequences());
  const int64_t extra_token = options_.add_extra_token_to_sequence() ? 1 : 0;

  // First, the split's sequences and the epochs num_samples needs.
  const auto range = split_sequence_range(options_.split(), split_, dataset_->num_sequences());
  TORCH_CHECK(range && range->first < range->second, where, ": split \"", options_.split(),
              "\" gives this split no sequences of the ", dataset_->num_sequences(),
              " in the dataset");
  sequence_range_ = *range;
  std::vector<int32_t> documents;
  int64_t tokens_per_epoch = 0;
  for (int64_t sequence = sequence_range_.first; sequence < sequence_range_.second; ++sequence) {
    documents.push_back(static_cast<int32_t>(sequence));
    tokens_per_epoch += dataset_->sequence_lengths()[sequence];
  }
  TORCH_CHECK(tokens_per_epoch > 1, where, ": expected more than one token in sequences [",
              sequence_range_.first, ", ", sequence_range_.second, "), got ", tokens_per_epoch);
  if (num_samples) {
    const int64_t tokens_requested = *num_samples * sequence_length + extra_token;
    for (int64_t tokens = tokens_per_epoch; tokens < tokens_requested; tokens += tokens_per_epoch) {
      ++num_epochs_;
    }
  }

  // Next, whether the final epoch is shuffled apart: when it contributes fewer than 80% of an
  // epoch's samples, so its few samples are not spread over the whole run.
  int64_t num_samples_sans_final_epoch = 0;
  if (num_epochs_ > 1) {
    num_samples_sans_final_epoch =
        ((num_epochs_ - 1) * tokens_per_epoch - extra_token) / sequence_length;
    const int64_t num_samples_from_final_epoch = *num_samples - num_samples_sans_final_epoch;
    const int64_t num_samples_per_epoch = (tokens_per_epoch - extra_token) / sequence_length;
    TORCH_CHECK(0 <= num_samples_from_final_epoch &&
                    num_samples_from_final_epoch <= num_samples_per_epoch + 1,
                where, ": inconsistent epoch arithmetic (", num_samples_from_final_epoch,
                " samples from the final epoch, ", num_samples_per_epoch, " per epoch)");
    separate_final_epoch_ = num_samples_from_final_epoch <
                           static_cast<int64_t>(kSeparateFinalEpochThreshold *
                                                static_cast<double>(num_samples_per_epoch));
  }

  // Finally, the three indices, drawn from one RandomState in Megatron's order.
  NumpyRandomState random_state(options_.random_seed());
  document_index_ =
      build_document_index(documents, num_epochs_, random_state, separate_final_epoch_);
  const bool drop_last_partial_sequence =
      split_ != DatasetSplit::kValid || options_.drop_last_partial_validation_sequence();
  sample_index_ = build_sample_index(dataset_->sequence_lengths(), document_index_, sequence_length,
                                     num_epochs_, tokens_per_epoch, drop_last_partial_sequence,
                                     options_.add_extra_token_to_sequence());
  shuffle_index_ = build_shuffle_index(separate_final_epoch_ ? num_samples_sans_final_epoch : size(),
                                       size(), random_state);
}

torch::Tensor GptDataset::sample(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < size(), dataset_->path_prefix(), " (",
              dataset_split_name(split_), "): expected a sample index in [0, ", size(), "), got ",
              index);
  const int64_t extra_token = options_.add_extra_token_to_sequence() ? 1 : 0;
  const int64_t window = options_.sequence_length() + extra_token;
  const int64_t shuffled = shuffle_index_[index];
  const SampleBoundary begin = sample_index_[shuffled];
  const SampleBoundary end = sample_index_[shuffled + 1];

  std::vector<torch::Tensor> parts;
  for (int64_t entry = begin.document_index_entry; entry <= end.document_index_entry; ++entry) {
    const int64_t offset = entry == begin.document_index_entry ? begin.token_offset : 0;
    const int64_t length =
        entry == end.document_index_entry ? end.token_offset + extra_token - offset : -1;
    parts.push_back(dataset_->get(document_index_[entry], offset, length));
  }
  torch::Tensor tokens = torch::cat(parts);
  TORCH_CHECK(tokens.size(0) <= window, dataset_->path_prefix(), ": sample ", index, " spans ",
              tokens.size(0), " tokens, expected at most ", window);
  if (tokens.size(0) < window) {
    tokens =
        torch::cat({tokens, torch::full({window - tokens.size(0)}, kPadTokenId, torch::kLong)});
  }
  return tokens;
}

std::pair<torch::Tensor, torch::Tensor> GptDataset::tokens_and_labels(int64_t index) const {
  const torch::Tensor window = sample(index);
  torch::Tensor tokens;
  torch::Tensor labels;
  if (options_.add_extra_token_to_sequence()) {
    tokens = window.slice(0, 0, -1).clone();
    labels = window.slice(0, 1).clone();
  } else {
    tokens = window.clone();
    labels = torch::roll(window, -1, 0);
    labels[-1] = kPadTokenId;
  }
  tokens.masked_fill_(tokens == kPadTokenId, 0);
  labels.masked_fill_(labels == kPadTokenId, 0);
  return {tokens, labels};
}

}  // namespace amp8::recipes
