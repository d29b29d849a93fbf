#include "failure_exit.h"

#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

namespace keras_ring {
namespace {

std::atomic<bool> g_armed{false};
std::atomic<unsigned> g_generation{0};  // bumped by every disarm: an older timer stands down
std::atomic<bool> g_peer_stalled{false};
// When the peer stalled (steady clock), and the grace the exit waits from then.
std::atomic<std::chrono::steady_clock::rep> g_stalled_at{0};
std::atomic<double> g_exit_grace{0.0};

void LeaveUnfinalized(int status, void* /*unused*/) {
  DisarmFailureExit();  // its 70 would replace the program's status during the wait below
  const auto since = std::chrono::steady_clock::duration(g_stalled_at.load());
  const auto until = std::chrono::steady_clock::time_point(since) +
                     std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double>(g_exit_grace.load() + 1.0));
  std::this_thread::sleep_until(until);
  std::fflush(nullptr);
  _exit(status);
}

}  // namespace

void ArmFailureExit(double grace_seconds, int rank, const std::string& cause) {
  if (!(grace_seconds > 0) || g_armed.exchange(true)) return;
  const unsigned generation = g_generation.load();
  // Detached: it must outlive the runtime (destroyed at shutdown, before teardown may hang)
  // and must not hold the process open; exit() ends it with everything else.
  std::thread([grace_seconds, rank, cause, generation] {
    std::this_thread::sleep_for(std::chrono::duration<double>(grace_seconds));
    if (g_generation.load() != generation) return;
    std::fprintf(stderr,
                 "keras_ring: rank %d: ending this process (exit code %d) because the job "
                 "failed %g s ago and the process is still running: %s. Every process of a "
                 "failed job ends so the job ends; KERAS_RING_FAILURE_EXIT_SECONDS sets the "
                 "grace, 0 keeps failed processes running.\n",
                 rank, kFailureExitCode, grace_seconds, cause.c_str());
    std::fflush(stderr);
    _exit(kFailureExitCode);
  }).detach();
}

void DisarmFailureExit() {
  g_generation.fetch_add(1);
  g_armed.store(false);
  g_peer_stalled.store(false);
}

void NoteStalledPeer() {
  g_stalled_at.store(std::chrono::steady_clock::now().time_since_epoch().count());
  g_peer_stalled.store(true);
}

bool PeerStalled() { return g_peer_stalled.load(); }

void LeaveUnfinalizedAtExit(double grace_seconds) {
  static std::atomic<bool> registered{false};
  if (!g_peer_stalled.load()) NoteStalledPeer();  // the wait then runs from now
  g_exit_grace.store(grace_seconds > 0 ? grace_seconds : 0.0);
  if (!registered.exchange(true)) on_exit(LeaveUnfinalized, nullptr);
}

}  // namespace keras_ring
