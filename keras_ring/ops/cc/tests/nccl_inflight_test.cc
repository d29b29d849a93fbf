// Several NCCL collectives in flight at once (backend.h, inflight.cc), with the fake GPU of
// nccl_fake.h holding launches back so that they pile up on the stream: they complete in
// submission order with their own results, the depth limit holds, a stall or a dead peer
// fails the collective it hits and every one behind it on every rank (bounded, with the
// runtime's structured error), shutdown ends them all, and a host collective or a barrier
// does not overtake device collectives submitted before it.
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "nccl_world.h"
#include "test_harness.h"

namespace kr_test {
namespace {

// One rank's completions, in the order their done ran.
class Completions {
 public:
  std::function<void(const Status&)> For(int index) {
    return [this, index](const Status& s) {
      std::lock_guard<std::mutex> lock(mu_);
      done_.emplace_back(index, s);
      cv_.notify_all();
    };
  }
  bool WaitFor(size_t n, double seconds = 10.0) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::duration<double>(seconds),
                        [&] { return done_.size() >= n; });
  }
  std::vector<std::pair<int, Status>> Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<int, Status>> done_;
};

// x, in place, summed on the GPU; named step<i>.
void SubmitOnDevice(GpuWorld& w, int r, std::vector<float>& x, int i, Completions& c) {
  Request req = Allreduce(Tensor(DataType::kFloat32, {static_cast<int64_t>(x.size())}, x.data(),
                                 x.data()),
                          ReduceOp::kSum, 1.0, 1.0, "step" + std::to_string(i));
  w.Attach(r, &req);
  req.done = c.For(i);
  At(w.runtimes, r)->Submit(std::move(req));
}

// Rank r's input i: distinct per rank and collective, so a result from the wrong one shows.
std::vector<float> Input(int r, int i) {
  return {static_cast<float>((r + 1) * (i + 1)), static_cast<float>(i)};
}

std::vector<float> Sum(int n, int i) {
  return {static_cast<float>(n * (n + 1) / 2 * (i + 1)), static_cast<float>(n * i)};
}

bool AllLaunched(GpuWorld& w, int launches) {
  return WaitUntil([&] {
    for (int r = 0; r < w.size(); ++r) {
      if (w.fake->Count(r, "allreduce@stream") < launches) return false;
    }
    return true;
  });
}

struct Job {
  explicit Job(int n) : data(static_cast<size_t>(n)), done(static_cast<size_t>(n)) {
    for (auto& c : done) c = std::make_unique<Completions>();
  }
  std::vector<std::vector<std::vector<float>>> data;  // [rank][collective]
  std::vector<std::unique_ptr<Completions>> done;     // [rank]
  Completions& Of(int r) { return *At(done, r); }
};

// Every rank submits `count` device allreduces back to back (from this thread: Submit
// never blocks).
void SubmitAll(GpuWorld& w, Job& job, int count) {
  for (int r = 0; r < w.size(); ++r) {
    auto& mine = At(job.data, r);
    for (int i = 0; i < count; ++i) mine.push_back(Input(r, i));
    for (int i = 0; i < count; ++i) SubmitOnDevice(w, r, At(mine, i), i, job.Of(r));
  }
}

void CheckInOrder(const std::vector<std::pair<int, Status>>& done, int rank) {
  for (size_t j = 0; j < done.size(); ++j) {
    CHECK_EQ(done[j].first, static_cast<int>(j)) << "rank " << rank << ": completed out of order";
  }
}

// Rank r completed `count` collectives in order: `odd` failed with its mismatch named, every
// other one with its own sum over n ranks.
void CheckOneMismatch(Job& job, int r, int n, int count, int odd) {
  CHECK(job.Of(r).WaitFor(static_cast<size_t>(count))) << "rank " << r;
  const auto done = job.Of(r).Get();
  CheckInOrder(done, r);
  for (int i = 0; i < count; ++i) {
    const Status& s = At(done, i).second;
    if (i == odd) {
      CHECK(s.code() == Code::kFailedPrecondition) << s.message();
      CHECK(s.message().find("'step" + std::to_string(odd) + "'") != std::string::npos)
          << s.message();
      CHECK(s.message().find("mismatch") != std::string::npos) << s.message();
      continue;
    }
    CHECK_OK(s) << r << " " << i;
    CHECK(At(At(job.data, r), i) == Sum(n, i)) << r << " " << i;
  }
}

// Rank r completed the job's `count` allreduces in order, each with its own sum over n ranks.
void CheckCompletedWithTheirSums(Job& job, int r, int n, int count) {
  CHECK(job.Of(r).WaitFor(static_cast<size_t>(count))) << "rank " << r;
  const auto done = job.Of(r).Get();
  CheckInOrder(done, r);
  for (const auto& d : done) CHECK_OK(d.second);
  for (int i = 0; i < count; ++i) CHECK(At(At(job.data, r), i) == Sum(n, i)) << r << " " << i;
}

TEST(NcclInFlight_SeveralCompleteInSubmissionOrderWithTheirOwnResults) {
  const int n = 3, count = 12;
  GpuWorld w(n);
  w.fake->hold = true;  // the GPU runs nothing until released
  Job job(n);
  SubmitAll(w, job, count);
  // Every collective is on the stream while none has completed: the worker did not wait.
  CHECK(AllLaunched(w, count));
  // ... and each is handed to the completion thread (just after its launch) before the GPU
  // runs: released earlier, the first could complete before the last is counted in flight.
  CHECK(WaitUntil([&] {
    for (int r = 0; r < n; ++r) {
      if (w.Backend(r)->max_in_flight_seen() < count) return false;
    }
    return true;
  }));
  for (int r = 0; r < n; ++r) CHECK_EQ(job.Of(r).Get().size(), 0u) << "done before the GPU ran";
  w.fake->hold = false;
  w.fake->ReleaseHeld();
  for (int r = 0; r < n; ++r) {
    CheckCompletedWithTheirSums(job, r, n, count);
    CHECK_EQ(w.Backend(r)->max_in_flight_seen(), count);
    CHECK_EQ(w.fake->MaxPending(r), count);
  }
  w.Shutdown();
  for (int r = 0; r < n; ++r) {
    CHECK_EQ(w.fake->Count(r, "violation"), 0);
    CHECK_EQ(w.fake->Count(r, "abort"), 0);
    CHECK_EQ(w.fake->LiveObjects(r), 0);
  }
}

TEST(NcclInFlight_TheDepthLimitHolds) {
  const int count = 10, depth = 3;
  GpuWorld w(2, 10.0, depth);
  w.fake->hold = true;
  Job job(2);
  SubmitAll(w, job, count);
  // Each release lets the held launches complete; the worker then fills the freed slots.
  for (int launched = depth;; launched += depth) {
    CHECK(AllLaunched(w, std::min(launched, count))) << launched;
    if (launched == depth) {  // the first batch is in flight before it may complete
      CHECK(WaitUntil([&] {
        return w.Backend(0)->max_in_flight_seen() >= depth &&
               w.Backend(1)->max_in_flight_seen() >= depth;
      }));
    }
    if (launched >= count) break;
    w.fake->ReleaseHeld();
  }
  w.fake->hold = false;
  w.fake->ReleaseHeld();
  for (int r = 0; r < 2; ++r) {
    CHECK(job.Of(r).WaitFor(count)) << "rank " << r;
    CheckInOrder(job.Of(r).Get(), r);
    for (int i = 0; i < count; ++i) CHECK(At(At(job.data, r), i) == Sum(2, i)) << r << " " << i;
    CHECK_EQ(w.fake->MaxPending(r), depth) << "launches on the GPU not yet completed, at most";
    CHECK_EQ(w.Backend(r)->max_in_flight_seen(), depth);
  }
}

TEST(NcclInFlight_AStallInTheKthOfNFailsItAndEveryLaterOneOnEveryRank) {
  const int n = 2, count = 8, k = 3;
  GpuWorld w(n, 0.5);
  w.fake->hang_from_launch = k;  // the k-th launch (from 0) and all after it never finish
  Job job(n);
  const auto start = keras_ring::Clock::now();
  SubmitAll(w, job, count);
  for (int r = 0; r < n; ++r) CHECK(job.Of(r).WaitFor(count, 20.0)) << "rank " << r;
  CHECK(SecondsSince(start) < 10.0) << "a hang guard: the timeout is 0.5 s";
  for (int r = 0; r < n; ++r) {
    const auto done = job.Of(r).Get();
    CheckInOrder(done, r);
    for (size_t j = 0; j < done.size(); ++j) {
      const int i = done[j].first;
      const Status& s = done[j].second;
      if (i < k) {
        CHECK_OK(s);
        CHECK(At(At(job.data, r), i) == Sum(n, i)) << r << " " << i;
        continue;
      }
      CHECK(s.code() == Code::kDeadlineExceeded) << s.message();
      CHECK_EQ(s.collective(), "allreduce 'step" + std::to_string(i) + "'");
      CHECK_CONTAINS(s.message(), "failed on rank " + std::to_string(r));
      if (i == k) {
        CHECK_CONTAINS(s.message(), "NCCL allreduce did not complete within 0.5 s");
        CHECK_CONTAINS(s.message(), "(its NCCL communicator was aborted)");
      } else {
        CHECK_CONTAINS(s.message(), "in flight on the GPU behind allreduce 'step" +
                                        std::to_string(k) + "' (#" + std::to_string(k + 1) +
                                        "), which failed");
      }
    }
  }
  // The runtime is broken: a host collective fails at once too.
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    const Status s = w.Run(r, InPlace(x), false);
    CHECK_CONTAINS(s.message(), "because an earlier collective failed");
  });
  w.Shutdown();
  for (int r = 0; r < n; ++r) {
    CHECK_EQ(w.fake->Count(r, "abort"), 1);
    CHECK_EQ(w.fake->Count(r, "violation"), 0);
    CHECK_EQ(w.fake->LiveObjects(r), 0);
  }
}

TEST(NcclInFlight_ADeadPeerFailsEveryCollectiveInFlightWithoutWaitingForTheTimeout) {
  const int count = 5;
  GpuWorld w(2, 20.0);
  w.fake->hold = true;  // NCCL never completes nor reports anything
  Job job(2);
  SubmitAll(w, job, count);
  CHECK(AllLaunched(w, count));
  const auto start = keras_ring::Clock::now();
  for (int r = 0; r < 2; ++r) {
    const int other = 1 - r;
    At(w.transports, r)->SetPeerFailure(Status(
        Code::kUnavailable, "lost rank " + std::to_string(other) + ": its process exited", other));
  }
  for (int r = 0; r < 2; ++r) CHECK(job.Of(r).WaitFor(count, 15.0)) << "rank " << r;
  CHECK(SecondsSince(start) < 15.0) << "a hang guard: the timeout is 20 s";
  for (int r = 0; r < 2; ++r) {
    const auto done = job.Of(r).Get();
    CheckInOrder(done, r);
    for (const auto& d : done) {
      CHECK(d.second.code() == Code::kUnavailable) << d.second.message();
      CHECK_EQ(d.second.peer(), 1 - r);
      CHECK_CONTAINS(d.second.message(), "lost rank " + std::to_string(1 - r));
    }
    if (!done.empty()) {
      CHECK_CONTAINS(done[0].second.message(), "communicator was aborted");
    }
    if (done.size() > 1) {
      CHECK_CONTAINS(done[1].second.message(), "in flight on the GPU behind");
    }
  }
  w.Shutdown();
  for (int r = 0; r < 2; ++r) {
    CHECK_EQ(w.fake->Count(r, "abort"), 1);
    CHECK_EQ(w.fake->Count(r, "finalize"), 0) << "no cooperative teardown with a dead peer";
  }
}

TEST(NcclInFlight_ShutdownWithCollectivesInFlightFailsThemAllAndLeavesNothing) {
  const int count = 5;
  GpuWorld w(2, 60.0);
  w.fake->hold = true;
  Job job(2);
  SubmitAll(w, job, count);
  CHECK(AllLaunched(w, count));
  const auto start = keras_ring::Clock::now();
  w.Shutdown();
  CHECK(SecondsSince(start) < 5.0) << "a hang guard: the timeout is 60 s";
  for (int r = 0; r < 2; ++r) {
    const auto done = job.Of(r).Get();  // every done ran before the runtime was gone
    CHECK_EQ(done.size(), static_cast<size_t>(count)) << "rank " << r;
    CheckInOrder(done, r);
    for (const auto& d : done) CHECK(d.second.code() == Code::kAborted) << d.second.message();
    if (!done.empty()) {
      CHECK_CONTAINS(done[0].second.message(), "shut down while NCCL allreduce was running");
    }
    CHECK_EQ(w.fake->Count(r, "abort"), 1);
    CHECK_EQ(w.fake->Count(r, "violation"), 0);
    CHECK_EQ(w.fake->LiveObjects(r), 0) << "streams and events are freed all the same";
  }
}

TEST(NcclInFlight_HostCollectivesAndBarriersDoNotOvertakeDeviceOnes) {
  // Per rank: a device allreduce, a host allreduce, a device allreduce, a device barrier, a
  // device allreduce, with the GPU holding each launch back until released: the host
  // collective completes only after the device one before it, the barrier only after the
  // device one before it.
  GpuWorld w(2);
  w.fake->hold = true;
  Job job(2);
  std::vector<std::vector<float>> host(2);
  for (int r = 0; r < 2; ++r) {
    auto& mine = At(job.data, r);
    for (int i = 0; i < 3; ++i) mine.push_back(Input(r, i));
    Completions& c = job.Of(r);
    SubmitOnDevice(w, r, At(mine, 0), 0, c);
    At(host, r) = {static_cast<float>(r + 10)};
    Request on_host = InPlace(At(host, r));
    on_host.done = c.For(1);
    At(w.runtimes, r)->Submit(std::move(on_host));
    SubmitOnDevice(w, r, At(mine, 1), 2, c);
    Request barrier;
    barrier.kind = Kind::kBarrier;
    barrier.name = "fence";
    w.Attach(r, &barrier);
    barrier.done = c.For(3);
    At(w.runtimes, r)->Submit(std::move(barrier));
    SubmitOnDevice(w, r, At(mine, 2), 4, c);
  }
  CHECK(AllLaunched(w, 1));
  for (int r = 0; r < 2; ++r) CHECK_EQ(job.Of(r).Get().size(), 0u) << "rank " << r;
  w.fake->ReleaseHeld();  // the first; the second is held in its turn
  CHECK(AllLaunched(w, 2));
  for (int r = 0; r < 2; ++r) CHECK(job.Of(r).WaitFor(2)) << "rank " << r;
  w.fake->hold = false;
  w.fake->ReleaseHeld();
  for (int r = 0; r < 2; ++r) {
    CHECK(job.Of(r).WaitFor(5)) << "rank " << r;
    const auto done = job.Of(r).Get();
    CheckInOrder(done, r);
    for (const auto& d : done) CHECK_OK(d.second);
    CHECK_EQ(At(host, r)[0], 21.0f);
    for (int i = 0; i < 3; ++i) CHECK(At(At(job.data, r), i) == Sum(2, i)) << r << " " << i;
  }
}

// The lookahead (lookahead.cc) gets a world whose queues are full before a round peeks: one
// collective in flight at most, the GPU holding the first, so the worker agrees on the
// second and then waits for a slot while everything else is submitted.
void SubmitBehindAHeldFirst(GpuWorld& w, const std::function<void()>& submit) {
  w.fake->hold = true;
  submit();
  CHECK(AllLaunched(w, 1));
  w.fake->hold = false;
  w.fake->ReleaseHeld();
}

TEST(NcclLookahead_QueuedCollectivesAreAgreedInOneRoundWithTheirOwnResults) {
  // 20 allreduces: the first makes the communicator (a round alone), the second's round
  // peeks at what was queued by then, and the next round at all the rest. One round each
  // without the lookahead.
  const int n = 3, count = 20;
  GpuWorld w(n, 10.0, /*max_in_flight=*/1);
  Job job(n);
  SubmitBehindAHeldFirst(w, [&] { SubmitAll(w, job, count); });
  for (int r = 0; r < n; ++r) {
    CheckCompletedWithTheirSums(job, r, n, count);
    CHECK(w.Backend(r)->agreement_rounds() <= 3) << w.Backend(r)->agreement_rounds();
  }
  w.Shutdown();
  for (int r = 0; r < n; ++r) CHECK_EQ(w.fake->Count(r, "violation"), 0);
}

TEST(NcclLookahead_AMismatchBehindTheHeadGetsItsOwnRoundAndIsNamedOnEveryRank) {
  // At 3 ranks, rank 2 (folded into recursive doubling by rank 0) has 3 elements in its 8th
  // allreduce where the others have 2: the lookahead stops before it, its own round misses
  // and the full exchange names the shape on every rank; the collectives around it complete
  // with their own results, in fewer rounds than collectives.
  const int n = 3, count = 12, bad = 7;
  GpuWorld w(n, 10.0, /*max_in_flight=*/1);
  Job job(n);
  SubmitBehindAHeldFirst(w, [&] {
    for (int r = 0; r < n; ++r) {
      auto& mine = At(job.data, r);
      for (int i = 0; i < count; ++i) mine.push_back(Input(r, i));
      if (r == 2) At(mine, bad).push_back(0.0f);
      for (int i = 0; i < count; ++i) SubmitOnDevice(w, r, At(mine, i), i, job.Of(r));
    }
  });
  for (int r = 0; r < n; ++r) {
    CheckOneMismatch(job, r, n, count, bad);
    CHECK(At(At(job.data, r), bad) == Input(r, bad) || r == 2) << "written after a mismatch";
    CHECK(w.Backend(r)->agreement_rounds() < count) << w.Backend(r)->agreement_rounds();
  }
}

TEST(NcclLookahead_AHostCollectiveWhereThePeerHasADeviceOneIsAMismatchNotARide) {
  // Rank 1's 5th collective is a host allreduce whose data rides its agreement; rank 0's is
  // a device one whose agreement carries lookahead slots. The two messages must not be taken
  // for each other: the placement mismatch is named on both ranks, the rest completes.
  const int n = 2, count = 10, odd = 4;
  GpuWorld w(n, 10.0, /*max_in_flight=*/1);
  Job job(n);
  std::vector<float> host = {1.0f, 2.0f};
  SubmitBehindAHeldFirst(w, [&] {
    for (int r = 0; r < n; ++r) {
      auto& mine = At(job.data, r);
      for (int i = 0; i < count; ++i) mine.push_back(Input(r, i));
      for (int i = 0; i < count; ++i) {
        if (r == 1 && i == odd) {
          Request on_host = Allreduce(Tensor(DataType::kFloat32, {2}, host.data(), host.data()),
                                      ReduceOp::kSum, 1.0, 1.0, "step" + std::to_string(i));
          on_host.done = job.Of(r).For(i);
          At(w.runtimes, r)->Submit(std::move(on_host));
        } else {
          SubmitOnDevice(w, r, At(mine, i), i, job.Of(r));
        }
      }
    }
  });
  for (int r = 0; r < n; ++r) CheckOneMismatch(job, r, n, count, odd);
  CHECK(host == std::vector<float>({1.0f, 2.0f})) << "written after a mismatch";
}

TEST(NcclLookahead_AShutdownLeavingAgreedCollectivesIsAFailureToThePeers) {
  // Rank 0 stops while collectives it agreed through the lookahead are still queued: its
  // peers may already run theirs on the GPU, which can never complete. Its notice must be a
  // failure (the peers' liveness polls end those at once), not the clean shutdown that only
  // an agreement round would read, after the timeout.
  const int n = 2, count = 20;
  GpuWorld w(n, 3.0, /*max_in_flight=*/1);
  Job job(n);
  w.fake->hold = true;
  SubmitAll(w, job, count);
  CHECK(AllLaunched(w, 1));
  w.fake->ReleaseHeld();  // the first completes; the worker then waits behind the next, held
  CHECK(WaitUntil([&] { return w.Backend(0)->Committed() > 0 && w.Backend(1)->Committed() > 0; }));
  const size_t owed = w.Backend(0)->Committed();
  At(w.runtimes, 0)->Stop();
  const Status cause = At(w.transports, 0)->AbortCause();
  CHECK(cause.code() == Code::kAborted) << cause.message();
  CHECK(cause.message().find("leaving " + std::to_string(owed) + " collectives") !=
        std::string::npos)
      << cause.message();
  w.fake->hold = false;
  w.fake->ReleaseHeld();
  for (int r = 0; r < n; ++r) CHECK(job.Of(r).WaitFor(count)) << "rank " << r;
}

TEST(NcclLookahead_ACleanShutdownWithNothingAgreedAheadStaysClean) {
  GpuWorld w(2);
  std::vector<std::vector<float>> x = {{1.0f}, {2.0f}};
  w.Each([&](int r) { CHECK_OK(w.Run(r, InPlace(At(x, r)))); });
  CHECK_EQ(w.Backend(0)->Committed(), 0u);
  At(w.runtimes, 0)->Stop();
  const Status cause = At(w.transports, 0)->AbortCause();
  CHECK(cause.code() == Code::kCancelled) << cause.message();
}

TEST(NcclLookahead_AHostCollectiveEndsTheLookaheadAndKeepsItsPlace) {
  // Per rank: 5 device allreduces, a host allreduce, 5 device allreduces. The host one runs
  // on the host executor with a round of its own: the lookahead must not reach past it (the
  // device ones behind it would be agreed for seqs the host one takes).
  const int n = 2, devices = 10;
  GpuWorld w(n, 10.0, /*max_in_flight=*/1);
  Job job(n);
  std::vector<std::vector<float>> host(n);
  SubmitBehindAHeldFirst(w, [&] {
    for (int r = 0; r < n; ++r) {
      auto& mine = At(job.data, r);
      for (int i = 0; i < devices; ++i) mine.push_back(Input(r, i));
      Completions& c = job.Of(r);
      for (int i = 0; i < devices / 2; ++i) SubmitOnDevice(w, r, At(mine, i), i, c);
      At(host, r) = {static_cast<float>(r + 10)};
      Request on_host = InPlace(At(host, r));
      on_host.done = c.For(devices / 2);
      At(w.runtimes, r)->Submit(std::move(on_host));
      for (int i = devices / 2; i < devices; ++i) SubmitOnDevice(w, r, At(mine, i), i + 1, c);
    }
  });
  for (int r = 0; r < n; ++r) {
    CHECK(job.Of(r).WaitFor(devices + 1)) << "rank " << r;
    const auto done = job.Of(r).Get();
    CheckInOrder(done, r);
    for (const auto& d : done) CHECK_OK(d.second);
    CHECK_EQ(At(host, r)[0], 21.0f);
    for (int i = 0; i < devices; ++i) CHECK(At(At(job.data, r), i) == Sum(n, i)) << r << " " << i;
    CHECK(w.Backend(r)->agreement_rounds() < devices) << w.Backend(r)->agreement_rounds();
  }
}

}  // namespace
}  // namespace kr_test
