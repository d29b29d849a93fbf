#include "failure_exit.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

namespace keras_ring {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<bool> g_armed{false};
// Bumped by every disarm or re-arm: an older timer stands down.
std::atomic<unsigned> g_generation{0};
std::atomic<int> g_rank{-1};
std::atomic<bool> g_peer_stalled{false};
// When the peer stalled (steady clock), and the grace the exit waits from then.
std::atomic<Clock::rep> g_stalled_at{0};
std::atomic<double> g_exit_grace{0.0};
std::atomic<bool> g_ask_launcher{false};
// The program's exit status, once its exit() has begun: a timer that fires after that ends
// the process with it rather than with kFailureExitCode.
std::atomic<int> g_exit_status{-1};

Clock::duration Seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

Clock::time_point StalledAt() { return Clock::time_point(Clock::duration(g_stalled_at.load())); }

// write(2), not stdio: a stdio lock held by a thread stopped elsewhere must not keep this
// process from ending.
void WriteStderr(const std::string& text) {
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = write(STDERR_FILENO, p, left);
    if (n <= 0) return;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

int ExitCode() {
  const int status = g_exit_status.load();
  return status >= 0 ? status : kFailureExitCode;
}

// Ends the processes this one started (a PyDataset's forked workers, a helper it ran): the
// _exit below skips Python's exit handlers, which end multiprocessing's daemon children, and
// plain mpirun kills no process group, so a worker stuck in user code ran on for ever,
// orphaned. keras-ring-run's rank wrapper ends the rank's whole group the same way.
void KillChildren() {
  const long self = static_cast<long>(getpid());
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return;
  while (const dirent* entry = readdir(proc)) {
    char* end = nullptr;
    const long pid = strtol(entry->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    char stat[512];
    const ssize_t n = read(fd, stat, sizeof stat - 1);
    close(fd);
    if (n <= 0) continue;
    stat[n] = '\0';
    const char* after_name = strrchr(stat, ')');  // the name may hold spaces and parentheses
    char state = 0;
    long ppid = 0;
    if (after_name != nullptr && std::sscanf(after_name + 1, " %c %ld", &state, &ppid) == 2 &&
        ppid == self) {
      kill(static_cast<pid_t>(pid), SIGKILL);
    }
  }
  closedir(proc);
}

// Detached: it must outlive the runtime (destroyed at shutdown, before teardown may hang)
// and must not hold the process open; exit() ends it with everything else. `why` gets the
// exit code the process ends with.
template <typename Why>
void StartTimer(Clock::time_point deadline, Why why) {
  const unsigned generation = g_generation.load();
  std::thread([deadline, why, generation] {
    std::this_thread::sleep_until(deadline);
    if (g_generation.load() != generation) return;
    const int code = ExitCode();
    WriteStderr(why(code));
    KillChildren();
    _exit(code);
  }).detach();
}

// Asks MPICH's launcher (Hydra) to end the whole job with `status`: PMI-1's abort command on
// the socket it gave this process. Hydra also ends a job whose rank exits without finalizing
// PMI, but it missed that in 2 of about 60 jobs (the stalled peer then kept mpirun up for
// ever); the abort ended every try at once. Not under keras-ring-run, whose launcher stops
// the job itself and would take the abort's kills for ranks that ended without a status.
void AskMpichToEndTheJob(int status) {
  const char* fd_text = getenv("PMI_FD");
  if (fd_text == nullptr || *fd_text == '\0') return;
  char* end = nullptr;
  const long fd = strtol(fd_text, &end, 10);
  if (*end != '\0' || fd < 0) return;
  char command[48];
  const int n = std::snprintf(command, sizeof(command), "cmd=abort exitcode=%d\n", status);
  if (n <= 0) return;
  const ssize_t sent = write(static_cast<int>(fd), command, static_cast<size_t>(n));
  (void)sent;  // on failure the unfinalized exit below is all there is
}

void LeaveUnfinalized(int status, void* /*unused*/) {
  // A timer still running now ends the process with this status, not with its 70.
  g_exit_status.store(status);
  std::this_thread::sleep_until(StalledAt() + Seconds(g_exit_grace.load() + 1.0));
  // Unlocked, as exit() itself flushes: a thread may hold a stream's lock for good.
  fflush_unlocked(stdout);
  if (g_ask_launcher.load()) AskMpichToEndTheJob(status);
  _exit(status);
}

void RecordExitStatus(int status, void* /*unused*/) { g_exit_status.store(status); }

}  // namespace

void ArmFailureExit(double grace_seconds, int rank, const std::string& cause) {
  if (!(grace_seconds > 0) || g_armed.exchange(true)) return;
  g_rank.store(rank);
  StartTimer(Clock::now() + Seconds(grace_seconds), [grace_seconds, rank, cause](int code) {
    char head[160];
    std::snprintf(head, sizeof(head),
                  "keras_ring: rank %d: ending this process (exit code %d) because the job "
                  "failed %g s ago and the process is still running: ",
                  rank, code, grace_seconds);
    return head + cause +
           ". Every process of a failed job ends so the job ends; "
           "KERAS_RING_FAILURE_EXIT_SECONDS sets the grace, 0 keeps failed processes running.\n";
  });
}

void DisarmFailureExit() {
  g_generation.fetch_add(1);
  g_armed.store(false);
  g_peer_stalled.store(false);
}

void NoteStalledPeer() {
  g_stalled_at.store(Clock::now().time_since_epoch().count());
  g_peer_stalled.store(true);
}

bool PeerStalled() { return g_peer_stalled.load(); }

void LeaveUnfinalizedAtExit(double grace_seconds, bool ask_launcher) {
  static std::atomic<bool> registered{false};
  if (!g_peer_stalled.load()) NoteStalledPeer();  // the wait then runs from now
  const double grace = grace_seconds > 0 ? grace_seconds : 0.0;
  g_exit_grace.store(grace);
  g_ask_launcher.store(ask_launcher);
  if (registered.exchange(true)) return;
  on_exit(LeaveUnfinalized, nullptr);
  if (grace <= 0) return;  // failed processes are the program's to end: no bound
  // The exit gets a bound of its own, measured from now: interpreter teardown (freeing
  // TensorFlow's dataset iterators) can take seconds after a failure, and the failure exit's
  // bound, running since the stall, then ended with 70 a program leaving with its own status.
  const Clock::time_point deadline =
      std::max(StalledAt() + Seconds(grace + 1.0), Clock::now() + Seconds(grace)) + Seconds(1.0);
  g_generation.fetch_add(1);  // the failure exit's timer stands down for this one
  g_armed.store(true);
  // The rank is known where a collective armed the failure exit; not where the stall was
  // found before any (a peer that never reached init()).
  const int rank = g_rank.load();
  const std::string who = rank >= 0 ? "rank " + std::to_string(rank) + ": " : "";
  const double bound = std::chrono::duration<double>(deadline - Clock::now()).count();
  StartTimer(deadline, [who, bound](int code) {
    char text[320];
    std::snprintf(text, sizeof(text),
                  "keras_ring: %sending this process (exit code %d) because its exit, "
                  "after a peer did not take part in time, had not finished %.0f s later "
                  "(KERAS_RING_FAILURE_EXIT_SECONDS)\n",
                  who.c_str(), code, bound);
    return std::string(text);
  });
}

void BoundExitAfterFailure(double grace_seconds) {
  static std::atomic<bool> registered{false};
  if (!g_armed.load() || !(grace_seconds > 0)) return;
  // Registered now, after every handler the program's libraries registered: it runs first
  // and sees the status before any of theirs can hang.
  if (!registered.exchange(true)) on_exit(RecordExitStatus, nullptr);
  g_generation.fetch_add(1);  // the failure exit's timer stands down for this one
  const int rank = g_rank.load();
  StartTimer(Clock::now() + Seconds(grace_seconds), [rank, grace_seconds](int code) {
    char text[320];
    std::snprintf(text, sizeof(text),
                  "keras_ring: rank %d: ending this process (exit code %d) because its exit, "
                  "after the job failed, had not finished %g s later "
                  "(KERAS_RING_FAILURE_EXIT_SECONDS)\n",
                  rank, code, grace_seconds);
    return std::string(text);
  });
}

}  // namespace keras_ring
