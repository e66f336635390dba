// What a long job meets from its operator, through gpt_pretrain's entry point and the Trainer:
// full disks, reused and shared save-dirs, signals, data that changes, bad numbers.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/sgd.h>

#include "plugin/training/checkpoint.h"
#include "plugin/training/files.h"
#include "plugin/training/trainer.h"
#include "recipes/data/mapped_read.h"
#include "recipes/gpt/cli.h"
#include "recipes/gpt/data.h"
#include "recipes/gpt/run_folder.h"
#include "tests/gpt_pretrain_cli.h"
#include "tests/test_util.h"

namespace amp8::recipes {
namespace {

namespace fs = std::filesystem;
using testing::ExpectErrorContaining;

using Run = testing::CliRun;
using testing::gpt_pretrain;
using testing::metrics;

fs::path scratch(const std::string& name) { return testing::scratch_path("run_robustness", name); }

std::vector<std::string> tiny(const fs::path& dir, std::vector<std::string> more) {
  std::vector<std::string> args = {"--config", "tiny", "--device", "cpu", "--seq", "32", "--micro-batch", "4",
                                   "--log-every", "0", "--save-dir", dir.string()};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

std::string ckpt(int step) { return Trainer::checkpoint_name(step); }

// ---- save-dirs: reuse, sharing, the last step, leftovers ----

TEST(RunRobustnessTest, ASecondRunIntoASaveDirThatHoldsARunIsRefusedUnlessItResumes) {
  const auto dir = scratch("reuse");
  ASSERT_EQ(gpt_pretrain(tiny(dir, {"--steps", "4"})).code, 0);
  const auto before = metrics(dir);
  ASSERT_EQ(before.size(), 4u);

  const auto again = gpt_pretrain(tiny(dir, {"--steps", "4"}));
  EXPECT_NE(again.code, 0);
  EXPECT_NE(again.err.find("already holds a run (metrics of 4 steps"), std::string::npos) << again.err;
  EXPECT_NE(again.err.find("--resume " + dir.string()), std::string::npos) << again.err;
  EXPECT_EQ(metrics(dir), before) << "the first run's metrics are untouched";

  // NeMo's AutoResume: continue where it is (the schedule's length changes, so it is allowed).
  const auto resumed = gpt_pretrain(tiny(dir, {"--steps", "6", "--resume-if-exists", "true", "--allow-changes", "steps"}));
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  const auto after = metrics(dir);
  ASSERT_EQ(after.size(), 6u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(after[i]["step"].get<int>(), i + 1);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(after[i], before[i]);
}

TEST(RunRobustnessTest, AFolderInUseByAnotherRunIsRefused) {
  const auto dir = scratch("locked");
  FolderLock other_run(dir.string());  // flock is per open file: this process counts as another run
  const auto run = gpt_pretrain(tiny(dir, {"--steps", "2"}));
  EXPECT_NE(run.code, 0);
  EXPECT_NE(run.err.find("is in use by another run (process " + std::to_string(::getpid())), std::string::npos)
      << run.err;
  EXPECT_FALSE(fs::exists(dir / "metrics.jsonl"));
}

TEST(RunRobustnessTest, TheLastStepIsAlwaysSaved) {
  const auto dir = scratch("last");
  ASSERT_EQ(gpt_pretrain(tiny(dir, {"--steps", "7", "--save-every", "3"})).code, 0);
  for (int step : {3, 6, 7}) EXPECT_TRUE(fs::exists(dir / "checkpoints" / ckpt(step))) << step;
  EXPECT_FALSE(fs::exists(dir / "checkpoints" / ckpt(9)));
  const auto larger = scratch("larger");
  ASSERT_EQ(gpt_pretrain(tiny(larger, {"--steps", "4", "--save-every", "10"})).code, 0);
  EXPECT_TRUE(fs::exists(larger / "checkpoints" / ckpt(4)));
}

// A temporary file is a save in progress while its writer marks it (FileBeingWritten), whatever
// pid its name records: a killed writer's file goes even when its pid is in use again (here: this
// process's, as a restarted container's trainer often has), a marked one stays.
TEST(RunRobustnessTest, TemporaryFilesOfKilledSavesAreRemovedSavesInProgressStay) {
  const auto dir = scratch("leftovers");
  fs::create_directories(dir / "checkpoints");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);  // now a pid of a process that is gone
  const auto dead = dir / "checkpoints" / (ckpt(3) + ".tmp." + std::to_string(child));
  const auto reused = dir / "checkpoints" / (ckpt(2) + ".tmp." + std::to_string(::getpid()));
  const auto live = dir / "checkpoints" / (ckpt(3) + ".tmp." + std::to_string(::getpid()));
  std::ofstream(dead) << "half a checkpoint";
  std::ofstream(reused) << "half a checkpoint of a killed run whose pid this process has now";
  FileBeingWritten writing(live.string());
  ASSERT_EQ(::write(writing.fd(), "a save", 6), 6);
  auto removed = remove_stale_temporaries((dir / "checkpoints").string());
  std::sort(removed.begin(), removed.end());
  EXPECT_EQ(removed, (std::vector<std::string>{reused.string(), dead.string()}));
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_FALSE(fs::exists(reused));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_FALSE(remove_unless_being_written(dead.string())) << "a file that is not there";
  EXPECT_EQ(writing.close(), "");
  EXPECT_TRUE(remove_unless_being_written(live.string())) << "closed: no longer being written";
}

// A remover that takes a temporary file between its creation and its mark (the window of a save
// that is just starting) does not cost the save its file: the writer makes it again.
TEST(RunRobustnessTest, AFileRemovedBeforeItsMarkIsMadeAgain) {
  const auto dir = scratch("removed_before_mark");
  fs::create_directories(dir);
  const auto path = (dir / (ckpt(1) + ".tmp.1")).string();
  std::atomic<bool> done{false};
  std::atomic<int> removed{0};
  std::thread remover([&] {
    while (!done.load()) removed += remove_unless_being_written(path) ? 1 : 0;
  });
  struct Join {  // also when an ASSERT returns early
    std::atomic<bool>& done;
    std::thread& thread;
    ~Join() {
      done = true;
      thread.join();
    }
  } join{done, remover};
  for (int i = 0; i < 2000; ++i) {
    FileBeingWritten file(path);
    struct stat by_fd {}, by_path {};
    ASSERT_EQ(::fstat(file.fd(), &by_fd), 0);
    ASSERT_EQ(::stat(path.c_str(), &by_path), 0) << "attempt " << i << ": the marked file was removed";
    ASSERT_EQ(by_fd.st_ino, by_path.st_ino) << "attempt " << i;
    ASSERT_FALSE(remove_unless_being_written(path)) << "attempt " << i;
    ASSERT_EQ(file.close(), "");
    if (i % 100 == 0) {  // now and then, give the remover time to find the file unmarked (a loaded machine)
      const int before = removed.load();
      for (int wait = 0; wait < 1000 && removed.load() == before; ++wait) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
  }
  EXPECT_GT(removed.load(), 0) << "the remover never found the file unmarked";
}

// save_atomically marks its temporary file in use: a remove_stale_temporaries meanwhile (another
// rank's Trainer starting on the same folder) leaves it, and every save completes.
TEST(RunRobustnessTest, ASaveInProgressOutlivesTheRemovalOfStaleTemporaries) {
  const auto dir = scratch("save_in_progress");
  fs::create_directories(dir);
  torch::serialize::OutputArchive archive;
  archive.write("weights", torch::rand({16 << 20}));  // 64 MB: a write that takes a while
  std::atomic<bool> done{false};
  std::atomic<int> seen{0};  // times the remover found a save's temporary file
  std::thread remover([&] {
    while (!done.load()) {
      std::error_code error;
      for (const auto& entry : fs::directory_iterator(dir, error)) {
        if (entry.path().filename().string().find(".tmp.") != std::string::npos) seen += 1;
      }
      remove_stale_temporaries(dir.string());
    }
  });
  const auto path = (dir / ckpt(1)).string();
  for (int save = 0; save < 5; ++save) EXPECT_NO_THROW(save_atomically(archive, path)) << "save " << save;
  done = true;
  remover.join();
  EXPECT_GT(seen.load(), 0) << "the remover never ran during a save";
  EXPECT_EQ(checkpoint_file_problem(path), "");
}

// ---- files that are not what they seem ----

TEST(RunRobustnessTest, NonRegularFilesAreClearErrorsNotHangs) {
  const auto dir = scratch("fifo");
  fs::create_directories(dir);
  const auto fifo = dir / "data.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto data = gpt_pretrain(tiny(dir / "out", {"--steps", "2", "--data", fifo.string()}));
  EXPECT_NE(data.code, 0);
  EXPECT_NE(data.err.find("data file " + fifo.string() + " is a FIFO, not a regular file"), std::string::npos) << data.err;
  const auto resume = gpt_pretrain(tiny(dir / "out", {"--steps", "2", "--resume", "/dev/null"}));
  EXPECT_NE(resume.code, 0);
  EXPECT_NE(resume.err.find("/dev/null is a character device, not a regular file"), std::string::npos) << resume.err;
  const auto folder = gpt_pretrain(tiny(dir / "out", {"--steps", "2", "--data", dir.string()}));
  EXPECT_NE(folder.err.find("is a folder, not a regular file"), std::string::npos) << folder.err;
}

TEST(RunRobustnessTest, DataThatChangesUnderTheRunIsAnErrorNamingIt) {
  const auto dir = scratch("changing");
  fs::create_directories(dir);
  const auto path = dir / "text.txt";
  std::ofstream(path) << std::string(4096, 'a');
  auto data = ByteDataset::from_file(path.string());
  EXPECT_NO_THROW(data.batch(1, 0, 0, 2, 16, torch::kCPU));
  ASSERT_EQ(::truncate(path.c_str(), 100), 0);
  ExpectErrorContaining([&] { data.batch(1, 1, 0, 2, 16, torch::kCPU); },
                        "data file " + path.string() + " changed while training (it was 4096 bytes");
}

TEST(RunRobustnessTest, ABusErrorOnATruncatedMappingIsCaught) {
  const auto dir = scratch("sigbus");
  fs::create_directories(dir);
  const auto path = dir / "mapped";
  std::ofstream(path) << std::string(3 * 4096, 'b');
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  auto* mapped = static_cast<const volatile char*>(::mmap(nullptr, 3 * 4096, PROT_READ, MAP_SHARED, fd, 0));
  ::close(fd);
  ASSERT_NE(mapped, MAP_FAILED);
  char sum = 0;
  EXPECT_TRUE(detail::copy_mapped([&] { sum += mapped[2 * 4096]; }));
  EXPECT_EQ(sum, 'b');
  ASSERT_EQ(::truncate(path.c_str(), 10), 0);  // the last two pages are gone: reading them faults
  EXPECT_FALSE(detail::copy_mapped([&] { sum += mapped[2 * 4096]; }));
  EXPECT_TRUE(detail::copy_mapped([&] { sum += mapped[0]; })) << "the guard works again after a fault";
  EXPECT_THROW(detail::copy_mapped([] { throw std::runtime_error("not a fault"); }), std::runtime_error)
      << "an exception of the copy passes through";
  EXPECT_FALSE(detail::copy_mapped([&] { sum += mapped[2 * 4096]; })) << "and the guard still works";
  ::munmap(const_cast<char*>(mapped), 3 * 4096);
}

// ---- resuming ----

TEST(RunRobustnessTest, ResumingAtOrPastTheLastStepSaysThereIsNothingToDo) {
  const auto dir = scratch("done");
  ASSERT_EQ(gpt_pretrain(tiny(dir, {"--steps", "3"})).code, 0);
  const auto again = gpt_pretrain(tiny(dir, {"--steps", "3", "--resume", dir.string()}));
  EXPECT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("nothing to do: the checkpoint is at step 3, at or past --steps 3"), std::string::npos)
      << again.out;
  EXPECT_EQ(again.out.find("final loss"), std::string::npos) << again.out;
}

TEST(RunRobustnessTest, ACorruptNewestCheckpointIsNamedAndThePreviousOneResumes) {
  const auto full = scratch("full"), dir = scratch("corrupt");
  ASSERT_EQ(gpt_pretrain(tiny(full, {"--steps", "8"})).code, 0);
  ASSERT_EQ(gpt_pretrain(tiny(dir, {"--steps", "8", "--save-every", "4"})).code, 0);
  const auto newest = dir / "checkpoints" / ckpt(8);
  {
    std::fstream file(newest, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(100);
    file.put('\x7f');  // one byte of the archive: the checksum catches it
  }
  const auto resumed = gpt_pretrain(tiny(dir, {"--steps", "8", "--resume", dir.string()}));
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("skipping checkpoint checkpoint " + newest.string() + " is corrupt: checksum mismatch"),
            std::string::npos) << resumed.out;
  EXPECT_NE(resumed.out.find("resuming from the previous complete checkpoint " + (dir / "checkpoints" / ckpt(4)).string()),
            std::string::npos) << resumed.out;
  // Steps 5..8 ran again: the metrics hold each step once, as the uninterrupted run's.
  const auto a = metrics(full), b = metrics(dir);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(b[i]["step"].get<int>(), static_cast<int>(i) + 1);
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
  }
}

TEST(RunRobustnessTest, AResumeWithOtherSettingsIsRefusedUnlessAllowed) {
  const auto dir = scratch("settings");
  ASSERT_EQ(gpt_pretrain(tiny(dir, {"--steps", "3"})).code, 0);
  const auto other = gpt_pretrain(tiny(dir, {"--steps", "5", "--seed", "7", "--resume", dir.string()}));
  EXPECT_NE(other.code, 0);
  EXPECT_NE(other.err.find("was written with other settings: seed 1234 (this run: 7), steps 3 (this run: 5)"),
            std::string::npos) << other.err;
  EXPECT_NE(other.err.find("--allow-changes"), std::string::npos) << other.err;
  const auto unknown = gpt_pretrain(tiny(dir, {"--steps", "5", "--resume", dir.string(), "--allow-changes", "colour"}));
  EXPECT_NE(unknown.err.find("allow-changes: unknown setting \"colour\""), std::string::npos) << unknown.err;
  const auto allowed = gpt_pretrain(tiny(dir, {"--steps", "5", "--seed", "7", "--resume", dir.string(),
                                               "--allow-changes", "steps,seed"}));
  EXPECT_EQ(allowed.code, 0) << allowed.err;
  EXPECT_EQ(metrics(dir).size(), 5u);
}

// Another folder's checkpoint resumed into a save-dir that holds a run is refused (the two runs'
// metrics and checkpoints would be spliced); into a new folder (a fork) it resumes.
TEST(RunRobustnessTest, AResumeIntoAnotherRunsFolderIsRefused) {
  const auto first = scratch("splice_first"), second = scratch("splice_second"), fork = scratch("splice_fork");
  ASSERT_EQ(gpt_pretrain(tiny(first, {"--steps", "2"})).code, 0);
  ASSERT_EQ(gpt_pretrain(tiny(second, {"--steps", "2", "--seed", "7"})).code, 0);
  const auto before = metrics(second);
  const auto spliced = gpt_pretrain(tiny(second, {"--steps", "4", "--resume", first.string(), "--allow-changes", "steps"}));
  EXPECT_NE(spliced.code, 0);
  EXPECT_NE(spliced.err.find("is not in save-dir " + second.string() + ", which holds another run"), std::string::npos)
      << spliced.err;
  EXPECT_EQ(metrics(second), before) << "nothing written";
  const auto forked = gpt_pretrain(tiny(fork, {"--steps", "4", "--resume", first.string(), "--allow-changes", "steps"}));
  EXPECT_EQ(forked.code, 0) << forked.err;
  const auto resumed = gpt_pretrain(tiny(second, {"--steps", "4", "--seed", "7", "--resume", second.string(),
                                                  "--allow-changes", "steps"}));
  EXPECT_EQ(resumed.code, 0) << resumed.err;
}

// A profile of steps a resumed run never trains is an error, not an empty folder.
TEST(RunRobustnessTest, ProfilingStepsBeforeTheResumedStepIsAnError) {
  const auto dir = scratch("profile_resumed");
  ASSERT_EQ(gpt_pretrain(tiny(dir, {"--steps", "4"})).code, 0);
  const auto profiled = gpt_pretrain(tiny(dir, {"--steps", "6", "--resume", dir.string(), "--allow-changes", "steps",
                                                "--profile", (dir / "profile").string(), "--profile-first-step", "1",
                                                "--profile-steps", "2"}));
  EXPECT_NE(profiled.code, 0);
  EXPECT_NE(profiled.err.find("StepProfiler: steps [1, 3) come before this fit's first step 4"), std::string::npos)
      << profiled.err;
  // Steps [3, 6) of a run resumed at step 4: the profile holds steps 4 and 5, and says so.
  const auto partly = gpt_pretrain(tiny(dir, {"--steps", "6", "--resume", dir.string(), "--allow-changes", "steps",
                                              "--profile", (dir / "profile").string(), "--profile-first-step", "3",
                                              "--profile-steps", "3"}));
  ASSERT_EQ(partly.code, 0) << partly.err;
  EXPECT_NE(partly.out.find("profile of steps 4..5 (0-based)"), std::string::npos) << partly.out;
}

// Resumed from an older checkpoint of its own folder, a run would leave the newer ones to a later
// --resume of the folder, which would pick them and drop what it trained: refused, naming them.
TEST(RunRobustnessTest, ResumingFromAnOlderCheckpointOfTheFolderIsRefused) {
  const auto dir = scratch("older_checkpoint");
  ASSERT_EQ(gpt_pretrain(tiny(dir, {"--steps", "6", "--save-every", "2"})).code, 0);
  const auto older = gpt_pretrain(tiny(dir, {"--steps", "6", "--resume", (dir / "checkpoints" / ckpt(2)).string()}));
  EXPECT_NE(older.code, 0);
  EXPECT_NE(older.err.find("is older than " + (dir / "checkpoints" / ckpt(6)).string() + " in the same save-dir"),
            std::string::npos) << older.err;
  EXPECT_EQ(metrics(dir).size(), 6u) << "nothing written";
}

// --resume-if-exists on a folder with metrics and no checkpoint starts again, and says so.
TEST(RunRobustnessTest, ResumeIfExistsWithoutACheckpointSaysItStartsAgain) {
  const auto dir = scratch("no_checkpoint");
  ASSERT_EQ(gpt_pretrain(tiny(dir, {"--steps", "3", "--save-last", "false"})).code, 0);
  const auto again = gpt_pretrain(tiny(dir, {"--steps", "2", "--resume-if-exists", "true"}));
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("holds no checkpoint to resume (metrics of 3 steps"), std::string::npos) << again.out;
  EXPECT_EQ(metrics(dir).size(), 2u);
}

// Validating on byte-level data holds its last 5% out of training: a resume that turns
// validation on or off names that, not only "data".
TEST(RunRobustnessTest, TurningValidationOnAtAResumeNamesTheHeldOutData) {
  const auto dir = scratch("holdout");
  ASSERT_EQ(gpt_pretrain(tiny(dir, {"--steps", "2", "--eval-every", "0"})).code, 0);
  const auto resumed = gpt_pretrain(tiny(dir, {"--steps", "4", "--eval-every", "2", "--resume", dir.string(),
                                               "--allow-changes", "steps"}));
  EXPECT_NE(resumed.code, 0);
  EXPECT_NE(resumed.err.find("validation_holdout none (this run: the last 5% of the data)"), std::string::npos)
      << resumed.err;
}

// The FP8 knobs are settings of the run too: a resume with another margin, amax history or set
// of bf16 layers is refused by name (they once resumed silently).
TEST(RunRobustnessTest, AResumeWithOtherFp8SettingsIsRefused) {
  const auto dir = scratch("fp8_settings");
  const std::vector<std::string> fp8 = {"--precision", "bf16-mixed", "--fp8", "hybrid", "--fp8-min-gemm-size", "0"};
  const auto with_fp8 = [&](std::vector<std::string> more) {
    more.insert(more.end(), fp8.begin(), fp8.end());
    return tiny(dir, more);
  };
  ASSERT_EQ(gpt_pretrain(with_fp8({"--steps", "2"})).code, 0);
  const auto other = gpt_pretrain(with_fp8({"--steps", "2", "--resume", dir.string(), "--fp8-margin", "1",
                                            "--fp8-amax-history-len", "16", "--num-layers-at-start-in-bf16", "1"}));
  EXPECT_NE(other.code, 0);
  EXPECT_NE(other.err.find("was written with other settings: fp8_amax_history_len 1024 (this run: 16), fp8_margin 0 "
                           "(this run: 1), num_layers_at_start_in_bf16 0 (this run: 1)"),
            std::string::npos) << other.err;
}

// Runs gpt_pretrain with `args` in `dir` and sends the process SIGTERM (a scheduler's preemption)
// once `steps` steps are in its metrics (those of `run_folder` under `dir`, for --compare).
auto run_until_sigterm(const fs::path& dir, const std::vector<std::string>& args, int steps = 3,
                       const std::string& run_folder = "") {
  std::atomic<bool> done{false};
  std::thread preemption([&] {
    while (!done.load()) {
      std::ifstream in(dir / run_folder / "metrics.jsonl");
      const auto lines = std::count(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>(), '\n');
      if (lines >= steps) {
        ::kill(::getpid(), SIGTERM);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  const auto stopped = gpt_pretrain(tiny(dir, args));
  done = true;
  preemption.join();
  return stopped;
}

// SIGTERM mid-run: the step finishes, a checkpoint is saved, the exit code says so, and resuming
// from it gives the uninterrupted run's losses bit for bit.
TEST(RunRobustnessTest, SigtermFinishesTheStepSavesAndResumesExactly) {
  const auto full = scratch("full_term"), dir = scratch("term");
  ASSERT_EQ(gpt_pretrain(tiny(full, {"--steps", "40"})).code, 0);
  const auto stopped = run_until_sigterm(dir, {"--steps", "40"});
  ASSERT_EQ(stopped.code, 128 + SIGTERM) << stopped.out << stopped.err;
  const auto lines = metrics(dir);
  ASSERT_GE(lines.size(), 3u);
  ASSERT_LT(lines.size(), 40u) << "the run stopped early";
  const int last = lines.back()["step"].get<int>();
  EXPECT_NE(stopped.err.find("stopped by SIGTERM after step " + std::to_string(last) + " of 40; saved " +
                             (dir / "checkpoints" / ckpt(last)).string() + "; continue with --resume " + dir.string()),
            std::string::npos)
      << stopped.err;
  EXPECT_TRUE(fs::exists(dir / "checkpoints" / ckpt(last)));
  const auto resumed = gpt_pretrain(tiny(dir, {"--steps", "40", "--resume", dir.string()}));
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  const auto a = metrics(full), b = metrics(dir);
  ASSERT_EQ(b.size(), 40u);
  for (size_t i = 0; i < 40; ++i) EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
}

// Stopped past its last periodic save with --save-last false, a run says which steps will run
// again on a resume.
TEST(RunRobustnessTest, SigtermPastThePeriodicSaveSaysWhichStepsRunAgain) {
  const auto dir = scratch("term_periodic");
  // Every 5th step is saved; the stop lands on one of the four others most of the time (on a
  // saved step nothing runs again and the message says only where it saved).
  const auto stopped = run_until_sigterm(dir, {"--steps", "100000", "--save-every", "5", "--save-last", "false"}, 7);
  ASSERT_EQ(stopped.code, 128 + SIGTERM) << stopped.out << stopped.err;
  const int last = metrics(dir).back()["step"].get<int>();
  const int saved = last - last % 5;
  ASSERT_GT(saved, 0) << "stopped before the first periodic save";
  const std::string expected = "saved " + (dir / "checkpoints" / ckpt(saved)).string();
  EXPECT_NE(stopped.err.find(expected), std::string::npos) << stopped.err;
  const std::string again = "(steps " + std::to_string(saved + 1) + ".." + std::to_string(last) + " run again)";
  EXPECT_EQ(stopped.err.find(again) != std::string::npos, saved < last) << stopped.err;
}

// A run started with --resume-if-exists is continued by the same command (adding --resume to it
// would be refused: the two cannot be combined).
TEST(RunRobustnessTest, SigtermUnderResumeIfExistsSaysTheSameCommandContinues) {
  const auto dir = scratch("term_auto_resume");
  const std::vector<std::string> args = {"--steps", "40", "--resume-if-exists", "true"};
  const auto stopped = run_until_sigterm(dir, args);
  ASSERT_EQ(stopped.code, 128 + SIGTERM) << stopped.out << stopped.err;
  const int last = metrics(dir).back()["step"].get<int>();
  EXPECT_NE(stopped.err.find("of 40; saved " + (dir / "checkpoints" / ckpt(last)).string() +
                             "; continue with the same command"),
            std::string::npos)
      << stopped.err;
  const auto resumed = gpt_pretrain(tiny(dir, args));
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_EQ(metrics(dir).size(), 40u);
}

// With --save-last false a SIGTERM saves nothing, and the message says so instead of naming a
// checkpoint to resume from.
TEST(RunRobustnessTest, SigtermWithoutSaveLastSaysNothingWasSaved) {
  const auto dir = scratch("term_unsaved");
  const auto stopped = run_until_sigterm(dir, {"--steps", "100000", "--save-last", "false"});
  ASSERT_EQ(stopped.code, 128 + SIGTERM) << stopped.out << stopped.err;
  EXPECT_NE(stopped.err.find("of 100000; no checkpoint saved (--save-last false)"), std::string::npos) << stopped.err;
  EXPECT_EQ(stopped.err.find("--resume"), std::string::npos) << stopped.err;
  EXPECT_TRUE(fs::is_empty(dir / "checkpoints"));
}

// SIGTERM during a --compare run: that run saves and stops, the later runs do not start (one an
// earlier call finished keeps its row), the summary says where it stopped, and the exit code is
// the signal's, as for a single run. The same command then finishes the comparison.
TEST(RunRobustnessTest, SigtermStopsACompareAsItStopsARun) {
  const auto dir = scratch("term_compare");
  const std::vector<std::string> common = {"--steps", "40", "--resume-if-exists", "true"};
  auto with_runs = [&](const std::string& runs) {
    auto args = common;
    args.insert(args.end(), {"--compare", runs});
    return args;
  };
  const auto rows = [&] {
    std::ifstream file(dir / "compare.jsonl");
    std::vector<nlohmann::json> out;
    for (std::string line; std::getline(file, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  };
  ASSERT_EQ(gpt_pretrain(tiny(dir, with_runs("bf16-mixed"))).code, 0);
  const auto finished_row = rows().at(0);
  const auto stopped = run_until_sigterm(dir, with_runs("32,bf16-mixed"), 3, "32");
  ASSERT_EQ(stopped.code, 128 + SIGTERM) << stopped.out << stopped.err;
  const int last = metrics(dir / "32").back()["step"].get<int>();
  ASSERT_LT(last, 40) << "the run stopped early";
  const std::string where = "--compare run \"32\" stopped by SIGTERM after step " + std::to_string(last) +
                            " of 40; saved " + (dir / "32" / "checkpoints" / ckpt(last)).string() +
                            "; continue with the same command";
  EXPECT_NE(stopped.err.find(where), std::string::npos) << stopped.err;
  EXPECT_EQ(metrics(dir / "bf16-mixed").size(), 40u) << "the finished run did not run again";
  auto after_stop = rows();
  ASSERT_EQ(after_stop.size(), 2u);
  EXPECT_NE(after_stop[0]["error"].get<std::string>().find("stopped by SIGTERM after step " + std::to_string(last)),
            std::string::npos) << after_stop[0];
  EXPECT_EQ(after_stop[1]["run"], "bf16-mixed");
  EXPECT_EQ(after_stop[1]["final_loss"], finished_row["final_loss"]) << "the finished run keeps its row";

  const auto again = gpt_pretrain(tiny(dir, with_runs("32,bf16-mixed")));
  ASSERT_EQ(again.code, 0) << again.err;
  const auto done = rows();
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0]["run"], "32");
  EXPECT_EQ(done[0]["steps"], 40);
  EXPECT_TRUE(done[0]["final_loss"].is_number());
  EXPECT_TRUE(done[1]["final_loss_rel_diff_vs_32"].is_number());
}

// ---- numbers and names ----

TEST(RunRobustnessTest, NumbersOutOfRangeAreErrorsNamingTheFlag) {
  const auto dir = scratch("numbers");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--steps", "1e23"}, "--steps: expected a whole number in [1, 1099511627776], got \"1e23\""},
      {{"--steps", "-1"}, "--steps: must be in [1, 1099511627776], got -1"},
      {{"--steps", "0x10"}, "--steps: expected a whole number"},
      {{"--grad-accum", "18446744073709551616"}, "--grad-accum: must be in [1, 1048576], got 18446744073709551616"},
      {{"--seed", "-1"}, "--seed: must be in [0, 9223372036854775807], got -1"},
      {{"--micro-batch", "1.5"}, "--micro-batch: expected a whole number"},
      {{"--fp8", "hybrid", "--fp8-params", ""}, "--fp8-params: expected true or false, got \"\""},
      {{"--lr", "1e39"}, "--lr: must be in (0, 10], got 1e39"},
      {{"--lr", "nan"}, "--lr: expected a number, got \"nan\""},
      {{"--fp8", "hybrid", "--precision", "bf16-mixed", "--fp8-margin", "30"},
       "fp8_margin 30 would scale every tensor's largest value to 448 / 2^30"},
      {{"--fp8-amax-history-len", "16"}, "--fp8-amax-history-len is an FP8 setting, but no run uses FP8"},
      {{"--fp8-params", "false"}, "--fp8-params is an FP8 setting"},
      {{"--config", std::string("ti\x01ny")}, "config must be one of"},
      {{"--config", std::string("ti\x01ny")}, "ti\\x01ny"},
  };
  for (const auto& [flags, message] : cases) {
    const auto run = gpt_pretrain(tiny(dir, flags));
    EXPECT_NE(run.code, 0) << message;
    EXPECT_NE(run.err.find(message), std::string::npos) << "expected \"" << message << "\" in: " << run.err;
  }
  EXPECT_FALSE(fs::exists(dir)) << "a rejected run writes nothing";
}

TEST(RunRobustnessTest, NamesAreMatchedWithoutRegardToCaseForEveryFlag) {
  const auto dir = scratch("case");
  const auto run = gpt_pretrain({"--config", "TINY", "--device", "CPU", "--precision", "BF16-Mixed", "--fp8",
                                 "Hybrid", "--fp8-amax-compute-algo", "MAX", "--fp8-params", "FALSE", "--seq",
                                 "32", "--micro-batch", "2", "--steps", "2", "--log-every", "0", "--save-dir",
                                 dir.string()});
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_NE(run.out.find("precision bf16-mixed fp8=hybrid"), std::string::npos) << run.out;
}

TEST(RunRobustnessTest, AFailedCompareRunIsNamedAndTheOthersAreStillWritten) {
  const auto dir = scratch("compare");
  // The bf16-mixed run's folder already holds a run: that run is refused, the 32 run goes on.
  fs::create_directories(dir / "bf16-mixed");
  std::ofstream(dir / "bf16-mixed" / "metrics.jsonl") << "{\"step\": 1, \"loss\": 5}\n";
  const auto run = gpt_pretrain(tiny(dir, {"--steps", "2", "--compare", "bf16-mixed,32"}));
  EXPECT_NE(run.code, 0);
  EXPECT_NE(run.err.find("--compare run \"bf16-mixed\" failed: save-dir"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("1 of 2 runs failed"), std::string::npos) << run.err;
  std::ifstream in(dir / "compare.jsonl");
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_TRUE(rows[0].contains("error"));
  EXPECT_EQ(rows[1]["run"], "32");
  EXPECT_TRUE(rows[1].contains("final_loss"));
  EXPECT_TRUE(fs::exists(dir / "compare.svg"));
}

// ---- the Trainer: a full disk, a non-finite stop ----

struct TinyModel {
  torch::nn::Sequential model{torch::nn::Linear(512, 512)};
  torch::optim::SGD optimizer{model->parameters(), 0.01};
};

// A file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored) makes writes fail as a full disk does,
// without needing a small filesystem.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &previous_);
    previous_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit = previous_;
    limit.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &previous_);
    std::signal(SIGXFSZ, previous_handler_);
  }

 private:
  rlimit previous_{};
  void (*previous_handler_)(int) = nullptr;
};

TEST(RunRobustnessTest, AFullDiskDuringASaveIsAClearErrorThatKeepsThePreviousCheckpoint) {
  const auto dir = scratch("full_disk");
  fs::create_directories(dir);
  TinyModel a;
  Trainer trainer(TrainerOptions().max_steps(3).every_n_train_steps(1).log_every_n_steps(0).checkpoint_dir(dir.string()));
  trainer.log = &std::cerr;
  auto step = [&](const TrainStepInput&) { return a.model->forward(torch::ones({4, 512})).pow(2).mean(); };
  trainer.fit(*a.model, a.optimizer, step);  // steps 1..3 saved, ~1 MB each
  const auto previous = dir / ckpt(3);
  ASSERT_TRUE(fs::exists(previous));
  const auto weight_after_3 = a.model->parameters()[0].detach().clone();
  trainer.options.max_steps(4);
  {
    FileSizeLimit limit(64 * 1024);
    ExpectErrorContaining([&] { trainer.fit(*a.model, a.optimizer, step); },
                          "the checkpoint of step 4 could not be saved; the training state is intact in memory");
    ExpectErrorContaining([&] { trainer.save_checkpoint((dir / "x.ckpt").string(), *a.model, a.optimizer); },
                          "File too large): the checkpoint needs ");
  }
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().string().find(".tmp."), std::string::npos) << entry.path() << " was left behind";
  }
  EXPECT_EQ(checkpoint_file_problem(previous.string()), "") << "the previous checkpoint is intact";
  EXPECT_EQ(trainer.global_step(), 4) << "the step itself ran";
  // With room again, the state in memory saves and loads.
  const auto path = trainer.save_checkpoint((dir / "after.ckpt").string(), *a.model, a.optimizer);
  TinyModel b;
  Trainer reader(TrainerOptions().log_every_n_steps(0));
  reader.load_checkpoint(path, *b.model, b.optimizer);
  EXPECT_TRUE(b.model->parameters()[0].equal(a.model->parameters()[0]));
  EXPECT_FALSE(b.model->parameters()[0].equal(weight_after_3)) << "step 4's weights were saved";
}

// Cutting the metrics back on a resume with the disk full leaves them as they were and no
// temporary file behind.
TEST(RunRobustnessTest, AFullDiskWhileTrimmingTheMetricsLeavesThemAsTheyWere) {
  const auto dir = scratch("full_disk_metrics");
  fs::create_directories(dir);
  const auto path = (dir / "metrics.jsonl").string();
  {
    std::ofstream out(path);
    for (int step = 1; step <= 2000; ++step) out << "{\"step\":" << step << ",\"loss\":" << std::string(40, '1') << "}\n";
  }
  const auto before = fs::file_size(path);
  {
    FileSizeLimit limit(16 * 1024);
    ExpectErrorContaining([&] { trim_metrics(path, 1500); }, "failed (is the disk full?); ");
  }
  EXPECT_EQ(fs::file_size(path), before);
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().string().find(".tmp."), std::string::npos) << entry.path() << " was left behind";
  }
}

// A stop requested before a resumed fit's first step: the checkpoint it resumed from holds the
// state, and last_checkpoint() names it (gpt_pretrain said "no checkpoint saved").
TEST(RunRobustnessTest, AStopBeforeTheFirstStepOfAResumedFitNamesItsCheckpoint) {
  const auto dir = scratch("stop_at_resume");
  fs::create_directories(dir);
  TinyModel a, b;
  Trainer first(TrainerOptions().max_steps(2).log_every_n_steps(0).checkpoint_dir(dir.string()));
  first.fit(*a.model, a.optimizer, [&](const TrainStepInput&) { return a.model->forward(torch::ones({4, 512})).pow(2).mean(); });
  const auto saved = (dir / ckpt(2)).string();
  ASSERT_TRUE(fs::exists(saved));
  Trainer resumed(TrainerOptions().max_steps(4).log_every_n_steps(0).checkpoint_dir(dir.string()));
  resumed.request_stop();
  resumed.fit(*b.model, b.optimizer,
              [&](const TrainStepInput&) { return b.model->forward(torch::ones({4, 512})).pow(2).mean(); }, saved);
  EXPECT_TRUE(resumed.stopped());
  EXPECT_EQ(resumed.global_step(), 2);
  EXPECT_EQ(resumed.last_checkpoint(), saved);
}

TEST(RunRobustnessTest, ANonFiniteStopSavesTheWeightsItSaysItKeeps) {
  const auto dir = scratch("nonfinite");
  fs::create_directories(dir);
  TinyModel a;
  Trainer trainer(TrainerOptions().max_steps(10).every_n_train_steps(100).log_every_n_steps(0).checkpoint_dir(dir.string()));
  torch::Tensor weight_after_2;
  auto step = [&](const TrainStepInput& in) {
    if (in.step == 2) weight_after_2 = a.model->parameters()[0].detach().clone();
    auto loss = a.model->forward(torch::ones({4, 512})).pow(2).mean();
    return in.step == 2 ? loss * std::numeric_limits<float>::quiet_NaN() : loss;
  };
  const auto saved = dir / ckpt(2);
  ExpectErrorContaining([&] { trainer.fit(*a.model, a.optimizer, step); },
                        "the weights are those after the previous step (saved in " + saved.string() + ")");
  TinyModel b;
  Trainer reader(TrainerOptions().log_every_n_steps(0));
  reader.load_checkpoint(saved.string(), *b.model, b.optimizer);
  EXPECT_EQ(reader.global_step(), 2);
  EXPECT_TRUE(b.model->parameters()[0].equal(weight_after_2));
}

// ---- a micro-batch that does not fit ----

// An address-space limit (RLIMIT_AS) of what the process maps now plus `headroom` makes a large
// CPU allocation fail as it does on a full machine: the allocator gets ENOMEM and LibTorch's
// DefaultCPUAllocator throws, without this test needing (or touching) that much memory.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(rlim_t headroom) {
    ::getrlimit(RLIMIT_AS, &previous_);
    std::ifstream status("/proc/self/status");
    rlim_t mapped_kib = 0;
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("VmSize:", 0) == 0) mapped_kib = std::stoull(line.substr(7));
    }
    rlimit limit = previous_;
    limit.rlim_cur = mapped_kib * 1024 + headroom;
    EXPECT_EQ(::setrlimit(RLIMIT_AS, &limit), 0);
  }
  ~AddressSpaceLimit() { ::setrlimit(RLIMIT_AS, &previous_); }

 private:
  rlimit previous_{};
};

TEST(RunRobustnessTest, AMicroBatchThatCannotBeAllocatedOnTheCpuNamesTheFlag) {
#ifdef AMP8_UNDER_ASAN
  GTEST_SKIP() << "AddressSanitizer maps terabytes of shadow memory and aborts on a failed allocation";
#endif
  const auto dir = scratch("cpu_out_of_memory");
  // 131072 x 32 tokens: each [tokens, hidden 64] float32 activation is 1 GiB, beyond the headroom.
  testing::CliRun run{};  // (inside a TEST, Run is testing::Test::Run)
  {
    AddressSpaceLimit limit(rlim_t{512} << 20);
    run = gpt_pretrain(tiny(dir, {"--micro-batch", "131072", "--steps", "1"}));
  }
  EXPECT_EQ(run.code, 2) << run.err;
  EXPECT_EQ(run.err.rfind("gpt_pretrain: error: out of memory with micro-batches of 131072 x 32 tokens; lower "
                          "--micro-batch (and raise --grad-accum for the same batch), or keep fewer activations "
                          "with --recompute-method uniform, or halve Adam's state with --exp-avg-dtype bf16 "
                          "--exp-avg-sq-dtype bf16: ", 0),
            0u)
      << run.err;
  EXPECT_NE(run.err.find("DefaultCPUAllocator: can't allocate memory"), std::string::npos) << run.err;
  // With room again, the same flags but a small micro-batch train.
  const auto again = gpt_pretrain(tiny(scratch("cpu_out_of_memory_after"), {"--steps", "1"}));
  EXPECT_EQ(again.code, 0) << again.err;
}

}  // namespace
}  // namespace amp8::recipes
