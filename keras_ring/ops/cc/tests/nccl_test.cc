// The NCCL backend's host logic through the runtime, with the fake CUDA/NCCL of nccl_fake.h
// behind its seam: communicator cache and unique-id exchange, stream ordering, grouped and
// allgather launches, and the failure paths (missing NCCL, timeouts, async errors, a hanging
// ncclCommInitRank, shutdown). Every wait is bounded, so a bug shows up as a failure.
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../core/reduce.h"
#include "nccl_world.h"
#include "test_harness.h"

namespace kr_test {
namespace {

TEST(Nccl_AllreduceMakesOneCommunicatorFromRankZerosId) {
  GpuWorld w(3);
  w.Each([&](int r) {
    std::vector<float> in(1000), out(1000);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(r * 3 + static_cast<int>(i));
    CHECK_OK(w.Run(r, Allreduce(Tensor(DataType::kFloat32, {10, 100}, in.data(), out.data()),
                                ReduceOp::kAverage)));
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i] != static_cast<float>(3 + static_cast<int>(i))) {
        CHECK_EQ(out[i], static_cast<float>(3 + static_cast<int>(i))) << "rank " << r << " i " << i;
        break;
      }
    }
    // The second collective reuses the communicator, in place, another dtype and op.
    std::vector<int64_t> v = {r + 1, -r, 7};
    CHECK_OK(w.Run(r, Allreduce(Tensor(DataType::kInt64, {3}, v.data(), v.data()), ReduceOp::kSum)));
    CHECK(v == std::vector<int64_t>({6, -3, 21})) << "rank " << r;
  });
  for (int r = 0; r < 3; ++r) {
    CHECK_EQ(w.fake->Count(r, "uniqueid"), r == 0 ? 1 : 0);
    CHECK_EQ(w.fake->Count(r, "init " + std::to_string(r) + "/3"), 1);
    CHECK_EQ(w.fake->Count(r, "allreduce@"), 2);
  }
}

TEST(Nccl_OrderedThroughEventsNotHostSynchronisation) {
  GpuWorld w(2);
  w.Each([&](int r) {
    std::vector<double> x = {1.0 + r};
    CHECK_OK(w.Run(r, Allreduce(Tensor(DataType::kFloat64, {1}, x.data(), x.data()), ReduceOp::kSum)));
    CHECK_EQ(x[0], 3.0);
  });
  // Submission records "ready" on the caller's stream; the runtime's stream waits for it,
  // runs NCCL, records "done", and the caller's stream waits for that.
  const std::vector<std::string> log = w.fake->Log(0);
  const int ready = Find(log, "record ");
  CHECK(ready >= 0 && log[static_cast<size_t>(ready)].find("@caller") != std::string::npos);
  const std::string& ready_entry = log[static_cast<size_t>(ready)];
  const std::string ready_event = ready_entry.substr(7, ready_entry.find('@') - 7);
  const int wait_ready = Find(log, "wait stream", ready);
  CHECK(wait_ready > ready &&
        log[static_cast<size_t>(wait_ready)].find(":" + ready_event) != std::string::npos);
  const int launch = Find(log, "allreduce@stream", wait_ready);
  CHECK(launch > wait_ready);
  const int record_done = Find(log, "record ", launch);
  CHECK(record_done > launch &&
        log[static_cast<size_t>(record_done)].find("@stream") != std::string::npos);
  const int wait_done = Find(log, "wait caller:", record_done);
  CHECK(wait_done > record_done) << "the caller's stream must wait for the NCCL work";
}

TEST(Nccl_GroupedAllreduceIsOneGroupAndSkipsEmptyTensors) {
  GpuWorld w(2);
  w.Each([&](int r) {
    std::vector<float> a(15, 1.5f * (r + 1));
    std::vector<uint16_t> h(7, keras_ring::FloatToHalf(0.25f + r));
    std::vector<int64_t> i = {r, 10 * r, -1, 4};
    std::vector<float> empty;
    Request req;
    req.kind = Kind::kGroupedAllreduce;
    req.op = ReduceOp::kSum;
    req.tensors = {Tensor(DataType::kFloat32, {3, 5}, a.data(), a.data()),
                   Tensor(DataType::kFloat16, {7}, h.data(), h.data()),
                   Tensor(DataType::kInt64, {4}, i.data(), i.data()),
                   Tensor(DataType::kFloat32, {0}, empty.data(), empty.data())};
    CHECK_OK(w.Run(r, std::move(req)));
    CHECK_EQ(a[14], 4.5f);
    CHECK_EQ(keras_ring::HalfToFloat(h[6]), 1.5f);
    CHECK(i == std::vector<int64_t>({1, 10, -2, 8}));
  });
  const std::vector<std::string> log = w.fake->Log(1);
  const int start = Find(log, "group start");
  CHECK(start >= 0);
  CHECK_EQ(Find(log, "group end", start) - start, 4) << "three allreduces inside one group";
  CHECK_EQ(w.fake->Count(1, "allreduce@"), 3);
}

TEST(Nccl_ScaleFactorsBecomeOneCachedPreMulSum) {
  GpuWorld w(2);
  w.Each([&](int r) {
    for (int step = 0; step < 2; ++step) {
      std::vector<double> x = {2.0 + r, -4.0};
      CHECK_OK(w.Run(r, Allreduce(Tensor(DataType::kFloat64, {2}, x.data(), x.data()),
                                  ReduceOp::kAverage, 0.5, 3.0)));
      // 3 * (0.5*2 + 0.5*3) / 2 and 3 * (0.5*-4 * 2) / 2
      CHECK_EQ(x[0], 3.75);
      CHECK_EQ(x[1], -6.0);
    }
  });
  CHECK_EQ(w.fake->Count(0, "premul 0.75"), 1);
  CHECK_EQ(w.fake->Count(0, "premul"), 1);
  w.Shutdown();
  CHECK_EQ(w.fake->Count(0, "destroy premul"), 1);
}

// The fake leaves the tail that NCCL 2.28's one-rank kernel leaves (plan.h), so these fail
// if a one-rank reduction is handed to it whole.
TEST(Nccl_OneRankScaledReductionsWriteEveryElement) {
  GpuWorld w(1);
  const size_t n = (1 << 20) + 7;
  std::vector<float> in(n), out(n, -7.0f);
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<float>(static_cast<int>(i % 101) - 50);
  CHECK_OK(w.Run(0, Allreduce(Tensor(DataType::kFloat32, {static_cast<int64_t>(n)}, in.data(),
                                     out.data()),
                              ReduceOp::kAverage)));
  CHECK(out == in) << "Average at one rank: first tail element " << out[n - 7];
  std::vector<double> x(n + 9, 3.0);  // in place, a scale factor, another length and dtype
  CHECK_OK(w.Run(0, Allreduce(Tensor(DataType::kFloat64, {static_cast<int64_t>(x.size())},
                                     x.data(), x.data()),
                              ReduceOp::kSum, 0.5)));
  CHECK_EQ(x.front(), 1.5);
  CHECK_EQ(x.back(), 1.5);
  std::vector<float> part(n, -7.0f);  // a reducescatter's one part is the whole input
  Request scatter = Allreduce(Tensor(DataType::kFloat32, {static_cast<int64_t>(n), 1}, in.data(),
                                     part.data()),
                              ReduceOp::kAverage);
  scatter.kind = Kind::kReducescatter;
  CHECK_OK(w.Run(0, std::move(scatter)));
  CHECK(part == in) << "reducescatter at one rank: first tail element " << part[n - 7];
  std::vector<uint16_t> h(40003, keras_ring::FloatToHalf(2.0f)), g(5, keras_ring::FloatToHalf(2.0f));
  Request grouped;  // each tensor in its pieces, all in one group
  grouped.kind = Kind::kGroupedAllreduce;
  grouped.op = ReduceOp::kAverage;
  grouped.tensors = {Tensor(DataType::kFloat16, {40003}, h.data(), h.data()),
                     Tensor(DataType::kFloat16, {5}, g.data(), g.data())};
  grouped.prescale = 0.25;
  CHECK_OK(w.Run(0, std::move(grouped)));
  CHECK_EQ(keras_ring::HalfToFloat(h.back()), 0.5f);
  CHECK_EQ(keras_ring::HalfToFloat(g.back()), 0.5f);
  const std::vector<std::string> log = w.fake->Log(0);
  const int first = Find(log, "group start");
  CHECK(first >= 0);
  CHECK_EQ(Find(log, "group end", first) - first, 3) << "the first allreduce in two pieces";
  int last = first;
  while (Find(log, "group start", last + 1) >= 0) last = Find(log, "group start", last + 1);
  CHECK_EQ(Find(log, "group end", last) - last, 4) << "two pieces and one whole tensor";
}

TEST(Nccl_UnsupportedScaleFailsEveryRankAlikeAndStaysUsable) {
  GpuWorld w(2);
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    const Status s =
        w.Run(r, InPlace(x, ReduceOp::kMax, 2.0));
    CHECK(s.code() == Code::kInvalidArgument) << s.message();
    CHECK_CONTAINS(s.message(), "allreduce 'grad' failed on rank " + std::to_string(r));
    CHECK_OK(w.Run(r, InPlace(x, ReduceOp::kMax)));
  });
  CHECK_EQ(w.fake->Count(0, "init"), 1) << "only the second collective needed a communicator";
}

TEST(Nccl_AllgatherWithVaryingRowsBroadcastsEachBlockInOneGroup) {
  GpuWorld w(3);
  const std::vector<int64_t> rows = {2, 0, 3};
  w.Each([&](int r) {
    std::vector<int32_t> in(static_cast<size_t>(rows[static_cast<size_t>(r)] * 2));
    for (size_t i = 0; i < in.size(); ++i) in[i] = r * 100 + static_cast<int32_t>(i);
    std::vector<int32_t> out;
    Request req;
    req.kind = Kind::kAllgather;
    req.tensors.push_back(
        Tensor(DataType::kInt32, {rows[static_cast<size_t>(r)], 2}, in.data(), nullptr));
    req.allocate_output = [&out](int64_t total, void** p) {
      out.resize(static_cast<size_t>(total * 2));
      *p = out.data();
      return Status::OK();
    };
    CHECK_OK(w.Run(r, std::move(req)));
    CHECK(out == std::vector<int32_t>({0, 1, 2, 3, 200, 201, 202, 203, 204, 205})) << "rank " << r;
  });
  CHECK_EQ(w.fake->Count(2, "broadcast@"), 2) << "the empty block is skipped on every rank";
  CHECK_EQ(w.fake->Count(2, "allgather@"), 0);
  // The output is allocated on the worker, so the work waits for the caller's stream as of then.
  const std::vector<std::string> log = w.fake->Log(2);
  CHECK_EQ(w.fake->Count(2, "record "), 3) << "ready, after allocation, done";
  const int allocated = Find(log, "record ", Find(log, "record ") + 1);
  CHECK(allocated >= 0 && log[static_cast<size_t>(allocated)].find("@caller") != std::string::npos);
  CHECK(Find(log, "wait stream", allocated) < Find(log, "group start", allocated));
}

TEST(Nccl_UniformAllgatherIsOneCallAndBroadcastReachesEveryRank) {
  GpuWorld w(2);
  w.Each([&](int r) {
    std::vector<uint16_t> in = {static_cast<uint16_t>(r), static_cast<uint16_t>(r + 10)};
    std::vector<uint16_t> out;
    Request req;
    req.kind = Kind::kAllgather;
    req.tensors.push_back(Tensor(DataType::kBFloat16, {2}, in.data(), nullptr));
    req.allocate_output = [&out](int64_t total, void** p) {
      out.resize(static_cast<size_t>(total));
      *p = out.data();
      return Status::OK();
    };
    CHECK_OK(w.Run(r, std::move(req)));
    CHECK(out == std::vector<uint16_t>({0, 10, 1, 11}));
    std::vector<uint8_t> flags = {static_cast<uint8_t>(r), 1, static_cast<uint8_t>(r)};
    Request b;
    b.kind = Kind::kBroadcast;
    b.root = 1;
    b.tensors.push_back(Tensor(DataType::kBool, {3}, flags.data(), flags.data()));
    CHECK_OK(w.Run(r, std::move(b)));
    CHECK(flags == std::vector<uint8_t>({1, 1, 1}));
  });
  CHECK_EQ(w.fake->Count(0, "allgather@"), 1);
}

TEST(Nccl_MissingNcclOnOneRankFailsEveryRankAlike) {
  GpuWorld w(3);
  w.fake->SetLoadNcclError(1, "keras_ring: GPU collective needs NCCL: libnccl.so.2 not found "
                              "(install keras-ring[cuda] or nvidia-nccl-cu12)");
  w.Each([&](int r) {
    std::vector<float> x = {1.0f, 2.0f};
    Status s = w.Run(r, InPlace(x, ReduceOp::kSum));
    CHECK(s.code() == Code::kFailedPrecondition) << s.message();
    CHECK_CONTAINS(s.message(), "rank 1: GPU collective needs NCCL: libnccl.so.2 not found");
    CHECK_EQ(s.peer(), 1);
    // Nothing was half done: the runtime still works for host tensors.
    CHECK_OK(w.Run(r, InPlace(x, ReduceOp::kSum), false));
    CHECK_EQ(x[1], 6.0f);
  });
  for (int r = 0; r < 3; ++r) CHECK_EQ(w.fake->Count(r, "init"), 0);
  CHECK_EQ(w.fake->Count(0, "uniqueid"), 0);
}

TEST(Nccl_PlacementMismatchFailsBeforeAnyData) {
  GpuWorld w(2);
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    Status s = w.Run(r, InPlace(x, ReduceOp::kSum), r == 0);
    CHECK(s.code() == Code::kFailedPrecondition) << s.message();
    CHECK_CONTAINS(s.message(), "placement mismatch: rank 0 has a tensor in GPU memory, "
                                "rank 1 has a tensor in host memory");
  });
  CHECK_EQ(w.fake->Count(0, "init"), 0);
}

TEST(Nccl_EmptyTensorsNeedNoCommunicator) {
  GpuWorld w(2);
  w.Each([&](int r) {
    std::vector<float> x;
    CHECK_OK(w.Run(r, Allreduce(Tensor(DataType::kFloat32, {0, 4}, x.data(), x.data()),
                                ReduceOp::kSum)));
  });
  CHECK_EQ(w.fake->Count(0, "init"), 0);
}

// Positions in `log` of the entries that start with `prefix`.
std::vector<int> FindAll(const std::vector<std::string>& log, const std::string& prefix) {
  std::vector<int> at;
  for (int i = Find(log, prefix); i >= 0; i = Find(log, prefix, i + 1)) at.push_back(i);
  return at;
}

// "record event4@caller" -> "event4"
std::string EventOf(const std::string& entry) {
  const size_t start = entry.find(' ') + 1;
  return entry.substr(start, entry.find('@') - start);
}

TEST(Nccl_QueuedCollectivesRunOnTheStreamInSubmissionOrder) {
  // Three collectives queued back to back on one buffer, each reading the previous one's
  // output: every one waits on the stream for its own inputs, launches, and hands its result
  // back to the caller's stream before the next one starts (on the GPU; the host does not
  // wait in between: nccl_inflight_test.cc).
  GpuWorld w(2);
  w.Each([&](int r) {
    std::vector<float> x = {1.0f + static_cast<float>(r)};
    std::vector<std::promise<Status>> done(3);
    const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMax};
    for (int i = 0; i < 3; ++i) {
      Request req = Allreduce(Tensor(DataType::kFloat32, {1}, x.data(), x.data()), ops[i], 1.0,
                              1.0, "step" + std::to_string(i));
      w.Attach(r, &req);
      req.done = [&done, i](const Status& s) { At(done, i).set_value(s); };
      At(w.runtimes, r)->Submit(std::move(req));
    }
    for (auto& d : done) CHECK_OK(d.get_future().get());
    CHECK_EQ(x[0], 9.0f) << "(1 + 2) summed, then 3 * 3: in any other order it is not 9";
  });
  for (int r = 0; r < 2; ++r) {
    const std::vector<std::string> log = w.fake->Log(r);
    std::vector<int> ready, stream_waits, launches, done_records, caller_waits;
    for (int i : FindAll(log, "record ")) {
      const bool on_caller = log[static_cast<size_t>(i)].find("@caller") != std::string::npos;
      (on_caller ? ready : done_records).push_back(i);
    }
    stream_waits = FindAll(log, "wait stream");
    launches = FindAll(log, "allreduce@stream");
    caller_waits = FindAll(log, "wait caller:");
    CHECK(ready.size() == 3 && stream_waits.size() == 3 && launches.size() == 3 &&
          done_records.size() == 3 && caller_waits.size() == 3)
        << "rank " << r;
    for (size_t i = 0; i < 3 && i < ready.size() && caller_waits.size() == 3; ++i) {
      const std::string& wait = log[static_cast<size_t>(stream_waits[i])];
      CHECK_EQ(wait.substr(wait.find(':') + 1), EventOf(log[static_cast<size_t>(ready[i])]))
          << "collective " << i << " waits for its own inputs";
      CHECK(ready[i] < stream_waits[i] && stream_waits[i] < launches[i] &&
            launches[i] < done_records[i] && done_records[i] < caller_waits[i])
          << "collective " << i;
      const std::string& back = log[static_cast<size_t>(caller_waits[i])];
      CHECK_EQ(back.substr(back.find(':') + 1), EventOf(log[static_cast<size_t>(done_records[i])]));
      if (i + 1 < 3) {
        CHECK(caller_waits[i] < stream_waits[i + 1]) << "collective " << i;
      }
    }
  }
}

TEST(Nccl_NoContextIsMadeOnAnotherRanksGpu) {
  // Each rank has its own GPU (its local_rank), submitting from threads with no CUDA context
  // yet, as TensorFlow's may be: CUDA says "device 0" there, and switching back to it would
  // make a context on GPU 0 in every process.
  GpuWorld w(2);
  w.Each([&](int r) {
    for (int i = 0; i < 2; ++i) {
      std::vector<float> x = {1.0f};
      CHECK_OK(w.Run(r, InPlace(x), true, r));
    }
  });
  // A thread that was working on another GPU is put back on it.
  std::thread([&w] {
    At(w.apis, 0)->SetDevice(3);
    std::vector<float> x = {1.0f};
    Request req = InPlace(x);
    w.Attach(0, &req, 0);
    int device = -1;
    At(w.apis, 0)->GetDevice(&device);
    CHECK_EQ(device, 3);
  }).join();
  w.Shutdown();
  CHECK_EQ(w.fake->Count(1, "context 0"), 0) << "rank 1 made a context on GPU 0";
  CHECK_EQ(w.fake->Count(1, "context 1"), 1);
  CHECK_EQ(w.fake->Count(0, "context 1"), 0);
}

TEST(Nccl_RanksOnDifferentCommunicatorsFailAtOnceInsteadOfTimingOut) {
  GpuWorld w(2, 20.0);
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    CHECK_OK(w.Run(r, InPlace(x), true, r));  // each on its own GPU: communicator #0
    // Rank 0 moves to another GPU (a new communicator); rank 1 stays on #0.
    const auto start = keras_ring::Clock::now();
    const Status s = w.Run(r, InPlace(x), true, r == 0 ? 5 : r);
    CHECK(s.code() == Code::kFailedPrecondition) << s.message();
    CHECK_CONTAINS(s.message(),
                   "NCCL communicator mismatch: rank 0 has a new NCCL communicator #1 to make "
                   "for GPU 5, rank 1 has NCCL communicator #0 (GPU 1)");
    CHECK(SecondsSince(start) < 10.0) << "a hang guard: the timeout is 20 s";
    CHECK_OK(w.Run(r, InPlace(x), true, r));  // nothing moved: still usable
    CHECK_EQ(x[0], 4.0f);
  });
  for (int r = 0; r < 2; ++r) CHECK_EQ(w.fake->Count(r, "init"), 1);
}

}  // namespace
}  // namespace kr_test
