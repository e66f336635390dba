// Megatron-Core's indexed dataset and GPTDataset sample drawing, against what megatron-core itself
// wrote and drew (tests/data/megatron_indexed/, made by tools/make_indexed_fixture.py).

#include "recipes/data/indexed_dataset.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "recipes/data/blended_dataset.h"
#include "recipes/data/gpt_dataset.h"
#include "recipes/data/numpy_random_state.h"
#include "tests/test_util.h"

// Relative to the repository root: Bazel runs tests in their runfiles tree, CMake's ctest in the
// source folder (WORKING_DIRECTORY).
#define AMP8_MEGATRON_FIXTURE_DIR "tests/data/megatron_indexed"

namespace amp8::recipes {
namespace {

using nlohmann::json;
using testing::ExpectErrorContaining;

const json& expected() {
  static const json parsed = [] {
    const std::string path = std::string(AMP8_MEGATRON_FIXTURE_DIR) + "/expected.json";
    std::ifstream stream(path);
    EXPECT_TRUE(stream.good()) << "cannot read " << path;
    return json::parse(stream);
  }();
  return parsed;
}

std::string fixture_prefix(const json& dataset) {
  return std::string(AMP8_MEGATRON_FIXTURE_DIR) + "/" + dataset["prefix"].get<std::string>();
}

std::vector<int64_t> to_vector(const torch::Tensor& tensor) {
  const torch::Tensor contiguous = tensor.contiguous();
  EXPECT_EQ(contiguous.scalar_type(), torch::kLong);
  const int64_t* data = contiguous.data_ptr<int64_t>();
  return {data, data + contiguous.numel()};
}

std::optional<int64_t> optional_count(const json& value) {
  if (value.is_null()) return std::nullopt;
  return value.get<int64_t>();
}

DatasetSplit split_named(const std::string& name) {
  for (DatasetSplit split : {DatasetSplit::kTrain, DatasetSplit::kValid, DatasetSplit::kTest}) {
    if (name == dataset_split_name(split)) return split;
  }
  ADD_FAILURE() << "unknown split " << name;
  return DatasetSplit::kTrain;
}

GptDatasetOptions gpt_options(const json& gpt) {
  return GptDatasetOptions(gpt["sequence_length"].get<int64_t>())
      .random_seed(gpt["random_seed"].get<int64_t>())
      .split(gpt["split"].get<std::string>())
      .add_extra_token_to_sequence(gpt["add_extra_token_to_sequence"].get<bool>())
      .drop_last_partial_validation_sequence(
          gpt["drop_last_partial_validation_sequence"].get<bool>());
}

TEST(IndexedDatasetTest, FixtureComesFromMegatronCore) {
  EXPECT_EQ(expected()["megatron_core_version"].get<std::string>(), "0.16.1");
  EXPECT_EQ(expected()["datasets"].size(), 2u);
}

TEST(IndexedDatasetTest, HeaderMatchesMegatron) {
  for (const json& described : expected()["datasets"]) {
    SCOPED_TRACE(described["prefix"].get<std::string>());
    const IndexedDataset dataset(fixture_prefix(described));
    EXPECT_EQ(dataset.dtype_code(), described["dtype_code"].get<int>());
    EXPECT_EQ(c10::toString(dataset.dtype()),
              std::string(described["dtype"] == "uint16" ? "UInt16" : "Int"));
    EXPECT_EQ(dataset.num_sequences(), described["sequence_count"].get<int64_t>());
    EXPECT_EQ(dataset.num_documents() + 1, described["document_count"].get<int64_t>());
    EXPECT_EQ(dataset.sequence_lengths(),
              described["sequence_lengths"].get<std::vector<int32_t>>());
    EXPECT_EQ(dataset.sequence_pointers(),
              described["sequence_pointers"].get<std::vector<int64_t>>());
    EXPECT_EQ(dataset.document_indices(),
              described["document_indices"].get<std::vector<int64_t>>());
  }
}

TEST(IndexedDatasetTest, EverySequenceMatchesMegatron) {
  for (const json& described : expected()["datasets"]) {
    SCOPED_TRACE(described["prefix"].get<std::string>());
    const IndexedDataset dataset(fixture_prefix(described));
    const auto sequences = described["sequences"].get<std::vector<std::vector<int64_t>>>();
    ASSERT_EQ(static_cast<int64_t>(sequences.size()), dataset.num_sequences());
    int64_t largest_token = 0;
    for (int64_t i = 0; i < dataset.num_sequences(); ++i) {
      const std::vector<int64_t>& tokens = sequences[i];
      EXPECT_EQ(to_vector(dataset.get(i)), tokens) << "sequence " << i;
      // A window inside the sequence, as GPTDataset asks for at sample boundaries.
      if (tokens.size() >= 3) {
        const std::vector<int64_t> middle(tokens.begin() + 1, tokens.end() - 1);
        EXPECT_EQ(to_vector(dataset.get(i, 1, static_cast<int64_t>(middle.size()))), middle)
            << "sequence " << i << " from token 1";
        const std::vector<int64_t> tail(tokens.begin() + 2, tokens.end());
        EXPECT_EQ(to_vector(dataset.get(i, 2)), tail) << "sequence " << i << " from token 2";
      }
      for (int64_t token : tokens) largest_token = std::max(largest_token, token);
    }
    // The fixture reaches past the signed range of the stored type, so sign errors show.
    EXPECT_GT(largest_token, described["dtype"] == "uint16" ? 32767 : 65535);
  }
}

TEST(IndexedDatasetTest, GetRejectsRequestsOutsideTheSequence) {
  const json& described = expected()["datasets"][0];
  const IndexedDataset dataset(fixture_prefix(described));
  const int64_t length = dataset.sequence_lengths()[0];
  const std::string bin = dataset.bin_path();
  for (const auto& request : std::vector<std::function<void()>>{
           [&] { dataset.get(-1); },
           [&] { dataset.get(dataset.num_sequences()); },
           [&] { dataset.get(0, length + 1); },
           [&] { dataset.get(0, -1); },
           [&] { dataset.get(0, 1, length); },
       }) {
    try {
      request();
      ADD_FAILURE() << "an out-of-range get() did not throw";
    } catch (const c10::Error& error) {
      EXPECT_NE(std::string(error.what()).find(bin), std::string::npos) << error.what();
    }
  }
  EXPECT_EQ(dataset.get(0, length).numel(), 0);
}

// ---- malformed files ----

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream stream(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream stream(path, std::ios::binary | std::ios::trunc);
  stream.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A copy of the uint16 fixture in a scratch folder, for corrupting one file of it.
class MalformedIndexedDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string source = fixture_prefix(expected()["datasets"][0]);
    prefix_ =
        amp8::testing::scratch_path("indexed_dataset",
                                    ::testing::UnitTest::GetInstance()->current_test_info()->name())
            .string() +
        "/copy";
    std::filesystem::create_directories(std::filesystem::path(prefix_).parent_path());
    idx_ = read_bytes(source + ".idx");
    bin_ = read_bytes(source + ".bin");
    ASSERT_GT(idx_.size(), 34u);
    ASSERT_GT(bin_.size(), 2u);
    write_bytes(idx_path(), idx_);
    write_bytes(bin_path(), bin_);
    ASSERT_NO_THROW(IndexedDataset{prefix_}) << "the unmodified copy must open";
  }

  std::string idx_path() const { return prefix_ + ".idx"; }
  std::string bin_path() const { return prefix_ + ".bin"; }

  template <typename T>
  void write_idx_field(size_t offset, T value) {
    std::vector<char> bytes = idx_;
    std::memcpy(bytes.data() + offset, &value, sizeof(T));
    write_bytes(idx_path(), bytes);
  }

  // Opening must throw a c10::Error naming `file` and saying `expectation`.
  void expect_rejected(const std::string& file, const std::string& expectation) {
    try {
      IndexedDataset dataset(prefix_);
      ADD_FAILURE() << "opened a malformed dataset; expected an error naming " << file;
    } catch (const c10::Error& error) {
      const std::string message = error.what_without_backtrace();
      EXPECT_NE(message.find(file), std::string::npos) << message;
      EXPECT_NE(message.find(expectation), std::string::npos) << message;
    }
  }

  std::string prefix_;
  std::vector<char> idx_;
  std::vector<char> bin_;
};

// A .bin truncated under the reader (the prefix written again while a job reads it) faults on
// its mapping: an error naming the file, not a process killed by SIGBUS.
TEST_F(MalformedIndexedDatasetTest, ABinTruncatedUnderTheReaderIsAnError) {
  IndexedDataset dataset(prefix_);
  const int64_t last = dataset.num_sequences() - 1;
  EXPECT_NO_THROW(dataset.get(last, 0, -1));
  ASSERT_EQ(::truncate(bin_path().c_str(), 0), 0);
  try {
    dataset.get(last, 0, -1);
    ADD_FAILURE() << "read a truncated .bin";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what_without_backtrace())
                  .find(bin_path() + " could not be read (a bus error on its mapping"),
              std::string::npos)
        << error.what_without_backtrace();
  }
}

TEST_F(MalformedIndexedDatasetTest, BadMagic) {
  write_idx_field<char>(0, 'X');
  expect_rejected(idx_path(), "magic");
}

TEST_F(MalformedIndexedDatasetTest, BadVersion) {
  write_idx_field<uint64_t>(9, 2);
  expect_rejected(idx_path(), "expected version 1, got 2");
}

TEST_F(MalformedIndexedDatasetTest, UnknownDtypeCode) {
  write_idx_field<uint8_t>(17, 9);
  expect_rejected(idx_path(), "dtype code from 1 to 8");
  write_idx_field<uint8_t>(17, 0);
  expect_rejected(idx_path(), "got 0");
}

TEST_F(MalformedIndexedDatasetTest, SequenceCountBeyondTheFile) {
  write_idx_field<uint64_t>(18, uint64_t{1} << 62);
  expect_rejected(idx_path(), "cannot fit");
  write_idx_field<uint64_t>(18, (idx_.size() - 34) / 12 + 1);
  expect_rejected(idx_path(), "bytes for");
}

TEST_F(MalformedIndexedDatasetTest, TruncatedIdx) {
  write_bytes(idx_path(), std::vector<char>(idx_.begin(), idx_.end() - 8));
  expect_rejected(idx_path(), "bytes for");
  write_bytes(idx_path(), std::vector<char>(idx_.begin(), idx_.begin() + 20));
  expect_rejected(idx_path(), "34-byte header");
}

TEST_F(MalformedIndexedDatasetTest, TruncatedBin) {
  write_bytes(bin_path(), std::vector<char>(bin_.begin(), bin_.end() - 2));
  expect_rejected(bin_path(), "to lie inside the .bin");
}

TEST_F(MalformedIndexedDatasetTest, SequencePointerOutsideTheBin) {
  const auto num_sequences = expected()["datasets"][0]["sequence_count"].get<size_t>();
  write_idx_field<int64_t>(34 + 4 * num_sequences, static_cast<int64_t>(bin_.size()));
  expect_rejected(bin_path(), "sequence 0");
  write_idx_field<int64_t>(34 + 4 * num_sequences, -2);
  expect_rejected(bin_path(), "sequence 0");
}

TEST_F(MalformedIndexedDatasetTest, DocumentIndicesOutOfOrder) {
  const auto num_sequences = expected()["datasets"][0]["sequence_count"].get<size_t>();
  write_idx_field<int64_t>(34 + 12 * num_sequences + 8, int64_t{1} << 40);
  expect_rejected(idx_path(), "non-decreasing document indices");
}

TEST_F(MalformedIndexedDatasetTest, DocumentIndicesEndBeforeTheLastSequence) {
  // Found by fuzz_indexed_dataset: the last entry must be S, or the sequences after it belong to
  // no document.
  const auto num_sequences = expected()["datasets"][0]["sequence_count"].get<int64_t>();
  const auto document_count = expected()["datasets"][0]["document_count"].get<size_t>();
  write_idx_field<int64_t>(34 + 12 * static_cast<size_t>(num_sequences) + 8 * (document_count - 1),
                           num_sequences - 1);
  expect_rejected(idx_path(), "to end at the sequence count");
}

TEST_F(MalformedIndexedDatasetTest, NonIntegralFloatTokensAreRefusedWhenRead) {
  // Found by fuzz_indexed_dataset: a float32 dataset opens (its .idx is sound) and refuses, with
  // an error naming the .bin, the first read of a token that is not an integer.
  bin_.assign(bin_.size(), 0);
  const float not_an_id = 2.5f;
  std::memcpy(bin_.data(), &not_an_id, sizeof(float));
  write_bytes(bin_path(), bin_);
  // float32, and every sequence one token long, so each lies inside the .bin and the .idx opens;
  // sequence 0 starts at byte 0 and reads the 2.5 written above.
  std::vector<char> idx = idx_;
  idx[17] = 7;
  const auto num_sequences = expected()["datasets"][0]["sequence_count"].get<size_t>();
  const int32_t one_token = 1;
  for (size_t s = 0; s < num_sequences; ++s) std::memcpy(idx.data() + 34 + 4 * s, &one_token, 4);
  ASSERT_EQ(expected()["datasets"][0]["sequence_pointers"][0].get<int64_t>(), 0);
  write_bytes(idx_path(), idx);
  IndexedDataset dataset(prefix_);
  ASSERT_EQ(dataset.dtype(), c10::ScalarType::Float);
  try {
    dataset.get(0);
    ADD_FAILURE() << "read a non-integral float token as a token id";
  } catch (const c10::Error& error) {
    const std::string message = error.what_without_backtrace();
    EXPECT_NE(message.find(bin_path()), std::string::npos) << message;
    EXPECT_NE(message.find("expected integral token ids, got 2.5"), std::string::npos) << message;
  }
}

TEST_F(MalformedIndexedDatasetTest, FifoInsteadOfAFile) {
  ASSERT_EQ(std::remove(bin_path().c_str()), 0);
  ASSERT_EQ(::mkfifo(bin_path().c_str(), 0600), 0);
  expect_rejected(bin_path(), "not a regular file");
  ASSERT_EQ(std::remove(idx_path().c_str()), 0);
  ASSERT_EQ(::mkfifo(idx_path().c_str(), 0600), 0);
  expect_rejected(idx_path(), "not a regular file");
}

TEST_F(MalformedIndexedDatasetTest, MissingFile) {
  ASSERT_EQ(std::remove(bin_path().c_str()), 0);
  expect_rejected(bin_path(), "cannot open");
}

// ---- GPTDataset sample drawing ----

TEST(GptDatasetTest, SplitRangesMatchMegatron) {
  for (const json& described : expected()["split_ranges"]) {
    const auto split = described["split"].get<std::string>();
    const auto num_sequences = described["num_sequences"].get<int64_t>();
    SCOPED_TRACE("split \"" + split + "\" over " + std::to_string(num_sequences));
    for (DatasetSplit which : {DatasetSplit::kTrain, DatasetSplit::kValid, DatasetSplit::kTest}) {
      const json& range = described["ranges"][static_cast<size_t>(which)];
      const auto actual = split_sequence_range(split, which, num_sequences);
      if (range.is_null()) {
        EXPECT_FALSE(actual.has_value()) << dataset_split_name(which);
      } else {
        ASSERT_TRUE(actual.has_value()) << dataset_split_name(which);
        EXPECT_EQ(actual->first, range[0].get<int64_t>()) << dataset_split_name(which);
        EXPECT_EQ(actual->second, range[1].get<int64_t>()) << dataset_split_name(which);
      }
    }
  }
}

TEST(GptDatasetTest, MalformedSplitsAreRejected) {
  for (const std::string split : {"1,2,3,4", "0,0,0", "1.2.3,1"}) {
    try {
      split_matrix_from_string(split);
      ADD_FAILURE() << "accepted split \"" << split << "\"";
    } catch (const c10::Error& error) {
      EXPECT_NE(std::string(error.what()).find(split), std::string::npos) << error.what();
    }
  }
}

TEST(GptDatasetTest, NumpyRandomStateMatchesNumpy) {
  const json& draws = expected()["random_state"]["bounded_draws"];
  NumpyRandomState wide(draws["seed"].get<int64_t>());
  for (const json& value : draws["values"]) {
    EXPECT_EQ(wide.random_interval(draws["max"].get<uint64_t>()), value.get<uint64_t>());
  }
  const json& shuffle = expected()["random_state"]["shuffle"];
  NumpyRandomState random_state(shuffle["seed"].get<int64_t>());
  std::vector<int64_t> permutation(shuffle["size"].get<size_t>());
  for (size_t i = 0; i < permutation.size(); ++i) permutation[i] = static_cast<int64_t>(i);
  random_state.shuffle(permutation);
  EXPECT_EQ(permutation, shuffle["values"].get<std::vector<int64_t>>());
  EXPECT_THROW(NumpyRandomState(-1), c10::Error);
  EXPECT_THROW(NumpyRandomState(int64_t{1} << 32), c10::Error);
}

// Each dataset × split of the fixture, with the dataset opened once.
struct DrawnSplit {
  std::string name;
  const json* described;
  std::shared_ptr<const GptDataset> dataset;
};

std::vector<DrawnSplit> drawn_splits() {
  std::vector<DrawnSplit> splits;
  for (const json& described : expected()["datasets"]) {
    const auto indexed = std::make_shared<const IndexedDataset>(fixture_prefix(described));
    const json& gpt = described["gpt"];
    for (const auto& [split_name, split] : gpt["splits"].items()) {
      splits.push_back({described["prefix"].get<std::string>() + " " + split_name, &split,
                        std::make_shared<const GptDataset>(
                            indexed, split_named(split_name),
                            optional_count(split["num_samples_requested"]), gpt_options(gpt))});
    }
  }
  return splits;
}

TEST(GptDatasetTest, IndicesMatchMegatron) {
  const std::vector<DrawnSplit> splits = drawn_splits();
  ASSERT_EQ(splits.size(), 4u);
  bool some_split_spans_epochs = false;
  for (const DrawnSplit& drawn : splits) {
    SCOPED_TRACE(drawn.name);
    const json& split = *drawn.described;
    const GptDataset& dataset = *drawn.dataset;
    EXPECT_EQ(dataset.sequence_range().first, split["sequence_range"][0].get<int64_t>());
    EXPECT_EQ(dataset.sequence_range().second, split["sequence_range"][1].get<int64_t>());
    EXPECT_EQ(dataset.size(), split["length"].get<int64_t>());
    EXPECT_EQ(dataset.document_index(), split["document_index"].get<std::vector<int32_t>>());
    const auto sample_index = split["sample_index"].get<std::vector<std::vector<int64_t>>>();
    ASSERT_EQ(dataset.sample_index().size(), sample_index.size());
    for (size_t i = 0; i < sample_index.size(); ++i) {
      EXPECT_EQ(dataset.sample_index()[i].document_index_entry, sample_index[i][0]) << "row " << i;
      EXPECT_EQ(dataset.sample_index()[i].token_offset, sample_index[i][1]) << "row " << i;
    }
    EXPECT_EQ(dataset.shuffle_index(), split["shuffle_index"].get<std::vector<int64_t>>());
    some_split_spans_epochs = some_split_spans_epochs || dataset.num_epochs() > 1;
  }
  EXPECT_TRUE(some_split_spans_epochs);
}

TEST(GptDatasetTest, SamplesMatchMegatron) {
  for (const DrawnSplit& drawn : drawn_splits()) {
    SCOPED_TRACE(drawn.name);
    const json& samples = (*drawn.described)["samples"];
    ASSERT_FALSE(samples.empty());
    const int64_t sequence_length = drawn.dataset->options().sequence_length();
    for (size_t i = 0; i < samples.size(); ++i) {
      const auto tokens = samples[i]["tokens"].get<std::vector<int64_t>>();
      const auto labels = samples[i]["labels"].get<std::vector<int64_t>>();
      ASSERT_EQ(static_cast<int64_t>(tokens.size()), sequence_length);
      const auto [actual_tokens, actual_labels] = drawn.dataset->tokens_and_labels(i);
      EXPECT_EQ(to_vector(actual_tokens), tokens) << "sample " << i;
      EXPECT_EQ(to_vector(actual_labels), labels) << "sample " << i;
      // The raw window is the tokens followed by the last label.
      std::vector<int64_t> window = tokens;
      window.push_back(labels.back());
      EXPECT_EQ(to_vector(drawn.dataset->sample(i)), window) << "sample " << i;
    }
    EXPECT_THROW(drawn.dataset->sample(drawn.dataset->size()), c10::Error);
    EXPECT_THROW(drawn.dataset->sample(-1), c10::Error);
  }
}

TEST(GptDatasetTest, EmptySplitIsRejectedNamingTheDataset) {
  const json& described = expected()["datasets"][0];
  const auto indexed = std::make_shared<const IndexedDataset>(fixture_prefix(described));
  try {
    GptDataset(indexed, DatasetSplit::kTest, std::nullopt, GptDatasetOptions(8).split("1,1,0"));
    ADD_FAILURE() << "built a GPTDataset over an empty split";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find(indexed->path_prefix()), std::string::npos)
        << error.what();
  }
}

// ---- BlendedDataset ----

TEST(BlendedGptDatasetTest, ParsesWeightedAndUnweightedBlendsAsMegatronDoes) {
  const std::vector<BlendComponent> blend = parse_blend(" 0.3 path/a\t70 path/b ");
  ASSERT_EQ(blend.size(), 2u);
  EXPECT_EQ(blend[0].weight, 0.3);
  EXPECT_EQ(blend[0].path_prefix, "path/a");
  EXPECT_EQ(blend[1].weight, 70.0);
  EXPECT_EQ(blend[1].path_prefix, "path/b");
  // get_blend_from_list: prefixes only, an odd word count, or pairs without a single numeric
  // first word are unweighted prefixes.
  const std::vector<std::pair<std::string, std::vector<std::string>>> unweighted = {
      {"path/a", {"path/a"}},
      {"path/a path/b", {"path/a", "path/b"}},
      {"0.3 a 0.7", {"0.3", "a", "0.7"}},
      {"a 0.7 b 0.3", {"a", "0.7", "b", "0.3"}}};
  for (const auto& [text, prefixes] : unweighted) {
    const auto parsed = parse_blend(text);
    ASSERT_EQ(parsed.size(), prefixes.size()) << text;
    for (size_t i = 0; i < parsed.size(); ++i) {
      EXPECT_FALSE(parsed[i].weight.has_value()) << text;
      EXPECT_EQ(parsed[i].path_prefix, prefixes[i]) << text;
    }
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "expected prefixes"},
      {"0 a", "expected a positive weight before prefix \"a\""},
      {"-1 a", "expected a positive weight"},
      {"inf a", "expected a positive weight"},
      {"0.3 a x b", "give every prefix a weight, or none"}};
  for (const auto& [text, message] : bad) {
    ExpectErrorContaining([&] { parse_blend(text); }, message);
  }
}

// The weighted and the unweighted blend of the fixture, as BlendedMegatronDatasetBuilder built them.
class BlendMatchesMegatronTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BlendMatchesMegatronTest, IndicesAndSamplesMatchMegatron) {
  const json& described = expected()[GetParam()];
  std::string blend_string;
  for (size_t i = 0; i < described["prefixes"].size(); ++i) {
    if (!described["weights"].is_null()) blend_string += std::to_string(described["weights"][i].get<double>()) + " ";
    blend_string += std::string(AMP8_MEGATRON_FIXTURE_DIR) + "/" + described["prefixes"][i].get<std::string>() + " ";
  }
  const std::vector<BlendComponent> blend = parse_blend(blend_string);
  ASSERT_EQ(blend.front().weight.has_value(), !described["weights"].is_null());
  const GptDatasetOptions options = GptDatasetOptions(described["sequence_length"].get<int64_t>())
                                        .random_seed(described["random_seed"].get<int64_t>())
                                        .split(described["split"].get<std::string>());
  for (const auto& [split_name, split] : described["splits"].items()) {
    SCOPED_TRACE(split_name);
    const BlendedGptDataset dataset(blend, split_named(split_name), split["size"].get<int64_t>(), options,
                                    described["mid_level_dataset_surplus"].get<double>());
    EXPECT_EQ(dataset.size(), split["length"].get<int64_t>());
    const auto mid_level_lengths = split["mid_level_lengths"].get<std::vector<int64_t>>();
    ASSERT_EQ(dataset.datasets().size(), mid_level_lengths.size());
    for (size_t i = 0; i < mid_level_lengths.size(); ++i) {
      EXPECT_EQ(dataset.datasets()[i]->size(), mid_level_lengths[i]) << "prefix " << i;
    }
    EXPECT_EQ(dataset.dataset_index(), split["dataset_index"].get<std::vector<int16_t>>());
    EXPECT_EQ(dataset.dataset_sample_index(),
              split["dataset_sample_index"].get<std::vector<int64_t>>());
    const json& samples = split["samples"];
    ASSERT_FALSE(samples.empty());
    for (size_t i = 0; i < samples.size(); ++i) {
      const auto [tokens, labels] = dataset.tokens_and_labels(static_cast<int64_t>(i));
      EXPECT_EQ(to_vector(tokens), samples[i]["tokens"].get<std::vector<int64_t>>())
          << "sample " << i;
      EXPECT_EQ(to_vector(labels), samples[i]["labels"].get<std::vector<int64_t>>())
          << "sample " << i;
    }
    EXPECT_THROW(dataset.sample(dataset.size()), c10::Error);
  }
}

INSTANTIATE_TEST_SUITE_P(WeightedAndUnweighted, BlendMatchesMegatronTest,
                         ::testing::Values("blend", "unweighted_blend"));

TEST(BlendedGptDatasetTest, WeightsMustBeGivenForEveryComponentOrNone) {
  const std::string prefix = std::string(AMP8_MEGATRON_FIXTURE_DIR) + "/gpt_uint16";
  ExpectErrorContaining(
      [&] {
        BlendedGptDataset({{0.5, prefix}, {std::nullopt, prefix}}, DatasetSplit::kTrain, 10, GptDatasetOptions(16));
      },
      "expected a weight for every component or for none; " + prefix + " has none");
}

}  // namespace
}  // namespace amp8::recipes
