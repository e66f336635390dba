#pragma once

#include <torch/serialize/archive.h>

#include <cstdint>
#include <string>

namespace amp8 {

/// The checkpoint file format: the torch::serialize archive (a zip file), then a 28-byte
/// trailer: "AMP8CKPT", the format version (uint32), the archive's length (uint64) and a 64-bit
/// checksum of the archive's bytes (uint64), little-endian. The checksum catches what the
/// archive format does not: a flipped bit in tensor data otherwise loads silently.
constexpr uint32_t kCheckpointFormatVersion = 1;

/// Writes `archive` to `path` so that `path` always holds either its previous content or the
/// complete new one, never a torn file: the archive (streamed, with its checksum computed on the
/// way) and the trailer go to a temporary file in the same folder (`<path>.tmp.<pid>`), which is
/// flushed to the disk (fsync) and renamed over `path`; the folder is then synced so the rename
/// survives a crash. Throws c10::Error naming the path and the system error when any of it
/// fails (the temporary file is removed).
void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path);

/// Reads a checkpoint written by save_atomically, checking the trailer first: a missing file, a
/// file without the trailer, a truncated file, another format version or a checksum mismatch is
/// a c10::Error naming the path and what is wrong, thrown before anything is deserialized.
void load_archive(torch::serialize::InputArchive& archive, const std::string& path);

}  // namespace amp8
