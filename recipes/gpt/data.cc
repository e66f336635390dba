#include "recipes/gpt/data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>

#include "plugin/training/files.h"
#include "recipes/data/mapped_read.h"

namespace amp8::recipes {
namespace {

// A small grammar: "<det> <adj> <noun> <verb-agreeing> <det> <noun> <place>." with singular and
// plural subjects, numbers spelled out, questions and answers. Low entropy per byte, but only
// learnable by modelling words, agreement and punctuation.
std::string make_corpus(int64_t bytes) {
  const std::array<const char*, 8> adjectives = {"small", "quiet", "red",  "old",
                                                 "happy", "tall",  "blue", "clever"};
  const std::array<const char*, 8> nouns = {"cat", "dog", "bird", "child",
                                            "robot", "farmer", "horse", "teacher"};
  const std::array<const char*, 8> plurals = {"cats", "dogs", "birds", "children",
                                              "robots", "farmers", "horses", "teachers"};
  const std::array<const char*, 6> verbs = {"sees", "likes", "follows", "helps", "finds", "watches"};
  const std::array<const char*, 6> plural_verbs = {"see", "like", "follow", "help", "find", "watch"};
  const std::array<const char*, 6> places = {"in the garden", "near the river", "at school",
                                             "on the hill", "by the door", "under the tree"};
  const std::array<const char*, 10> numbers = {"zero", "one", "two",   "three", "four",
                                               "five", "six", "seven", "eight", "nine"};
  std::mt19937_64 rng(20261130);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  std::string text;
  text.reserve(static_cast<size_t>(bytes) + 128);
  while (static_cast<int64_t>(text.size()) < bytes) {
    const size_t kind = pick(4);
    if (kind == 3) {
      const size_t a = pick(5), b = pick(5);
      text += "what is " + std::string(numbers[a]) + " plus " + numbers[b] + "? it is " +
              numbers[a + b] + ".\n";
      continue;
    }
    const bool plural = kind == 1;
    std::string sentence = plural ? "the " : (pick(2) ? "the " : "a ");
    sentence += adjectives[pick(adjectives.size())];
    sentence += " ";
    sentence += plural ? plurals[pick(plurals.size())] : nouns[pick(nouns.size())];
    sentence += " ";
    sentence += plural ? plural_verbs[pick(plural_verbs.size())] : verbs[pick(verbs.size())];
    sentence += " the ";
    sentence += nouns[pick(nouns.size())];
    sentence += " ";
    sentence += places[pick(places.size())];
    sentence += kind == 2 ? ", and it is " + std::string(adjectives[pick(adjectives.size())]) + ".\n"
                          : ".\n";
    text += sentence;
  }
  text.resize(static_cast<size_t>(bytes));
  return text;
}

}  // namespace


ByteDataset ByteDataset::from_file(const std::string& path) {
  // stat before open: opening a FIFO would wait for a writer forever.
  const auto problem = regular_file_problem(path, "data file");
  TORCH_CHECK(problem.empty(), problem);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  TORCH_CHECK(fd >= 0, "data file ", path, " cannot be opened: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, "data file ", path, " is not a regular file");
  }
  if (st.st_size < 2) {
    ::close(fd);
    TORCH_CHECK(false, "data file ", path, " is empty (", st.st_size,
                " bytes); it needs at least seq + 1 bytes of text");
  }
  void* mapped = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int error = errno;
  if (mapped == MAP_FAILED) ::close(fd);
  TORCH_CHECK(mapped != MAP_FAILED, "data file ", path, " cannot be memory-mapped: ",
              std::strerror(error));
  const auto size = static_cast<size_t>(st.st_size);
  ByteDataset dataset;
  dataset.bytes_ = std::shared_ptr<const uint8_t>(static_cast<const uint8_t*>(mapped),
                                                  [size](const uint8_t* p) {
                                                    ::munmap(const_cast<uint8_t*>(p), size);
                                                  });
  // Kept open to notice a change under the running job (see check_unchanged).
  dataset.file_ = std::shared_ptr<const FileIdentity>(
      new FileIdentity{fd, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec},
      [](const FileIdentity* file) {
        ::close(file->fd);
        delete file;
      });
  dataset.size_ = static_cast<int64_t>(size);
  dataset.source_ = path;
  return dataset;
}

void ByteDataset::check_unchanged() const {
  if (!file_) return;
  struct stat st {};
  const bool same = ::fstat(file_->fd, &st) == 0 && st.st_size == file_->size &&
                    st.st_mtim.tv_sec == file_->mtime_s && st.st_mtim.tv_nsec == file_->mtime_ns;
  TORCH_CHECK(same, "data file ", source_, " changed while training (it was ", file_->size,
              " bytes when the run opened it, now ", st.st_size,
              " bytes, or it was rewritten): the run stops here; its checkpoints are intact, and "
              "resuming needs the original data back");
}

ByteDataset ByteDataset::builtin(int64_t bytes) {
  TORCH_CHECK(bytes >= 2, "ByteDataset::builtin: bytes must be >= 2, got ", bytes);
  auto text = std::make_shared<std::string>(make_corpus(bytes));
  ByteDataset dataset;
  dataset.bytes_ = std::shared_ptr<const uint8_t>(
      text, reinterpret_cast<const uint8_t*>(text->data()));
  dataset.size_ = static_cast<int64_t>(text->size());
  dataset.source_ = "built-in corpus";
  return dataset;
}

std::pair<ByteDataset, ByteDataset> ByteDataset::split_tail(double fraction) const {
  TORCH_CHECK(fraction > 0 && fraction < 1, "ByteDataset::split_tail: fraction must be in (0, 1), got ", fraction);
  const auto tail_size = static_cast<int64_t>(static_cast<double>(size_) * fraction);
  ByteDataset head = *this, tail = *this;
  head.size_ = size_ - tail_size;
  tail.bytes_ = std::shared_ptr<const uint8_t>(bytes_, bytes_.get() + head.size_);
  tail.size_ = tail_size;
  tail.source_ = source_ + " (held-out tail)";
  return {head, tail};
}

std::string ByteDataset::fingerprint() const {
  // FNV-1a over the first and the last MiB (the whole text when it is shorter than 2 MiB).
  constexpr int64_t kPart = int64_t{1} << 20;
  uint64_t hash = 0xcbf29ce484222325ULL;
  auto mix = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) hash = (hash ^ bytes_.get()[i]) * 0x100000001b3ULL;
  };
  check_unchanged();
  const bool copied = detail::copy_mapped([&] {
    mix(0, std::min(size_, kPart));
    mix(std::max(std::min(size_, kPart), size_ - kPart), size_);
  });
  TORCH_CHECK(copied, "data file ", source_, " could not be read (a bus error on its mapping)");
  char text[64];
  std::snprintf(text, sizeof(text), "%lld bytes, hash %016llx", static_cast<long long>(size_),
                static_cast<unsigned long long>(hash));
  return text;
}

// A copy from pageable memory would hold the host until the GPU has run everything queued before
// it (the previous step's optimizer); the GPU then idles while the host launches the next
// forward pass (1b FP8 trace of 2026-12-01: 1.95 ms of host time at each step's start).
torch::Tensor copy_to_device(const torch::Tensor& host, const torch::Device& device) {
  TORCH_CHECK(host.device().is_cpu(), "copy_to_device: host must be a CPU tensor, got one on ", host.device());
  if (!device.is_cuda()) return host.contiguous().to(device);
  return host.contiguous().pin_memory().to(device, /*non_blocking=*/true);
}

std::pair<torch::Tensor, torch::Tensor> ByteDataset::batch(uint64_t seed, int64_t step,
                                                           int64_t micro_batch, int64_t batch_size,
                                                           int64_t seq,
                                                           const torch::Device& device) const {
  TORCH_CHECK(batch_size >= 1 && seq >= 1, "batch size and sequence length must be >= 1, got ",
              batch_size, " and ", seq);
  TORCH_CHECK(size_ >= seq + 1, "the data (", source_, ", ", size_,
              " bytes) is shorter than seq + 1 = ", seq + 1, " bytes");
  auto generator = at::make_generator<at::CPUGeneratorImpl>(
      seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(step) * 1000003ULL +
      static_cast<uint64_t>(micro_batch));
  auto starts = torch::randint(size_ - seq, {batch_size}, generator, torch::kLong);
  auto window = torch::empty({batch_size, seq + 1}, torch::kLong);
  auto* out = window.data_ptr<int64_t>();
  const auto* begin = starts.data_ptr<int64_t>();
  const uint8_t* text = bytes_.get();
  check_unchanged();
  // A file truncated under the mapping faults (SIGBUS) instead of reading: copy_mapped turns
  // that into false, and the check above (or this one) into an error naming the file.
  const bool copied = detail::copy_mapped([&] {
    for (int64_t b = 0; b < batch_size; ++b) {
      const uint8_t* src = text + begin[b];
      for (int64_t i = 0; i <= seq; ++i) out[b * (seq + 1) + i] = src[i];
    }
  });
  check_unchanged();
  TORCH_CHECK(copied, "data file ", source_, " could not be read (a bus error on its mapping: it "
              "was truncated or its storage failed while training); the run stops here");
  return {copy_to_device(window.narrow(1, 0, seq), device), copy_to_device(window.narrow(1, 1, seq), device)};
}

}  // namespace amp8::recipes
