#include "plugin/distributed/process_group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <charconv>
#include <cstdlib>

#if defined(AMP8_WITH_CUDA) && defined(USE_C10D_NCCL)
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define AMP8_HAS_NCCL 1
#endif

namespace amp8 {
namespace {

int parse_int(const std::string& name, const std::string& value, int min, int max) {
  int parsed = 0;
  const auto* end = value.data() + value.size();
  const auto [ptr, error] = std::from_chars(value.data(), end, parsed);
  TORCH_CHECK(!value.empty() && error == std::errc() && ptr == end && parsed >= min && parsed <= max,
              name, " must be an integer in [", min, ", ", max, "], got \"", value, "\"");
  return parsed;
}

std::string required(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr, name,
              " is not set: WORLD_SIZE is, so this looks like a torchrun launch, which also sets "
              "RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT");
  return value;
}

}  // namespace

DistributedEnvironment DistributedEnvironment::from_values(const std::string& rank, const std::string& world_size,
                                                           const std::string& local_rank,
                                                           const std::string& master_addr,
                                                           const std::string& master_port) {
  DistributedEnvironment env;
  env.world_size = parse_int("WORLD_SIZE", world_size, 1, 1 << 20);
  env.rank = parse_int("RANK", rank, 0, env.world_size - 1);
  env.local_rank = parse_int("LOCAL_RANK", local_rank, 0, env.world_size - 1);
  TORCH_CHECK(!master_addr.empty(), "MASTER_ADDR must be a host name or address, got \"\"");
  env.master_addr = master_addr;
  env.master_port = parse_int("MASTER_PORT", master_port, 1, 65535);
  return env;
}

std::optional<DistributedEnvironment> DistributedEnvironment::from_env() {
  const char* world = std::getenv("WORLD_SIZE");
  if (world == nullptr) return std::nullopt;
  // One at a time, so the first missing variable is the one named.
  const auto rank = required("RANK");
  const auto local_rank = required("LOCAL_RANK");
  const auto master_addr = required("MASTER_ADDR");
  const auto master_port = required("MASTER_PORT");
  auto env = from_values(rank, world, local_rank, master_addr, master_port);
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.use_agent_store = agent != nullptr && std::string(agent) == "True";
  return env;
}

c10::intrusive_ptr<c10d::Store> rendezvous(const DistributedEnvironment& env, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0 && !env.use_agent_store;
  store_options.numWorkers = env.use_agent_store ? std::nullopt : std::optional<std::size_t>(env.world_size);
  store_options.waitWorkers = !env.use_agent_store;
  store_options.timeout = timeout;
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  try {
    tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    TORCH_CHECK(false, "init_process_group: rank ", env.rank, " of ", env.world_size,
                ": the rendezvous at ", env.master_addr, ":", env.master_port, " failed (timeout ",
                timeout.count(), " ms; a rank that did not start or died before it, an address "
                "that does not resolve, or a port in use?): ",
                error ? error->what_without_backtrace() : e.what());
  }
  return c10::make_intrusive<c10d::PrefixStore>("amp8_dp", tcp);
}

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const DistributedEnvironment& env,
                                                          std::chrono::milliseconds timeout) {
#ifdef AMP8_HAS_NCCL
  const auto devices = c10::cuda::device_count();
  TORCH_CHECK(env.local_rank < devices, "LOCAL_RANK ", env.local_rank, " has no GPU: this machine has ",
              static_cast<int>(devices), " (launch at most that many processes per node)");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(env.local_rank));
  auto store = rendezvous(env, timeout);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, env.rank, env.world_size, options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, env.rank, env.world_size);
  group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  return group;
#else
  TORCH_CHECK(false, "init_process_group: this amp8 was built without CUDA/NCCL (AMP8_WITH_CUDA and "
              "USE_C10D_NCCL); data-parallel runs need ProcessGroupNCCL");
#endif
}

bool nccl_available() {
#ifdef AMP8_HAS_NCCL
  return true;
#else
  return false;
#endif
}

}  // namespace amp8
