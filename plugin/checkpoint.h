#pragma once

#include <torch/serialize/archive.h>

#include <string>

namespace amp8 {

/// Writes `archive` to `path` so that `path` always holds either its previous content or the
/// complete new one, never a torn file: the archive goes to a temporary file in the same
/// folder (`<path>.tmp.<pid>`), which is flushed to the disk (fsync) and renamed over `path`;
/// the folder is then synced so the rename survives a crash. Throws c10::Error naming the path
/// and the system error when any of it fails (the temporary file is removed).
void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path);

/// Reads a checkpoint written by save_atomically; throws c10::Error naming the path when the
/// file is missing, unreadable or not an archive.
void load_archive(torch::serialize::InputArchive& archive, const std::string& path);

}  // namespace amp8
