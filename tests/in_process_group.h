#pragma once

// N data-parallel ranks inside one process, for CPU tests of code that takes a
// c10d::ProcessGroup: each rank is a thread with a c10d::ProcessGroup whose backend is
// InProcessBackend (the pip LibTorch ships no Gloo headers). Collectives are synchronous: every
// rank deposits its tensors, waits for the others (at most `timeout`, then it throws naming the
// ranks that never came), computes its result from all of them and writes it after a second
// rendezvous, so in-place collectives (output inside input) are safe. A rank may defer its
// all-gathers (defer_allgathers): each then runs when its Work is waited for, which is what a
// collective still in flight looks like to the code that launched it (its output unwritten).
// Reductions run in float32 (float64 for float64) in rank order. Every collective is logged per rank (op, dtype, bytes),
// so tests can assert what travelled.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace amp8::testing {

class InProcessWorld {
 public:
  struct Record {
    std::string op;
    c10::ScalarType dtype;
    int64_t bytes;  // of this rank's input
  };

  InProcessWorld(int size, std::chrono::milliseconds timeout)
      : size_(size), timeout_(timeout), slots_(size), arrived_(size, false), log_(size) {}

  int size() const { return size_; }

  /// Deposits `mine`, waits for every rank, returns compute(all ranks' tensors) computed on this
  /// rank, after every rank has computed its own (so the caller may then overwrite its inputs).
  std::vector<at::Tensor> collective(int rank, const std::string& op, std::vector<at::Tensor> mine,
                                     const std::function<std::vector<at::Tensor>(
                                         const std::vector<std::vector<at::Tensor>>&)>& compute) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& t : mine) log_[rank].push_back({op, t.scalar_type(), t.numel() * static_cast<int64_t>(t.element_size())});
      slots_[rank] = std::move(mine);
    }
    rendezvous(rank, op);
    std::vector<std::vector<at::Tensor>> all;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      all = slots_;
    }
    auto result = compute(all);
    rendezvous(rank, op);
    return result;
  }

  void rendezvous(int rank, const std::string& op) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto generation = generation_;
    arrived_[rank] = true;
    if (++count_ == size_) {
      count_ = 0;
      std::fill(arrived_.begin(), arrived_.end(), false);
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != generation; })) {
      std::string missing;
      for (int r = 0; r < size_; ++r) {
        if (!arrived_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      TORCH_CHECK(false, "InProcessGroup: ", op, " on rank ", rank, " timed out after ", timeout_.count(),
                  " ms: rank(s) ", missing, " never joined it");
    }
  }

  /// Logs what a rank launched without running it yet (a deferred all-gather).
  void note(int rank, const std::string& op, const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mutex_);
    log_[rank].push_back({op, t.scalar_type(), t.numel() * static_cast<int64_t>(t.element_size())});
  }

  std::vector<Record> log(int rank) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return log_[rank];
  }

 private:
  int size_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::vector<at::Tensor>> slots_;
  std::vector<bool> arrived_;
  int count_ = 0;
  int64_t generation_ = 0;
  std::vector<std::vector<Record>> log_;
};

class InProcessBackend : public c10d::Backend {
 public:
  InProcessBackend(std::shared_ptr<InProcessWorld> world, int rank)
      : c10d::Backend(rank, world->size()), world_(std::move(world)) {}

  const std::string getBackendName() const override { return "in_process"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    for (auto& tensor : tensors) {
      auto result = world_->collective(rank_, "allreduce", {tensor}, [&](const auto& all) {
        std::vector<at::Tensor> parts;
        for (const auto& slot : all) parts.push_back(slot[0]);
        return std::vector<at::Tensor>{reduce(parts, opts.reduceOp)};
      });
      tensor.copy_(result[0]);
    }
    return done();
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(input.numel() == output.numel() * size_, "_reduce_scatter_base: sizes");
    const int64_t n = output.numel();
    auto result = world_->collective(rank_, "reduce_scatter", {input}, [&](const auto& all) {
      std::vector<at::Tensor> parts;
      for (const auto& slot : all) parts.push_back(slot[0].reshape(-1).narrow(0, rank_ * n, n));
      return std::vector<at::Tensor>{reduce(parts, opts.reduceOp)};
    });
    output.copy_(result[0].view(output.sizes()));
    return done();
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                  const c10d::AllgatherOptions&) override {
    TORCH_CHECK(output.numel() == input.numel() * size_, "_allgather_base: sizes");
    if (defer_allgathers_) {
      world_->note(rank_, "allgather launched", input);  // logged as "allgather" when it runs
      return c10::make_intrusive<DeferredWork>(
          [this, output, input]() mutable { allgather_now(output, input); });
    }
    allgather_now(output, input);
    return done();
  }

  /// From now on this rank's all-gathers run when their Work is waited for (every rank must wait
  /// for them in the same order, as it launches them).
  void defer_allgathers() { defer_allgathers_ = true; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    for (auto& tensor : tensors) {
      auto result = world_->collective(rank_, "broadcast", {tensor}, [&](const auto& all) {
        return std::vector<at::Tensor>{all[opts.rootRank][0].clone()};
      });
      tensor.copy_(result[0]);
    }
    return done();
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    world_->rendezvous(rank_, "barrier");
    return done();
  }

 private:
  void allgather_now(at::Tensor& output, at::Tensor& input) {
    auto result = world_->collective(rank_, "allgather", {input}, [&](const auto& all) {
      std::vector<at::Tensor> parts;
      for (const auto& slot : all) parts.push_back(slot[0].reshape(-1).clone());
      return std::vector<at::Tensor>{at::cat(parts)};
    });
    output.copy_(result[0].view(output.sizes()));
  }

  class DoneWork : public c10d::Work {
   public:
    DoneWork() { finish(); }
  };
  static c10::intrusive_ptr<c10d::Work> done() { return c10::make_intrusive<DoneWork>(); }
  // An all-gather that runs when it is waited for (defer_allgathers).
  class DeferredWork : public c10d::Work {
   public:
    explicit DeferredWork(std::function<void()> run) : run_(std::move(run)) {}
    bool wait(std::chrono::milliseconds) override {
      if (run_) {
        auto run = std::move(run_);
        run_ = nullptr;
        run();
        finish();
      }
      return true;
    }
    bool isCompleted() override { return !run_; }

   private:
    std::function<void()> run_;
  };

  at::Tensor reduce(const std::vector<at::Tensor>& parts, const c10d::ReduceOp& op) const {
    const auto dtype = parts[0].scalar_type();
    const auto acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
    auto result = parts[0].to(acc, /*non_blocking=*/false, /*copy=*/true);
    for (size_t r = 1; r < parts.size(); ++r) {
      const auto part = parts[r].to(acc);
      switch (op.op_) {
        case c10d::ReduceOp::SUM:
        case c10d::ReduceOp::AVG: result.add_(part); break;
        case c10d::ReduceOp::MAX: result = at::maximum(result, part); break;
        case c10d::ReduceOp::MIN: result = at::minimum(result, part); break;
        case c10d::ReduceOp::PRODUCT: result.mul_(part); break;
        default: TORCH_CHECK(false, "InProcessBackend: unsupported reduce op");
      }
    }
    if (op.op_ == c10d::ReduceOp::AVG) result.div_(static_cast<double>(parts.size()));
    return result.to(dtype);
  }

  std::shared_ptr<InProcessWorld> world_;
  bool defer_allgathers_ = false;
};

/// See InProcessBackend::defer_allgathers; `group` from make_in_process_group.
inline void defer_allgathers(c10d::ProcessGroup& group) {
  auto backend = group.getBackend(c10::DeviceType::CPU);
  auto* in_process = dynamic_cast<InProcessBackend*>(backend.get());
  TORCH_CHECK(in_process != nullptr, "defer_allgathers: not an in-process group");
  in_process->defer_allgathers();
}

inline c10::intrusive_ptr<c10d::ProcessGroup> make_in_process_group(std::shared_ptr<InProcessWorld> world,
                                                                   int rank) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world->size());
  auto backend = c10::make_intrusive<InProcessBackend>(world, rank);
  // The collectives are plain ATen ops, so CUDA tensors work too (all ranks on one GPU).
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return group;
}

/// Runs fn(rank, group) on `size` threads; returns each rank's error ("" when it succeeded).
inline std::vector<std::string> run_ranks(
    int size, const std::function<void(int, c10::intrusive_ptr<c10d::ProcessGroup>)>& fn,
    std::chrono::milliseconds timeout = std::chrono::seconds(60),
    std::shared_ptr<InProcessWorld>* world_out = nullptr) {
  auto world = std::make_shared<InProcessWorld>(size, timeout);
  if (world_out) *world_out = world;
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        fn(rank, make_in_process_group(world, rank));
      } catch (const c10::Error& e) {
        errors[rank] = std::getenv("AMP8_TEST_BACKTRACE") ? e.what() : e.what_without_backtrace();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return errors;
}

}  // namespace amp8::testing
