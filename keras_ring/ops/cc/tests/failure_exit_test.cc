// The process-ending half of failure handling, in forked children: how a process whose
// runtime failed (a peer stalled) ends, whatever its exit path does meanwhile.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>

#include "../core/failure_exit.h"
#include "test_harness.h"

namespace keras_ring {
namespace {

struct Ended {
  bool exited = false;  // false: killed by the guard (it hung) or by a signal
  int code = -1;
  std::string stderr_text;
};

// Runs `child` in a forked process with its stderr captured; the child must end by itself
// within 20 s, or it counts as hung and is killed.
Ended RunChild(const std::function<void()>& child) {
  int fds[2];
  if (pipe(fds) != 0) return {};
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    child();
    _exit(99);  // the scenario should have ended the process itself
  }
  close(fds[1]);
  Ended ended;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, 50) > 0) {
      char buf[512];
      const ssize_t n = read(fds[0], buf, sizeof(buf));
      if (n > 0) ended.stderr_text.append(buf, static_cast<size_t>(n));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      close(fds[0]);
      return ended;
    }
  }
  char buf[512];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) ended.stderr_text.append(buf, size_t(n));
  close(fds[0]);
  ended.exited = WIFEXITED(status);
  ended.code = ended.exited ? WEXITSTATUS(status) : -1;
  return ended;
}

// Another thread takes the C streams' locks and never gives them back, as one stopped inside
// a write would.
void HoldStdioLocks() {
  std::thread([] {
    flockfile(stdout);
    flockfile(stderr);
    for (;;) pause();
  }).detach();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

// The state letter of /proc/<pid>/stat ('Z': a zombie), 0 if it cannot be read.
char ProcessState(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  char text[512] = {};
  const size_t n = std::fread(text, 1, sizeof text - 1, f);
  std::fclose(f);
  const char* after_name = n > 0 ? std::strrchr(text, ')') : nullptr;
  char state = 0;
  return after_name != nullptr && std::sscanf(after_name + 1, " %c", &state) == 1 ? state : 0;
}

void Sleep(double seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

}  // namespace

TEST(FailureExit_EndsAProcessStuckAfterItsJobFailed_EvenWithStderrLocked) {
  const Ended e = RunChild([] {
    HoldStdioLocks();
    ArmFailureExit(0.2, 1, "a peer died");
    for (;;) pause();
  });
  CHECK(e.exited) << "the process hung";
  CHECK_EQ(e.code, kFailureExitCode);
  CHECK_CONTAINS(e.stderr_text, "rank 1: ending this process (exit code 70)");
  CHECK_CONTAINS(e.stderr_text, "a peer died");
}

// A child the process started (a PyDataset worker stuck in user code) ends with it: the
// failure exit skips Python's handlers that would end it, and plain mpirun kills no group.
TEST(FailureExit_EndsTheProcessesItStarted) {
  int fds[2];
  CHECK_EQ(pipe(fds), 0);
  const Ended e = RunChild([&] {
    const pid_t worker = fork();
    if (worker == 0) {
      // RunChild reads the stderr pipe until every writer is gone: hold none of it.
      for (int fd = 0; fd < 1024; ++fd) close(fd);
      for (;;) pause();
    }
    const ssize_t sent = write(fds[1], &worker, sizeof worker);
    (void)sent;
    ArmFailureExit(0.2, 1, "a peer died");
    for (;;) pause();
  });
  close(fds[1]);
  pid_t worker = -1;
  CHECK_EQ(read(fds[0], &worker, sizeof worker), static_cast<ssize_t>(sizeof worker));
  close(fds[0]);
  CHECK(e.exited) << "the process hung";
  CHECK_EQ(e.code, kFailureExitCode);
  // Orphaned, it is init's to reap: gone or a zombie once killed, within a bounded wait.
  bool ended = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!ended && std::chrono::steady_clock::now() < deadline) {
    ended = kill(worker, 0) != 0 || ProcessState(worker) == 'Z';
    if (!ended) Sleep(0.01);
  }
  CHECK(ended) << "the worker the process started outlived it";
  if (!ended && worker > 0) kill(worker, SIGKILL);
}

TEST(FailureExit_AnExitAfterAStallKeepsTheProgramsStatus_EvenWithStdoutLocked) {
  const Ended e = RunChild([] {
    NoteStalledPeer();
    ArmFailureExit(0.3, 0, "timed out");
    HoldStdioLocks();
    LeaveUnfinalizedAtExit(0.3, false);
    std::exit(3);
  });
  CHECK(e.exited) << "the process hung";
  CHECK_EQ(e.code, 3);
}

TEST(FailureExit_AnExitAfterAStallAsksMpichsLauncherToEndTheJob_WhereAsked) {
  for (const bool ask : {true, false}) {
    const Ended e = RunChild([ask] {
      setenv("PMI_FD", "2", 1);  // the launcher's socket, here the captured stderr
      NoteStalledPeer();
      LeaveUnfinalizedAtExit(0.1, ask);
      std::exit(3);
    });
    CHECK(e.exited) << "the process hung";
    CHECK_EQ(e.code, 3);
    CHECK_EQ(e.stderr_text.find("cmd=abort exitcode=3\n") != std::string::npos, ask)
        << e.stderr_text;
  }
}

TEST(FailureExit_ATeardownSlowerThanTheGraceSinceTheStallKeepsTheProgramsStatus) {
  // The failure exit's timer runs since the stall; once the program is leaving, its exit
  // gets a bound of its own instead, so a slow interpreter teardown ends with the program's
  // status, not with 70.
  const Ended e = RunChild([] {
    NoteStalledPeer();
    ArmFailureExit(0.5, 0, "timed out");
    Sleep(0.3);  // the program handles the error
    LeaveUnfinalizedAtExit(0.5, false);
    Sleep(0.6);  // teardown, past the stall's grace
    std::exit(3);
  });
  CHECK(e.exited) << "the process hung";
  CHECK_EQ(e.code, 3) << e.stderr_text;
}

TEST(FailureExit_ATeardownThatNeverReachesExitIsEndedSayingSo) {
  const Ended e = RunChild([] {
    NoteStalledPeer();
    ArmFailureExit(0.2, 0, "timed out");
    HoldStdioLocks();
    LeaveUnfinalizedAtExit(0.2, false);
    for (;;) pause();
  });
  CHECK(e.exited) << "the process hung";
  CHECK_EQ(e.code, kFailureExitCode);
  CHECK_CONTAINS(e.stderr_text, "keras_ring: rank 0: ending this process (exit code 70) "
                                "because its exit, after a peer did not take part in time");
}

TEST(FailureExit_AStallFoundBeforeAnyCollectiveNamesNoRank) {
  // A peer that never reached init(): no collective armed the failure exit, so no rank is
  // known to the core, and the message must not make one up.
  const Ended e = RunChild([] {
    LeaveUnfinalizedAtExit(0.2, false);
    for (;;) pause();
  });
  CHECK(e.exited) << "the process hung";
  CHECK_EQ(e.code, kFailureExitCode);
  CHECK_CONTAINS(e.stderr_text, "keras_ring: ending this process (exit code 70) because its "
                                "exit, after a peer did not take part in time");
  CHECK(e.stderr_text.find("rank -1") == std::string::npos) << e.stderr_text;
}

TEST(FailureExit_AnExitHandlerThatHangsBeforeKerasRingsIsBounded) {
  // Handlers registered after keras_ring's run before it: one that never returns is bounded
  // too, with 70, since keras_ring's handler never saw the status.
  const Ended e = RunChild([] {
    NoteStalledPeer();
    ArmFailureExit(0.2, 0, "timed out");
    LeaveUnfinalizedAtExit(0.2, false);
    std::atexit([] {
      for (;;) pause();
    });
    std::exit(4);
  });
  CHECK(e.exited) << "the process hung";
  CHECK_EQ(e.code, kFailureExitCode);
}

TEST(FailureExit_ATeardownSlowerThanTheGraceSinceTheFailureKeepsTheProgramsStatus) {
  // The program handled the failure and leaves with its own status; its teardown runs past
  // the grace since the failure, but not past the one its exit gets.
  const Ended e = RunChild([] {
    ArmFailureExit(0.4, 1, "a peer died");
    Sleep(0.2);
    BoundExitAfterFailure(0.6);
    Sleep(0.4);  // teardown, past the failure's grace
    std::exit(3);
  });
  CHECK(e.exited) << "the process hung";
  CHECK_EQ(e.code, 3) << e.stderr_text;
  CHECK(e.stderr_text.find("ending this process") == std::string::npos) << e.stderr_text;
}

TEST(FailureExit_AnExitThatHangsAfterAFailureEndsWithTheProgramsStatusSayingSo) {
  const Ended e = RunChild([] {
    std::atexit([] {  // registered before keras_ring's, so it runs after it
      for (;;) pause();
    });
    ArmFailureExit(0.2, 1, "a peer died");
    BoundExitAfterFailure(0.2);
    std::exit(3);
  });
  CHECK(e.exited) << "the process hung";
  CHECK_EQ(e.code, 3);
  CHECK_CONTAINS(e.stderr_text, "keras_ring: rank 1: ending this process (exit code 3) because "
                                "its exit, after the job failed, had not finished 0.2 s later");
}

TEST(FailureExit_ABoundWithoutAFailureDoesNothing) {
  const Ended e = RunChild([] {
    BoundExitAfterFailure(0.1);
    Sleep(0.3);
    std::exit(5);
  });
  CHECK(e.exited) << "the process hung";
  CHECK_EQ(e.code, 5);
  CHECK_EQ(e.stderr_text, "");
}

}  // namespace keras_ring
