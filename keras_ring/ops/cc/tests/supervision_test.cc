// The runtime's watchdog over real TCP (and shm) transports: a peer that fails or dies is
// noticed by a rank that runs no collective at all (it may be in user code), so that rank
// can end too; a peer that shuts down cleanly is no failure.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../core/runtime.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using namespace keras_ring;  // NOLINT: test-local

struct World {
  std::vector<std::unique_ptr<Runtime>> runtimes;
};

// Runtimes over host transports; rank `raw` (if >= 0) keeps its bare transport instead, so
// the test can make it vanish without a goodbye.
World MakeWorld(const std::vector<int>& hosts, std::unique_ptr<Transport>* raw_out, int raw) {
  auto transports = ConnectHostWorld(hosts, Mix(3, hosts.size(), raw + 5));
  World w;
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    if (r == raw) {
      *raw_out = std::move(At(transports, r));
      w.runtimes.push_back(nullptr);
      continue;
    }
    RuntimeOptions options;
    options.rank = r;
    options.size = static_cast<int>(hosts.size());
    options.timeout_seconds = 60;
    options.stall_warning_seconds = 0;
    options.failure_exit_seconds = 0;  // never end this test process
    w.runtimes.push_back(std::make_unique<Runtime>(options, std::move(At(transports, r))));
  }
  return w;
}

// The first non-OK PeerFailure() of `runtime` within `seconds`, or OK.
Status WaitForPeerFailure(Runtime& runtime, double seconds) {
  const auto start = Clock::now();
  while (SecondsSince(start) < seconds) {
    Status s = runtime.PeerFailure();
    if (!s.ok()) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling a result, no race
  }
  return Status::OK();
}

TEST(Supervision_IdleRanksLearnThatAPeerLeftWithAnError) {
  std::unique_ptr<Transport> unused;
  World w = MakeWorld({0, 0, 1}, &unused, -1);  // rank 2 across "hosts"; 0 and 1 share shm
  w.runtimes[2]->Abandon("ValueError: boom");
  for (int r : {0, 1}) {
    const Status s = WaitForPeerFailure(*w.runtimes[static_cast<size_t>(r)], 20);
    CHECK(!s.ok()) << "rank " << r << " never noticed";
    CHECK_EQ(s.peer(), 2);
    CHECK_CONTAINS(s.message(), "rank 2 left with an error: ValueError: boom");
  }
  // The next collective fails at once with that cause instead of waiting for the timeout.
  Request barrier;
  barrier.kind = Kind::kBarrier;
  const auto start = Clock::now();
  const Status s = w.runtimes[0]->Run(std::move(barrier));
  CHECK(!s.ok() && s.peer() == 2) << s.message();
  CHECK(SecondsSince(start) < 30) << SecondsSince(start);
}

TEST(Supervision_AVanishedPeerIsNoticedByIdleRanks) {
  std::unique_ptr<Transport> doomed;
  World w = MakeWorld({0, 1, 2}, &doomed, 1);
  doomed.reset();  // its sockets close with no notice: a killed process
  for (int r : {0, 2}) {
    const Status s = WaitForPeerFailure(*w.runtimes[static_cast<size_t>(r)], 20);
    CHECK(s.code() == Code::kUnavailable) << "rank " << r << ": " << s.message();
    CHECK_EQ(s.peer(), 1);
    CHECK_CONTAINS(s.message(), "lost rank 1");
  }
}

TEST(Supervision_AWaitAbortedForAPeersFailureEndsWithThatCause) {
  // The watchdog aborts this rank's transport when some peer failed, while a collective may
  // be waiting on another, healthy one: that wait must end with the failed peer's cause (its
  // rank and reason), not a bare "aborted". Over shm and over TCP.
  for (const std::vector<int>& hosts : {std::vector<int>{0, 0}, std::vector<int>{0, 1}}) {
    auto world = ConnectHostWorld(hosts, Mix(17, hosts[1]));
    Status waited;
    std::thread waiter([&] {
      char byte = 0;
      waited = world[0]->Recv(1, &byte, 1, Deadline::After(60));  // rank 1 never sends
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let it wait (no race:
    // the abort ends the wait whether it began before or after)
    world[0]->AbortWith(Status(Code::kUnavailable, "lost rank 5: it vanished", 5));
    waiter.join();
    CHECK(waited.code() == Code::kUnavailable) << waited.message();
    CHECK_EQ(waited.peer(), 5);
    CHECK_CONTAINS(waited.message(), "lost rank 5: it vanished");
    // A clean shutdown still reads as one.
    char byte = 0;
    auto other = ConnectHostWorld(hosts, Mix(18, hosts[1]));
    other[0]->AbortWith(Status(Code::kCancelled, "rank 0 shut down", 0));
    const Status after = other[0]->Recv(1, &byte, 1, Deadline::After(60));
    CHECK(after.code() == Code::kAborted) << after.message();
  }
}

TEST(Supervision_ACleanShutdownIsNoFailure) {
  std::unique_ptr<Transport> unused;
  World w = MakeWorld({0, 1}, &unused, -1);
  w.runtimes[1]->Stop();
  w.runtimes[1].reset();
  // Several watchdog periods (250 ms) pass without a failure being recorded.
  const Status s = WaitForPeerFailure(*w.runtimes[0], 1.5);
  CHECK_OK(s);
}
// A rank that shuts down cleanly while a peer still waits in a later collective (a Keras
// callback stopped its training alone, say): the peer's error says how far it got.
TEST(Supervision_APeerThatStoppedEarlySaysHowFarItGot) {
  for (const std::vector<int>& hosts : {std::vector<int>{0, 0}, std::vector<int>{0, 1}}) {
    std::unique_ptr<Transport> unused;
    World w = MakeWorld(hosts, &unused, -1);
    for (int step = 0; step < 2; ++step) {
      Request other;
      other.kind = Kind::kBarrier;
      Status theirs;
      std::thread peer([&] { theirs = w.runtimes[1]->Run(std::move(other)); });
      Request mine;
      mine.kind = Kind::kBarrier;
      CHECK_OK(w.runtimes[0]->Run(std::move(mine)));
      peer.join();
      CHECK_OK(theirs);
    }
    w.runtimes[1]->Stop();
    Request third;
    third.kind = Kind::kBarrier;
    const Status s = w.runtimes[0]->Run(std::move(third));
    CHECK(s.code() == Code::kUnavailable && s.peer() == 1) << s.message();
    CHECK_CONTAINS(s.message(), "barrier #3 failed on rank 0: rank 1 has shut down (after 2 "
                                "collectives, the last barrier #2) while this rank still needs it");
    CHECK_CONTAINS(s.message(),
                   "a rank that stopped early (on a decision of its own, or by sys.exit");
  }
}
}  // namespace
}  // namespace kr_test
