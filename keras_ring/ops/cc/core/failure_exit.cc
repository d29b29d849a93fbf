#include "failure_exit.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

namespace keras_ring {
namespace {

std::atomic<bool> g_armed{false};
std::atomic<unsigned> g_generation{0};  // bumped by every disarm: an older timer stands down

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
}

}  // namespace keras_ring
