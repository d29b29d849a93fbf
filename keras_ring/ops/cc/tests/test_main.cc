// Runs every registered test (or those whose name contains argv[1]) and ends with the line
// "N passed, M failed". Exits non-zero if any test failed. A watchdog turns a hang into a
// failure: no wait in the code under test is unbounded, so a hang is a bug.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unistd.h>
#include <vector>

#include "test_harness.h"

namespace kr_test {
namespace {

struct Entry {
  const char* name;
  TestFn fn;
};

std::vector<Entry>& Registry() {
  static std::vector<Entry> registry;
  return registry;
}

std::mutex g_mu;
std::atomic<int> g_failures{0};
const char* g_current = "";
const char* volatile g_running = "(none)";

volatile int g_passed = 0;
volatile int g_failed = 0;

// Async-signal-safe output of a string or a non-negative number to stdout.
void Put(const char* s) {
  ssize_t ignored = write(1, s, std::strlen(s));
  (void)ignored;
}
void PutNumber(int v) {
  char digits[16];
  int i = sizeof digits - 1;
  digits[i] = '\0';
  do {
    digits[--i] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v > 0 && i > 0);
  Put(digits + i);
}

// The test now running hung: report it as failed and end the run.
void OnAlarm(int) {
  Put("FAIL ");
  Put(g_running);
  Put(": did not finish within the watchdog's limit\n");
  PutNumber(g_passed);
  Put(" passed, ");
  PutNumber(g_failed + 1);
  Put(" failed\n");
  _exit(3);
}

}  // namespace

Registrar::Registrar(const char* name, TestFn fn) { Registry().push_back(Entry{name, fn}); }

void RecordFailure(const char* file, int line, const std::string& message) {
  g_failures.fetch_add(1);
  std::lock_guard<std::mutex> lock(g_mu);
  std::printf("FAIL %s: %s:%d: %s\n", g_current, file, line, message.c_str());
  std::fflush(stdout);
}

int CurrentFailures() { return g_failures.load(); }

}  // namespace kr_test

int main(int argc, char** argv) {
  using namespace kr_test;
  const char* filter = argc > 1 ? argv[1] : nullptr;
  const bool verbose = std::getenv("KR_TEST_VERBOSE") != nullptr;
  std::signal(SIGALRM, OnAlarm);
  // Sanitizer builds run several times slower (make test-cpp-asan): a longer bound there.
  const char* watchdog_text = std::getenv("KR_TEST_WATCHDOG_SECONDS");
  const int watchdog = watchdog_text != nullptr ? std::atoi(watchdog_text) : 0;
  for (const Entry& e : Registry()) {
    if (filter && std::strstr(e.name, filter) == nullptr) continue;
    g_current = e.name;
    g_running = e.name;
    g_failures = 0;
    alarm(watchdog > 0 ? static_cast<unsigned>(watchdog) : 60u);  // per test; most take < 1 s
    const auto start = std::chrono::steady_clock::now();
    e.fn();
    alarm(0);
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - start).count();
    if (g_failures.load() == 0) {
      g_passed = g_passed + 1;
      if (verbose) std::printf("ok   %s (%.0f ms)\n", e.name, ms);
    } else {
      g_failed = g_failed + 1;
      std::printf("FAILED %s (%d failed checks, %.0f ms)\n", e.name, g_failures.load(), ms);
    }
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
