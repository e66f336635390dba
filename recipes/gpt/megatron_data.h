#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "recipes/data/blended_dataset.h"
#include "recipes/data/gpt_dataset.h"

namespace amp8::recipes {

/// gpt_pretrain's data from Megatron-Core indexed datasets (--data-prefix): one split (train or
/// validation) of one prefix (GptDataset) or of a blend, weighted "0.3 a 0.7 b" or by size "a b"
/// (BlendedGptDataset), with Megatron's sample order. Micro-batches take consecutive samples as Megatron's
/// MegatronPretrainingSampler hands them out: micro-batch i of the run (over steps, then
/// micro-batches, then ranks) is samples [i * batch_size, (i + 1) * batch_size).
class MegatronData {
 public:
  /// `blend`: Megatron's blend list (parse_blend): path prefixes (`.bin` / `.idx`), or
  /// weight/prefix pairs. `num_samples`: the samples the run draws (steps x global batch).
  /// Throws naming the prefix, the split or the vocabulary when the data cannot serve the run
  /// (an unweighted blend holds one epoch of each prefix), or holds a token id >= vocab_size
  /// (checked per batch).
  MegatronData(const std::string& blend, const std::string& split, int64_t seq, uint64_t seed,
               int64_t num_samples, int64_t vocab_size, DatasetSplit part = DatasetSplit::kTrain);

  /// (tokens, labels), int64 [batch_size, seq] on `device`, of micro-batch `index` of the run.
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t index, int64_t batch_size, const torch::Device& device) const;

  /// "megatron <blend> (split <split>, <n> train samples)", for the progress line.
  int64_t size() const;
  std::string source() const;
  /// The data's identity for a resume check: the blend, split and every prefix's sizes.
  std::string fingerprint() const;
  /// What the order of the samples follows from besides the data and the seed, for a resume
  /// check: each prefix's epoch count and whether its final epoch is shuffled apart ("epochs
  /// 1"; a blend: "<prefix>: epochs 2, final epoch apart; ..."). A resume with more --steps
  /// reads the samples in the checkpoint's order only while these stay the same.
  std::string sample_order() const;

 private:
  std::string blend_, split_;
  int64_t vocab_size_;
  DatasetSplit part_;
  std::shared_ptr<const GptDataset> single_;
  std::shared_ptr<const BlendedGptDataset> blended_;
  std::string fingerprint_;
};

}  // namespace amp8::recipes
