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

#include "../core/nccl/backend.h"
#include "../core/reduce.h"
#include "../core/runtime.h"
#include "nccl_fake.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

namespace kn = keras_ring::nccl;
using keras_ring::Code;
using keras_ring::DataType;
using keras_ring::Kind;
using keras_ring::ReduceOp;
using keras_ring::Request;
using keras_ring::Runtime;
using keras_ring::Status;
using keras_ring::TensorRef;

// `n` runtimes over local transports, each rank with a fake GPU behind the seam.
class GpuWorld {
 public:
  explicit GpuWorld(int n, double timeout_seconds = 10.0)
      : fake(std::make_shared<FakeNcclWorld>(n)) {
    auto fabric = std::make_shared<keras_ring::LocalFabric>(n);
    for (int r = 0; r < n; ++r) {
      keras_ring::RuntimeOptions options;
      options.rank = r;
      options.size = n;
      options.timeout_seconds = timeout_seconds;
      options.stall_warning_seconds = 0;
      runtimes.push_back(std::make_unique<Runtime>(
          options, std::make_unique<keras_ring::LocalTransport>(fabric, r)));
      apis.push_back(std::make_shared<FakeDeviceApi>(fake, r));
    }
  }
  int size() const { return static_cast<int>(apis.size()); }

  // Runs the request on rank r, on the "GPU" unless on_device is false.
  Status Run(int r, Request request, bool on_device = true) {
    if (on_device) kn::AttachNccl(*At(runtimes, r), 0, CallerStream(r), &request, At(apis, r));
    return At(runtimes, r)->Run(std::move(request));
  }
  // fn(rank) on one thread per rank.
  void Each(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r) threads.emplace_back(fn, r);
    for (std::thread& t : threads) t.join();
  }
  void Shutdown() { runtimes.clear(); }

  std::shared_ptr<FakeNcclWorld> fake;
  std::vector<std::unique_ptr<Runtime>> runtimes;
  std::vector<std::shared_ptr<kn::DeviceApi>> apis;
};

TensorRef Tensor(DataType dtype, std::vector<int64_t> shape, const void* in, void* out) {
  TensorRef t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.input = in;
  t.output = out;
  return t;
}

Request Allreduce(TensorRef t, ReduceOp op, double pre = 1.0, double post = 1.0) {
  Request r;
  r.kind = Kind::kAllreduce;
  r.name = "grad";
  r.op = op;
  r.prescale = pre;
  r.postscale = post;
  r.tensors.push_back(std::move(t));
  return r;
}

// An in-place float32 allreduce of x (shape [size]).
Request InPlace(std::vector<float>& x, ReduceOp op = ReduceOp::kSum, double pre = 1.0) {
  return Allreduce(Tensor(DataType::kFloat32, {static_cast<int64_t>(x.size())}, x.data(), x.data()),
                   op, pre);
}

// Index of the first log entry at or after `from` that starts with `prefix`, or -1.
int Find(const std::vector<std::string>& log, const std::string& prefix, int from = 0) {
  for (size_t i = static_cast<size_t>(std::max(from, 0)); i < log.size(); ++i) {
    if (log[i].compare(0, prefix.size(), prefix) == 0) return static_cast<int>(i);
  }
  return -1;
}

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
  CHECK_EQ(w.fake->Count(0, "destroy comm"), 0) << "an aborted communicator is not destroyed again";
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

TEST(Nccl_FailedCommunicatorInitIsFatal) {
  GpuWorld w(2, 1.0);
  w.fake->SetInitResult(1, kn::kNcclInvalidUsage);
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    Status s = w.Run(r, InPlace(x, ReduceOp::kSum));
    CHECK(s.fatal()) << s.message();
    if (r == 1) {
      CHECK_CONTAINS(s.message(), "ncclCommInitRank failed: fake nccl error 5");
    }
  });
}

TEST(Nccl_HangingCommunicatorInitIsBounded) {
  GpuWorld w(2, 0.3);
  w.fake->block_init = true;
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    Status s = w.Run(r, InPlace(x, ReduceOp::kSum));
    CHECK(s.code() == Code::kDeadlineExceeded) << s.message();
    CHECK_CONTAINS(s.message(), "ncclCommInitRank did not complete");
  });
  // The abandoned helper aborts the communicator it eventually gets.
  w.fake->block_init = false;
  for (int i = 0; i < 200 && (w.fake->Count(0, "abort") == 0 || w.fake->Count(1, "abort") == 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK_EQ(w.fake->Count(0, "abort"), 1);
  CHECK_EQ(w.fake->Count(1, "abort"), 1);
}

TEST(Nccl_ShutdownDestroysCommunicatorsStreamsAndEvents) {
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
    CHECK_EQ(w.fake->Count(r, "destroy comm"), 1);
    CHECK_EQ(w.fake->Count(r, "abort"), 0);
    CHECK_EQ(w.fake->LiveObjects(r), 0) << "rank " << r;
  }
}

TEST(Nccl_TeardownAfterAHostFailureAbortsInsteadOfDestroying) {
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
  CHECK_EQ(w.fake->Count(0, "destroy comm"), 0);
  CHECK_EQ(w.fake->Count(1, "destroy comm"), 1);
  CHECK_EQ(w.fake->Count(1, "abort"), 0);
}

TEST(Nccl_StuckTeardownDoesNotHangShutdown) {
  GpuWorld w(2, 0.3);
  w.Each([&](int r) {
    std::vector<float> x = {1.0f};
    CHECK_OK(w.Run(r, InPlace(x)));
  });
  w.fake->block_destroy = true;
  const auto start = keras_ring::Clock::now();
  w.Shutdown();
  CHECK(SecondsSince(start) < 5.0);
  CHECK_EQ(w.fake->Count(0, "destroy comm"), 0);
  // The abandoned teardown finishes once the library returns.
  w.fake->block_destroy = false;
  for (int i = 0; i < 200 && w.fake->Count(0, "destroy comm") + w.fake->Count(1, "destroy comm") < 2;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK_EQ(w.fake->Count(0, "destroy comm") + w.fake->Count(1, "destroy comm"), 2);
}

TEST(Nccl_ShutdownEndsACollectiveInFlight) {
  GpuWorld w(2, 60.0);
  w.fake->hang = true;
  std::vector<std::promise<Status>> results(2);
  std::vector<std::vector<float>> data(2, std::vector<float>(4, 1.0f));
  for (int r = 0; r < 2; ++r) {
    Request req = Allreduce(Tensor(DataType::kFloat32, {4}, data[static_cast<size_t>(r)].data(),
                                   data[static_cast<size_t>(r)].data()), ReduceOp::kSum);
    kn::AttachNccl(*At(w.runtimes, r), 0, CallerStream(r), &req, At(w.apis, r));
    req.done = [&results, r](const Status& s) { At(results, r).set_value(s); };
    At(w.runtimes, r)->Submit(std::move(req));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto start = keras_ring::Clock::now();
  w.Shutdown();
  CHECK(SecondsSince(start) < 5.0);
  for (int r = 0; r < 2; ++r) {
    const Status s = At(results, r).get_future().get();
    CHECK(s.code() == Code::kAborted) << s.message();
    CHECK_CONTAINS(s.message(), "shut down while NCCL allreduce was running");
  }
}

}  // namespace
}  // namespace kr_test
