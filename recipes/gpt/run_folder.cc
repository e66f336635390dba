#include "recipes/gpt/run_folder.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "plugin/training/trainer.h"

namespace amp8::recipes {
namespace {

namespace fs = std::filesystem;

// The step of a metrics line, or -1 when it is not one.
int64_t metrics_step(const std::string& line) {
  const auto json = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object() || !json.contains("step") || !json["step"].is_number_integer()) {
    return -1;
  }
  return json["step"].get<int64_t>();
}

}  // namespace

std::string RunFolderContents::describe() const {
  std::string text = "metrics of " + std::to_string(metrics_lines) + " steps";
  if (metrics_lines > 0) text += " (up to step " + std::to_string(last_metrics_step) + ")";
  text += ", " + std::to_string(checkpoints) + " checkpoint file(s)";
  if (!newest_checkpoint.empty()) text += " (newest complete: " + newest_checkpoint + ")";
  return text;
}

RunFolderContents inspect_run_folder(const std::string& save_dir, int rank, int world_size) {
  RunFolderContents contents;
  std::error_code error;
  std::ifstream metrics(fs::path(save_dir) / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const int64_t step = metrics_step(line);
    if (step < 0) continue;
    ++contents.metrics_lines;
    contents.last_metrics_step = std::max(contents.last_metrics_step, step);
  }
  const auto checkpoints = fs::path(save_dir) / "checkpoints";
  if (fs::is_directory(checkpoints, error)) {
    for (const auto& entry : fs::directory_iterator(checkpoints, error)) {
      if (Trainer::parse_checkpoint_name(entry.path().filename().string())) ++contents.checkpoints;
    }
    if (contents.checkpoints > 0) {
      contents.newest_checkpoint = Trainer::latest_checkpoint(checkpoints.string(), rank, world_size);
    }
  }
  return contents;
}

void trim_metrics(const std::string& metrics_path, int64_t step) {
  std::error_code error;
  if (!fs::exists(metrics_path, error)) return;
  std::ifstream in(metrics_path);
  TORCH_CHECK(in.good(), "cannot read the metrics file ", metrics_path);
  const std::string temporary = metrics_path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temporary, std::ios::trunc);
    TORCH_CHECK(out.good(), "cannot write ", temporary);
    for (std::string line; std::getline(in, line);) {
      const int64_t line_step = metrics_step(line);
      if (line_step >= 0 && line_step <= step) out << line << "\n";
    }
    out.flush();
    if (!out.good()) {  // a full disk: the metrics file stays as it was, and no temporary is left
      out.close();
      std::remove(temporary.c_str());
      TORCH_CHECK(false, "writing ", temporary, " failed (is the disk full?); ", metrics_path, " is unchanged");
    }
  }
  if (std::rename(temporary.c_str(), metrics_path.c_str()) != 0) {
    std::remove(temporary.c_str());
    TORCH_CHECK(false, "cannot replace the metrics file ", metrics_path);
  }
}

}  // namespace amp8::recipes
