#pragma once

#include <torch/serialize/archive.h>

#include <cstddef>
#include <functional>
#include <cstdint>
#include <string>
#include <vector>

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
/// survives a crash. When any of it fails (a full disk, a file-size limit, an I/O error) it throws
/// c10::Error naming the path, the system error, the bytes the checkpoint needs and the bytes
/// free in the folder; the temporary file is removed and `path` keeps its previous content. The
/// archive is left as it was, so the caller's state is intact and a later save can succeed. (One
/// failure comes after the rename: the temporary file is closed once it is in place, so that it
/// stays marked as being written until then, FileBeingWritten; should that close fail, the error
/// says so, and `path` holds the new file, written and synced, whose checksum load_archive checks.)
/// `trailer` false writes the bare archive (no trailer, no checksum): a file torch::load reads
/// (export_fp32_model), with the same all-or-nothing write.
void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path, bool trailer = true);

/// What is wrong with the checkpoint file at `path`, or "" when it is complete: a missing or
/// non-regular file, no trailer, a truncated file, another format version or a checksum
/// mismatch, in load_archive's words. Reads the file; deserializes nothing.
std::string checkpoint_file_problem(const std::string& path);

/// Removes the temporary files (`<name>.tmp.<pid>`) that save_atomically left in `folder` when
/// its process was killed during a save; those being written (FileBeingWritten, whatever the pid
/// in their name) stay. Returns the paths removed.
std::vector<std::string> remove_stale_temporaries(const std::string& folder);

/// The trailer save_atomically writes after an archive of `length` bytes at `archive`: for tools
/// and tests that assemble a checkpoint file from an archive's bytes.
std::string checkpoint_trailer(const void* archive, size_t length);

/// Reads a checkpoint written by save_atomically, checking the trailer first: a missing file, a
/// file without the trailer, a truncated file, another format version or a checksum mismatch is
/// a c10::Error naming the path and what is wrong, thrown before anything is deserialized. The
/// archive's pickles are then checked with check_pickle_bounds before LibTorch unpickles them.
void load_archive(torch::serialize::InputArchive& archive, const std::string& path);

/// Checks a pickle (protocol 2, as LibTorch writes it) for what LibTorch's unpickler would turn
/// into an unbounded allocation before failing: it sizes its memo table by the ids it reads (a
/// PUT of id n makes room for n + 1 entries) and its strings by their length prefix, so one
/// corrupt id in a readable archive asks for up to 64 GB (fuzz_checkpoint_load found a 32 GB
/// request). A pickler numbers its memo entries 0, 1, 2, ... in order and writes no operand past
/// the end, so a PUT beyond the next id or an operand past the end is a c10::Error naming `what`,
/// the opcode and its byte offset. The walk stops at STOP, and at an opcode it does not know
/// (LibTorch then names that).
///
/// A tensor's storage is a persistent id ("storage", torch.<Type>Storage, key, location, numel):
/// LibTorch makes a storage of numel × element size bytes over the record data/<key>, however
/// long that record is, so a corrupt numel lets a tensor read past its data. When
/// `storage_record_bytes` is given (the size of record data/<key>, or -1 if there is none), a
/// storage whose bytes exceed its record is a c10::Error naming the key and both sizes.
void check_pickle_bounds(const uint8_t* data, size_t size, const std::string& what,
                         const std::function<int64_t(const std::string& key)>& storage_record_bytes = {});

}  // namespace amp8
