// The NCCL backend when things go wrong, with the fake CUDA/NCCL of nccl_fake.h: collectives
// and lazy connections that stall, asynchronous errors, communicator setup that fails or
// never finishes, peers that die while a rank waits on its GPU, shutdown in the middle of a
// collective, and teardown with peers that never finish theirs. Communicators are
// nonblocking (as NCCL >= 2.14 makes them), so every one of these ends in ncclCommAbort on
// the worker, bounded by the deadline, with no thread left behind; NCCL < 2.14 gets blocking
// ones.
#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "nccl_world.h"
#include "test_harness.h"

namespace kr_test {
namespace {

TEST(Nccl_StalledCollectiveTimesOutAbortsAndBreaksTheRuntime) {
  GpuWorld w(2, 0.5);
  w.fake->hang = true;
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    const auto start = keras_ring::Clock::now();
    Status s = w.Run(r, InPlace(x, ReduceOp::kSum));
    CHECK(s.code() == Code::kDeadlineExceeded) << s.message();
    CHECK_CONTAINS(s.message(), "NCCL allreduce did not complete within 0.5 s");
    CHECK_CONTAINS(s.message(), "its NCCL communicator was aborted");
    CHECK(SecondsSince(start) < 5.0);
    s = w.Run(r, InPlace(x, ReduceOp::kSum));
    CHECK_CONTAINS(s.message(), "because an earlier collective failed");
  });
  for (int r = 0; r < 2; ++r) CHECK_EQ(w.fake->Count(r, "abort"), 1);
  w.Shutdown();
  for (int r = 0; r < 2; ++r) {
    CHECK_EQ(w.fake->Count(r, "destroy comm") + w.fake->Count(r, "finalize"), 0)
        << "an aborted communicator is not ended again";
    CHECK_EQ(w.fake->Count(r, "violation"), 0) << "nothing is called on it after the abort";
  }
}

TEST(Nccl_ALaunchStillInProgressIsSettledBeforeAnythingFollowsOnItsStream) {
  GpuWorld w(2);
  w.fake->launch_polls = 5;  // nonblocking: each launch answers ncclInProgress for a while
  w.Each([&](int r) {
    std::vector<float> x = {1.0f + static_cast<float>(r), 2.0f};
    CHECK_OK(w.Run(r, InPlace(x, ReduceOp::kSum)));
    CHECK(x == std::vector<float>({3.0f, 4.0f}));
    std::vector<double> a = {0.5 * r}, b = {1.0};
    Request grouped;
    grouped.kind = Kind::kGroupedAllreduce;
    grouped.op = ReduceOp::kMax;
    grouped.tensors = {Tensor(DataType::kFloat64, {1}, a.data(), a.data()),
                       Tensor(DataType::kFloat64, {1}, b.data(), b.data())};
    CHECK_OK(w.Run(r, std::move(grouped)));
    CHECK_EQ(a[0], 0.5);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_EQ(w.fake->Count(r, "violation"), 0)
        << "a call or an event on the stream before NCCL finished launching";
    // Setup and both launches were each polled until they left ncclInProgress.
    CHECK(w.fake->Count(r, "poll") >= 2 * 5 + 1) << w.fake->Count(r, "poll");
  }
  w.Shutdown();
  for (int r = 0; r < 2; ++r) CHECK_EQ(w.fake->Count(r, "violation"), 0);
}

TEST(Nccl_ALazyConnectionThatNeverFinishesIsAbortedAtTheDeadline) {
  GpuWorld w(2, 0.5);
  w.fake->launch_stuck = true;  // NCCL >= 2.22 connects peers inside the first collective
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    Status s = w.Run(r, InPlace(x, ReduceOp::kSum));
    CHECK(s.code() == Code::kDeadlineExceeded) << s.message();
    CHECK_CONTAINS(s.message(), "ncclAllReduce did not complete within 0.5 s");
    CHECK_CONTAINS(s.message(), "(its NCCL communicator was aborted)");
    s = w.Run(r, InPlace(x, ReduceOp::kSum));
    CHECK_CONTAINS(s.message(), "because an earlier collective failed");
  });
  const auto start = keras_ring::Clock::now();
  w.Shutdown();
  CHECK(SecondsSince(start) < 5.0);
  for (int r = 0; r < 2; ++r) {
    CHECK_EQ(w.fake->Count(r, "abort"), 1);
    CHECK_EQ(w.fake->Count(r, "violation"), 0);
    for (const std::string& entry : w.fake->Log(r)) {
      CHECK(entry.find("@stream") == std::string::npos || entry.find("record") != 0)
          << "an event recorded behind a launch that never finished: " << entry;
    }
  }
}

TEST(Nccl_ADeadPeerEndsADeviceWaitWithoutWaitingForTheTimeout) {
  GpuWorld w(2, 20.0);
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    CHECK_OK(w.Run(r, InPlace(x)));
  });
  // NCCL never completes nor reports anything (as when its same-host transports lose a
  // peer); only the host transport's liveness signal says the peer is gone.
  // Once both ranks launched (past the signature exchange), each sees the other die.
  w.fake->hang = true;
  std::atomic<int> launched{0};
  w.fake->on_launch = [&w, &launched](int) {
    if (++launched < 2) return;
    for (int r = 0; r < 2; ++r) {
      const int other = 1 - r;
      At(w.transports, r)->SetPeerFailure(
          Status(Code::kUnavailable, "lost rank " + std::to_string(other) + ": its process exited",
                 other));
    }
  };
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    const auto start = keras_ring::Clock::now();
    const Status s = w.Run(r, InPlace(x));
    CHECK(s.code() == Code::kUnavailable) << s.message();
    CHECK_EQ(s.peer(), 1 - r);
    CHECK_CONTAINS(s.message(), "lost rank " + std::to_string(1 - r));
    CHECK_CONTAINS(s.message(), "(its NCCL communicator was aborted)");
    CHECK(SecondsSince(start) < 15.0) << "a hang guard: the timeout is 20 s";
  });
  w.Shutdown();
  for (int r = 0; r < 2; ++r) {
    CHECK_EQ(w.fake->Count(r, "abort"), 1);
    CHECK_EQ(w.fake->Count(r, "finalize"), 0) << "no cooperative teardown with a dead peer";
  }
}

TEST(Nccl_AsyncErrorAbortsTheCommunicator) {
  GpuWorld w(2, 1.0);
  w.fake->hang = true;
  w.fake->async_error = kn::kNcclRemoteError;
  w.fake->async_error_rank = 0;
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    Status s = w.Run(r, InPlace(x, ReduceOp::kSum));
    if (r == 0) {
      CHECK(s.code() == Code::kUnavailable) << s.message();
      CHECK_CONTAINS(s.message(), "NCCL allreduce failed: fake nccl error 6");
    } else {
      CHECK(s.code() == Code::kDeadlineExceeded) << s.message();
    }
  });
  CHECK_EQ(w.fake->Count(0, "abort"), 1);
}

TEST(Nccl_FailedCommunicatorSetupIsFatalAndAborted) {
  GpuWorld w(2, 1.0);
  w.fake->SetInitResult(1, kn::kNcclInvalidUsage);  // reported asynchronously, as NCCL does
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    Status s = w.Run(r, InPlace(x, ReduceOp::kSum));
    CHECK(s.fatal()) << s.message();
    if (r == 1) {
      CHECK_CONTAINS(s.message(), "ncclCommInitRankConfig failed: fake nccl error 5");
      CHECK_CONTAINS(s.message(), "NCCL_MULTI_RANK_GPU_ENABLE=1");
    }
  });
  CHECK_EQ(w.fake->Count(1, "abort"), 1) << "a communicator whose setup failed is aborted";
}

TEST(Nccl_CommunicatorSetupThatNeverFinishesIsAbortedAtTheDeadline) {
  GpuWorld w(2, 0.3);
  w.fake->block_init = true;
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    Status s = w.Run(r, InPlace(x, ReduceOp::kSum));
    CHECK(s.code() == Code::kDeadlineExceeded) << s.message();
    CHECK_CONTAINS(s.message(), "ncclCommInitRankConfig did not complete within 0.3 s");
    // Aborted by the worker before the collective failed: nothing is left running.
    CHECK_EQ(w.fake->Count(r, "abort"), 1);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK_EQ(w.fake->Count(r, "init " + std::to_string(r) + "/2 nonblocking"), 1);
  }
}

TEST(Nccl_OldNcclGetsBlockingCommunicators) {
  GpuWorld w(2);
  w.fake->nonblocking = false;  // NCCL < 2.14: no ncclCommInitRankConfig
  w.Each([&](int r) {
    std::vector<float> x = {2.0f * static_cast<float>(r)};
    CHECK_OK(w.Run(r, InPlace(x)));
    CHECK_EQ(x[0], 2.0f);
  });
  w.Shutdown();
  for (int r = 0; r < 2; ++r) {
    CHECK_EQ(w.fake->Count(r, "init " + std::to_string(r) + "/2 blocking"), 1);
    CHECK_EQ(w.fake->Count(r, "finalize"), 0);
    CHECK_EQ(w.fake->Count(r, "destroy comm"), 1);
  }
}

TEST(Nccl_ShutdownFinalizesThenDestroysCommunicatorsStreamsAndEvents) {
  GpuWorld w(2);
  w.Each([&](int r) {
    for (int i = 0; i < 3; ++i) {
      std::vector<float> x(64, 1.0f);
      CHECK_OK(w.Run(r, InPlace(x, ReduceOp::kSum)));
    }
  });
  CHECK(w.fake->LiveObjects(0) > 0);
  w.Shutdown();
  for (int r = 0; r < 2; ++r) {
    const std::vector<std::string> log = w.fake->Log(r);
    const int finalize = Find(log, "finalize");
    CHECK(finalize >= 0 && Find(log, "destroy comm", finalize) > finalize);
    CHECK_EQ(w.fake->Count(r, "abort"), 0);
    CHECK_EQ(w.fake->Count(r, "violation"), 0);
    CHECK_EQ(w.fake->LiveObjects(r), 0) << "rank " << r;
  }
}

TEST(Nccl_TeardownAfterAHostFailureAbortsInsteadOfFinalizing) {
  GpuWorld w(2, 0.5);
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    CHECK_OK(w.Run(r, InPlace(x)));
  });
  // Rank 1 never submits the second collective: rank 0's signature exchange times out,
  // which breaks its runtime without any NCCL error.
  std::vector<float> x = {1.0f};
  const Status s = w.Run(0, InPlace(x));
  CHECK(s.code() == Code::kDeadlineExceeded) << s.message();
  w.Shutdown();
  CHECK_EQ(w.fake->Count(0, "abort"), 1) << "the peer may be gone: no cooperative teardown";
  CHECK_EQ(w.fake->Count(0, "finalize"), 0);
  // Rank 1 saw nothing wrong and finalizes, but rank 0 never does: aborted at its deadline.
  CHECK_EQ(w.fake->Count(1, "finalize"), 1);
  CHECK_EQ(w.fake->Count(1, "abort"), 1);
  CHECK_EQ(w.fake->Count(1, "destroy comm"), 0);
}

TEST(Nccl_ATeardownThePeersDoNotJoinIsAbortedNotLeftBehind) {
  GpuWorld w(2, 0.3);
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    CHECK_OK(w.Run(r, InPlace(x)));
  });
  // Rank 0 shuts down alone: its finalize waits for rank 1, which is still running.
  const auto start = keras_ring::Clock::now();
  At(w.runtimes, 0).reset();
  CHECK(SecondsSince(start) < 5.0);
  CHECK_EQ(w.fake->Count(0, "finalize"), 1);
  CHECK_EQ(w.fake->Count(0, "abort"), 1);
  CHECK_EQ(w.fake->Count(0, "destroy comm"), 0);
  CHECK_EQ(w.fake->LiveObjects(0), 0) << "streams and events are freed all the same";
  // Rank 1 leaves later; rank 0's finalize counted, so its own completes.
  w.Shutdown();
  CHECK_EQ(w.fake->Count(1, "destroy comm"), 1);
}

TEST(Nccl_ShutdownEndsACollectiveInFlight) {
  GpuWorld w(2, 60.0);
  w.fake->hang = true;
  std::vector<std::promise<Status>> results(2);
  std::vector<std::vector<float>> data(2, std::vector<float>(4, 1.0f));
  std::vector<std::future<Status>> futures;
  for (int r = 0; r < 2; ++r) {
    futures.push_back(At(results, r).get_future());
    std::vector<float>& d = At(data, r);
    Request req = Allreduce(Tensor(DataType::kFloat32, {4}, d.data(), d.data()), ReduceOp::kSum);
    w.Attach(r, &req);
    req.done = [&results, r](const Status& s) { At(results, r).set_value(s); };
    At(w.runtimes, r)->Submit(std::move(req));
  }
  // Both ranks are inside the wait once rank 0 polled the stuck collective's event.
  while (w.fake->Count(0, "record") < 2 || w.fake->Count(1, "record") < 2) {
    std::this_thread::yield();  // a condition, not a sleep: bounded by the test's alarm
  }
  const auto start = keras_ring::Clock::now();
  w.Shutdown();
  CHECK(SecondsSince(start) < 5.0);
  for (int r = 0; r < 2; ++r) {
    const Status s = At(futures, r).get();
    CHECK(s.code() == Code::kAborted) << s.message();
    CHECK_CONTAINS(s.message(), "shut down while NCCL allreduce was running");
    CHECK_EQ(w.fake->Count(r, "abort"), 1);
  }
}

}  // namespace
}  // namespace kr_test
