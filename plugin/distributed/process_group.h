#pragma once

// Data-parallel process groups the way PyTorch makes them: rendezvous through c10d::TCPStore
// from the variables torchrun sets, ProcessGroupNCCL on the rank's LOCAL_RANK GPU.
//
//   torchrun --nproc-per-node=2 --no-python ./gpt_pretrain --config 125m
//
//   if (auto env = amp8::DistributedEnvironment::from_env()) {
//     plugin.set_process_group(amp8::init_process_group(*env));
//   }

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <optional>
#include <string>

namespace amp8 {

struct DistributedEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  int master_port = 0;
  bool use_agent_store = false;  // TORCHELASTIC_USE_AGENT_STORE: torchrun's agent hosts the store

  /// The torchrun variables, or nullopt when WORLD_SIZE is not set (not launched by torchrun).
  /// A missing or malformed RANK, LOCAL_RANK, MASTER_ADDR or MASTER_PORT (or WORLD_SIZE < 1, a
  /// rank outside [0, WORLD_SIZE)) throws c10::Error naming the variable and its value.
  static std::optional<DistributedEnvironment> from_env();
  /// The same from explicit values (a test, or a launcher of your own); checked alike.
  static DistributedEnvironment from_values(const std::string& rank, const std::string& world_size,
                                            const std::string& local_rank, const std::string& master_addr,
                                            const std::string& master_port);
};

/// The rendezvous of init_process_group: a c10d::TCPStore at MASTER_ADDR:MASTER_PORT, hosted
/// by rank 0, which waits until all WORLD_SIZE ranks have connected (or by torchrun's agent),
/// seen through the prefix "amp8_dp". A rank that does not arrive within `timeout` (or a server
/// that never starts) makes the others throw a c10::Error naming this rank, the address and what
/// the store reported, instead of waiting for ever.
c10::intrusive_ptr<c10d::Store> rendezvous(const DistributedEnvironment& env,
                                           std::chrono::milliseconds timeout = std::chrono::minutes(10));

/// ProcessGroupNCCL over a TCPStore at MASTER_ADDR:MASTER_PORT (hosted by rank 0, or by
/// torchrun's agent), on cuda:LOCAL_RANK (made the current device). `timeout` bounds the
/// rendezvous and every collective: when a rank dies, the others fail with NCCL's watchdog error
/// naming the collective that timed out instead of hanging. Throws when amp8 was built without
/// NCCL (no CUDA) or LOCAL_RANK has no GPU.
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(
    const DistributedEnvironment& env, std::chrono::milliseconds timeout = std::chrono::minutes(10));

/// Whether init_process_group can make a ProcessGroupNCCL: amp8 built with its CUDA kernels
/// against a LibTorch with NCCL (c10d's USE_C10D_NCCL, which both builds take from LibTorch).
bool nccl_available();

}  // namespace amp8
