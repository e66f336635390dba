#pragma once

#include <cstdint>
#include <string>

namespace amp8::recipes {

/// What a save-dir already holds from an earlier run: its metrics lines and checkpoints.
struct RunFolderContents {
  int64_t metrics_lines = 0;      ///< lines in metrics.jsonl
  int64_t last_metrics_step = 0;  ///< the largest "step" in them
  int64_t checkpoints = 0;        ///< files in checkpoints/ named like a checkpoint
  std::string newest_checkpoint;  ///< the newest complete one for (rank, world), or ""

  bool holds_run() const { return metrics_lines > 0 || checkpoints > 0; }
  /// "metrics of 30 steps, 3 checkpoints (newest: …/step_00000030.ckpt)", for messages.
  std::string describe() const;
};

/// Looks at `save_dir` without changing it (a folder that does not exist holds nothing).
RunFolderContents inspect_run_folder(const std::string& save_dir, int rank = 0, int world_size = 1);

/// Cuts `metrics_path` back to the lines of steps <= `step`, so a resumed run's metrics do not
/// repeat the steps it runs again; replaces the file atomically. Nothing happens when the file
/// does not exist. Lines that are not JSON with a "step" (a torn last line) are dropped.
void trim_metrics(const std::string& metrics_path, int64_t step);

}  // namespace amp8::recipes
