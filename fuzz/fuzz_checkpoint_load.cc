// Fuzzes checkpoint loading. The first byte picks how the rest reaches the loader:
//   even: written as is (no, partial or corrupt trailers; truncations; bit flips);
//   odd:  given a valid amp8 trailer first, so torch's archive reader and amp8's checks of the
//         archive's contents (precision, shapes, masters, scaler) see the mutated bytes.
// A bad file must be a c10::Error, and a failed load must leave the model as it was.
#include "plugin/training/checkpoint.cc"  // the trailer check under test, instrumented

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "fuzz_scratch.h"
#include "plugin/training/trainer.h"
#include "recipes/precision.h"

namespace {

std::string scratch_file() {
  static const std::string path = amp8::fuzz::scratch_file("checkpoint", ".ckpt");
  return path;
}

torch::nn::Sequential fuzz_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16));
}

}  // namespace

// AMP8_FUZZ_WRITE_SEEDS=DIR: writes the seed inputs (a real checkpoint of the fuzzed model after
// two fp16 steps, as both input kinds) into DIR and exits. That is how fuzz/corpus/ was made.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("AMP8_FUZZ_WRITE_SEEDS");
  if (dir == nullptr) return 0;
  auto model = fuzz_model();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  amp8::Trainer trainer(amp8::TrainerOptions().max_steps(2).log_every_n_steps(0),
                        amp8::recipes::fp16_mixed().fp16_initial_loss_scale(1024));
  trainer.fit(*model, optimizer, [&](const amp8::TrainStepInput& in) {
    auto x = torch::randn({8, 16});
    return torch::mse_loss(in.precision.convert_output(model->forward(in.precision.convert_input(x))), x);
  });
  const std::string file = std::string(dir) + "/checkpoint.ckpt";
  trainer.save_checkpoint(file, *model, optimizer);
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(std::string(dir) + "/as_written", std::ios::binary) << '\x00' << bytes;
  std::ofstream(std::string(dir) + "/archive_only", std::ios::binary)
      << '\x01' << bytes.substr(0, bytes.size() - amp8::kTrailerBytes);
  std::remove(file.c_str());
  std::exit(0);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // AMP8_FUZZ_VERBOSE=1: print what each input's load ended in (to triage an input by hand).
  static const bool verbose = std::getenv("AMP8_FUZZ_VERBOSE") != nullptr;
  if (size == 0) return 0;
  const bool with_trailer = data[0] & 1;
  const uint8_t* payload = data + 1;
  const size_t length = size - 1;
  {
    std::ofstream out(scratch_file(), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(payload), static_cast<std::streamsize>(length));
    if (with_trailer) {
      const std::string trailer = amp8::checkpoint_trailer(payload, length);
      out.write(trailer.data(), static_cast<std::streamsize>(trailer.size()));
    }
  }
  auto model = fuzz_model();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  amp8::Trainer trainer(amp8::TrainerOptions().max_steps(1),
                        amp8::recipes::fp16_mixed().fp16_initial_loss_scale(1024));
  try {  // connects the plugin (params to fp16, FP32 masters), then fails on the missing file
    trainer.load_checkpoint(scratch_file() + ".missing", *model, optimizer);
  } catch (const c10::Error&) {
  }
  std::vector<torch::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
  try {
    trainer.load_checkpoint(scratch_file(), *model, optimizer);
    if (verbose) std::fprintf(stderr, "fuzz_checkpoint_load: loaded\n");
  } catch (const c10::Error& e) {
    if (verbose) std::fprintf(stderr, "fuzz_checkpoint_load: %s\n", e.what_without_backtrace());
    // Nothing half-loaded: the model is what it was.
    size_t i = 0;
    for (const auto& p : model->parameters()) {
      if (!p.detach().equal(before[i++])) __builtin_trap();
    }
  }
  return 0;
}
