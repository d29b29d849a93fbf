// Runtime objects for several ranks over local transports, each driven from its own thread.
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../core/runtime.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::Code;
using keras_ring::DataType;
using keras_ring::Kind;
using keras_ring::LocalFabric;
using keras_ring::LocalTransport;
using keras_ring::ReduceOp;
using keras_ring::Request;
using keras_ring::Runtime;
using keras_ring::RuntimeOptions;
using keras_ring::Status;
using keras_ring::TensorRef;

// `n` runtimes over one LocalFabric.
class RuntimeWorld {
 public:
  RuntimeWorld(int n, double timeout_seconds) {
    auto fabric = std::make_shared<LocalFabric>(n);
    for (int r = 0; r < n; ++r) {
      RuntimeOptions options;
      options.rank = r;
      options.size = n;
      options.timeout_seconds = timeout_seconds;
      options.segment_bytes = 64;  // many segments even for small tensors
      runtimes_.push_back(
          std::make_unique<Runtime>(options, std::make_unique<LocalTransport>(fabric, r)));
    }
  }
  // Runs fn(rank, runtime) on one thread per rank in `ranks` (default: all).
  void Run(const std::function<void(int, Runtime&)>& fn, std::vector<int> ranks = {}) {
    if (ranks.empty()) {
      for (size_t r = 0; r < runtimes_.size(); ++r) ranks.push_back(static_cast<int>(r));
    }
    std::vector<std::thread> threads;
    for (int r : ranks) threads.emplace_back([&fn, this, r] { fn(r, *At(runtimes_, r)); });
    for (std::thread& t : threads) t.join();
  }

 private:
  std::vector<std::unique_ptr<Runtime>> runtimes_;
};

Request Allreduce(const std::string& name, TensorRef t, ReduceOp op = ReduceOp::kSum,
                  double pre = 1.0, double post = 1.0) {
  Request req;
  req.kind = Kind::kAllreduce;
  req.name = name;
  req.op = op;
  req.prescale = pre;
  req.postscale = post;
  req.tensors.push_back(std::move(t));
  return req;
}

// Allreduces of float32 (separate output, then in place with Average and postscale) and
// int32 Max on three ranks. 2000 floats is above what a runtime may complete inline with
// the signatures; 3 ints is below.
TEST(Runtime_AllreduceOnThreeRanks) {
  const int n = 3;
  RuntimeWorld world(n, 5.0);
  world.Run([](int r, Runtime& rt) {
    std::vector<float> in(2000), out(2000, -1.0f);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(r + static_cast<int>(i % 5));
    CHECK_OK(rt.Run(Allreduce("sum", Tensor(DataType::kFloat32, {20, 100}, in.data(), out.data()))))
        << " rank " << r;
    for (size_t i = 0; i < in.size(); ++i) {
      if (out[i] != static_cast<float>(3 + 3 * (i % 5))) {
        CHECK_EQ(out[i], static_cast<float>(3 + 3 * (i % 5))) << " rank " << r << " i=" << i;
        break;
      }
    }
    CHECK_OK(rt.Run(Allreduce("avg", Tensor(DataType::kFloat32, {2000}, out.data(), out.data()),
                              ReduceOp::kAverage, 1.0, 2.0)));
    CHECK_EQ(out[7], static_cast<float>(2 * (3 + 3 * 2)));
    CHECK_EQ(out[1999], static_cast<float>(2 * (3 + 3 * 4)));
    std::vector<int32_t> ints = {r, -r, 10 * r};
    CHECK_OK(rt.Run(Allreduce("max", Tensor(DataType::kInt32, {3}, ints.data(), ints.data()),
                              ReduceOp::kMax)));
    CHECK(ints == std::vector<int32_t>({2, 0, 20})) << " rank " << r;
  });
}

// A mismatched request fails on every rank without moving data; the next one succeeds.
TEST(Runtime_MismatchFailsEverywhereThenRecovers) {
  const int n = 3;
  RuntimeWorld world(n, 5.0);
  world.Run([](int r, Runtime& rt) {
    std::vector<float> buf(12, 1.0f);
    const int64_t count = r == 1 ? 12 : 10;
    const Status bad =
        rt.Run(Allreduce("grad", Tensor(DataType::kFloat32, {count}, buf.data(), buf.data())));
    CHECK(bad.code() == Code::kFailedPrecondition) << " rank " << r << ": " << bad.message();
    CHECK_CONTAINS(bad.message(), "shape mismatch");
    CHECK_CONTAINS(bad.message(), "rank 0 has");
    CHECK_CONTAINS(bad.message(), "rank 1 has");
    CHECK(buf == std::vector<float>(12, 1.0f)) << " rank " << r << ": data moved";
    const Status good =
        rt.Run(Allreduce("grad", Tensor(DataType::kFloat32, {12}, buf.data(), buf.data())));
    CHECK_OK(good) << " rank " << r;
    CHECK(buf == std::vector<float>(12, 3.0f)) << " rank " << r;
  });
}

// Requests submitted without waiting run in submission order and all complete; sizes from
// 8 bytes to 10 KiB, small and large.
TEST(Runtime_SubmitManyRunsInOrder) {
  const int n = 4, kRequests = 20;
  RuntimeWorld world(n, 5.0);
  world.Run([](int r, Runtime& rt) {
    std::vector<std::vector<int64_t>> bufs(kRequests);
    std::mutex mu;
    std::condition_variable cv;
    std::vector<int> order;
    std::vector<Status> status(kRequests);
    for (int k = 0; k < kRequests; ++k) {
      At(bufs, k).assign(static_cast<size_t>(k * 70 + 1), r + k);
      Request req = Allreduce("t" + std::to_string(k), Tensor(DataType::kInt64, {k * 70 + 1},
                              At(bufs, k).data(), At(bufs, k).data()));
      req.done = [&, k](const Status& s) {
        std::lock_guard<std::mutex> lock(mu);
        At(status, k) = s;
        order.push_back(k);
        cv.notify_all();
      };
      rt.Submit(std::move(req));
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return order.size() == kRequests; });
    for (int k = 0; k < kRequests; ++k) {
      CHECK_EQ(At(order, k), k);
      CHECK_OK(At(status, k));
      CHECK(At(bufs, k) == std::vector<int64_t>(static_cast<size_t>(k * 70 + 1), 6 + 4 * k))
          << " rank " << r << " request " << k;
    }
  });
}

// An idle runtime runs SubmitOrRun's collective on the calling thread: done() has run there
// before SubmitOrRun returns. Behind queued requests it takes its turn instead: every rank
// then executes the same names in the same order (a reordering would fail the name check).
TEST(Runtime_SubmitOrRunRunsOnTheCallerWhenIdle) {
  const int n = 3, kQueued = 4;
  RuntimeWorld world(n, 5.0);
  world.Run([](int r, Runtime& rt) {
    int64_t v = r + 1;
    bool finished = false;
    std::thread::id ran_on;
    Request req = Allreduce("inline", Tensor(DataType::kInt64, {1}, &v, &v));
    req.done = [&](const Status& s) {
      CHECK_OK(s);
      ran_on = std::this_thread::get_id();
      finished = true;
    };
    rt.SubmitOrRun(std::move(req));
    CHECK(finished) << "rank " << r << ": done() must run before SubmitOrRun returns";
    CHECK(ran_on == std::this_thread::get_id()) << "rank " << r << " ran it elsewhere";
    CHECK_EQ(v, 6);

    std::vector<int64_t> bufs(kQueued + 1);
    std::vector<Status> status(kQueued + 1, Status(Code::kInternal, "not run"));
    std::mutex mu;
    std::condition_variable cv;
    int completed = 0;
    for (int k = 0; k <= kQueued; ++k) {
      At(bufs, k) = r + 10 * k;
      Request q = Allreduce("q" + std::to_string(k),
                            Tensor(DataType::kInt64, {1}, &At(bufs, k), &At(bufs, k)));
      q.done = [&, k](const Status& s) {
        std::lock_guard<std::mutex> lock(mu);
        At(status, k) = s;
        ++completed;
        cv.notify_all();
      };
      if (k < kQueued) {
        rt.Submit(std::move(q));
      } else {
        rt.SubmitOrRun(std::move(q));
      }
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return completed == kQueued + 1; });
    for (int k = 0; k <= kQueued; ++k) {
      CHECK_OK(At(status, k)) << "rank " << r << " request " << k;
      CHECK_EQ(At(bufs, k), 3 + 30 * k);
    }
  });
}

// A transport that holds its first data call until released, and says when it got there:
// the test then knows the collective is running (on whichever thread) and waits in it.
class GatedTransport : public keras_ring::Transport {
 public:
  explicit GatedTransport(std::unique_ptr<keras_ring::Transport> inner)
      : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* name() const override { return "gated"; }
  Status Send(int peer, const void* data, size_t bytes, keras_ring::Deadline d) override {
    Hold();
    return inner_->Send(peer, data, bytes, d);
  }
  Status Recv(int peer, void* data, size_t bytes, keras_ring::Deadline d) override {
    Hold();
    return inner_->Recv(peer, data, bytes, d);
  }
  Status SendRecv(int to, const void* send_data, size_t send_bytes, int from, void* recv_data,
                  size_t recv_bytes, keras_ring::Deadline d) override {
    Hold();
    return inner_->SendRecv(to, send_data, send_bytes, from, recv_data, recv_bytes, d);
  }
  void AbortWith(const Status& cause) override { inner_->AbortWith(cause); }

  bool WaitEntered() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(30), [this] { return entered_; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  void Hold() {
    std::unique_lock<std::mutex> lock(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return released_; });
  }
  std::unique_ptr<keras_ring::Transport> inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool released_ = false;
};

// A request queued while the caller's thread runs a collective is the worker's once that
// ends: the caller must wake it (it wakes the worker only when something waits).
TEST(Runtime_RequestQueuedDuringAnInlineCollectiveRuns) {
  // Declared before the runtimes, which may still complete a request while they are destroyed.
  std::mutex mu;
  std::condition_variable cv;
  bool y_done = false;
  Status y_status(Code::kInternal, "not run");
  auto fabric = std::make_shared<LocalFabric>(2);
  RuntimeOptions options;
  options.size = 2;
  options.timeout_seconds = 5.0;
  options.stall_warning_seconds = 0;
  options.failure_exit_seconds = 0;
  auto gated = std::make_unique<GatedTransport>(std::make_unique<LocalTransport>(fabric, 0));
  GatedTransport* gate = gated.get();
  options.rank = 0;
  Runtime rank0(options, std::move(gated));
  options.rank = 1;
  Runtime rank1(options, std::make_unique<LocalTransport>(fabric, 1));

  int64_t x0 = 1, y0 = 10, x1 = 2, y1 = 20;
  std::thread::id x_ran_on, caller_id;
  Status x_status(Code::kInternal, "not run");
  std::thread caller([&] {
    caller_id = std::this_thread::get_id();
    Request x = Allreduce("x", Tensor(DataType::kInt64, {1}, &x0, &x0));
    x.done = [&](const Status& s) {
      x_status = s;
      x_ran_on = std::this_thread::get_id();
    };
    rank0.SubmitOrRun(std::move(x));  // idle: runs here, held in the transport
  });
  std::thread peer([&] {
    CHECK_OK(rank1.Run(Allreduce("x", Tensor(DataType::kInt64, {1}, &x1, &x1))));
    CHECK_OK(rank1.Run(Allreduce("y", Tensor(DataType::kInt64, {1}, &y1, &y1))));
  });

  CHECK(gate->WaitEntered()) << "rank 0's collective never reached its transport";
  Request y = Allreduce("y", Tensor(DataType::kInt64, {1}, &y0, &y0));
  y.done = [&](const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    y_status = s;
    y_done = true;
    cv.notify_all();
  };
  rank0.Submit(std::move(y));  // queued behind the running collective
  gate->Release();
  caller.join();
  peer.join();
  {
    std::unique_lock<std::mutex> lock(mu);
    // Bounded only so that a regression fails instead of hanging: the request stays queued
    // forever if nobody wakes the worker (rank 1 gives up after its 5 s timeout).
    cv.wait_for(lock, std::chrono::seconds(30), [&] { return y_done; });
  }
  CHECK(x_ran_on == caller_id) << "x was meant to run on the caller's thread (the runtime was idle)";
  CHECK_OK(x_status);
  CHECK(y_done) << "the request queued during the inline collective never ran";
  CHECK_OK(y_status);
  CHECK_EQ(x0, 3);
  CHECK_EQ(y0, 30);
}

// Two requests of one name pending on a rank at once came from concurrent callers (a tf.data
// map with num_parallel_calls): each rank may have submitted them in another order, and a
// name alone would pair them. The later one fails on every rank, naming the rank; the first
// runs, and afterwards the name is free again. Rank 1 starts only once rank 0 has submitted
// both, so rank 0's first is certainly still pending when its second arrives.
TEST(Runtime_ANameSubmittedWhileItPendsFailsOnEveryRank) {
  std::mutex mu;
  std::condition_variable cv;
  int reported = 0;
  bool submitted = false;
  Status first(Code::kInternal, "not run"), second(Code::kInternal, "not run");
  int64_t a0 = 1, b0 = 100;
  RuntimeWorld world(2, 5.0);
  world.Run([&](int r, Runtime& rt) {
    if (r == 0) {
      Request a = Allreduce("feat", Tensor(DataType::kInt64, {1}, &a0, &a0));
      Request b = Allreduce("feat", Tensor(DataType::kInt64, {1}, &b0, &b0));
      a.done = [&](const Status& s) { std::lock_guard<std::mutex> l(mu); first = s; ++reported; cv.notify_all(); };
      b.done = [&](const Status& s) { std::lock_guard<std::mutex> l(mu); second = s; ++reported; cv.notify_all(); };
      rt.Submit(std::move(a));
      rt.Submit(std::move(b));
      std::unique_lock<std::mutex> lock(mu);
      submitted = true;
      cv.notify_all();
      cv.wait_for(lock, std::chrono::seconds(30), [&] { return reported == 2; });
    } else {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return submitted; });
      }
      int64_t a1 = 2, b1 = 200;
      CHECK_OK(rt.Run(Allreduce("feat", Tensor(DataType::kInt64, {1}, &a1, &a1))));
      CHECK_EQ(a1, 3);
      const Status bad = rt.Run(Allreduce("feat", Tensor(DataType::kInt64, {1}, &b1, &b1)));
      CHECK(bad.code() == Code::kFailedPrecondition) << bad.message();
      CHECK_CONTAINS(bad.message(), "rank 0 submitted it while another collective of that "
                                    "name was still pending there");
      CHECK_EQ(b1, 200);
    }
    // The name is free again once its requests are done: no rank marks this one.
    int64_t c = r + 1;
    CHECK_OK(rt.Run(Allreduce("feat", Tensor(DataType::kInt64, {1}, &c, &c)))) << " rank " << r;
    CHECK_EQ(c, 3);
  });
  CHECK_EQ(reported, 2);
  CHECK_OK(first);
  CHECK_EQ(a0, 3);
  CHECK(second.code() == Code::kFailedPrecondition) << second.message();
  CHECK_CONTAINS(second.message(), "allreduce 'feat': rank 0 submitted it while");
  CHECK_EQ(b0, 100);
}

// Broadcast, allgather with different row counts, grouped allreduce with two dtypes, barrier.
TEST(Runtime_OtherCollectives) {
  const int n = 3;
  RuntimeWorld world(n, 5.0);
  world.Run([](int r, Runtime& rt) {
    for (int64_t size : {100, 1000}) {  // 800 bytes and 8000 bytes
      std::vector<double> b(static_cast<size_t>(size), r == 1 ? 2.5 : 0.0);
      Request bc;
      bc.kind = Kind::kBroadcast;
      bc.root = 1;
      bc.tensors.push_back(Tensor(DataType::kFloat64, {size}, b.data(), b.data()));
      CHECK_OK(rt.Run(std::move(bc))) << " rank " << r;
      CHECK(b == std::vector<double>(static_cast<size_t>(size), 2.5)) << " rank " << r;
    }

    std::vector<int8_t> rows(static_cast<size_t>(2 * r), static_cast<int8_t>(r)), gathered;
    Request ag;
    ag.kind = Kind::kAllgather;
    ag.tensors.push_back(Tensor(DataType::kInt8, {r, 2}, rows.data(), nullptr));
    ag.allocate_output = [&gathered](int64_t total_rows, void** out) {
      gathered.assign(static_cast<size_t>(total_rows * 2), -1);
      *out = gathered.data();
      return Status::OK();
    };
    CHECK_OK(rt.Run(std::move(ag))) << " rank " << r;
    CHECK(gathered == std::vector<int8_t>({1, 1, 2, 2, 2, 2})) << " rank " << r;

    for (int64_t rows : {7, 150}) {  // 280 bytes or 6000 bytes of float32 in the group
      std::vector<float> f1(4, 1.0f), f2(static_cast<size_t>(rows * 10), 2.0f);
      std::vector<int32_t> i1(5, r);
      Request gr;
      gr.kind = Kind::kGroupedAllreduce;
      gr.tensors = {Tensor(DataType::kFloat32, {4}, f1.data(), f1.data()),
                    Tensor(DataType::kInt32, {5}, i1.data(), i1.data()),
                    Tensor(DataType::kFloat32, {rows, 10}, f2.data(), f2.data())};
      CHECK_OK(rt.Run(std::move(gr))) << " rank " << r;
      CHECK(f1 == std::vector<float>(4, 3.0f) && f2 == std::vector<float>(f2.size(), 6.0f)) << r;
      CHECK(i1 == std::vector<int32_t>(5, 3)) << " rank " << r;
    }

    Request barrier;
    barrier.kind = Kind::kBarrier;
    CHECK_OK(rt.Run(std::move(barrier))) << " rank " << r;
  });
}

// Integer Average with prescale (saturating) and postscale gives the same result whether
// the tensor is small (3 bytes) or large (6000 bytes).
TEST(Runtime_IntegerAverageWithScaling) {
  RuntimeWorld world(3, 5.0);
  world.Run([](int r, Runtime& rt) {
    for (size_t size : {3, 6000}) {
      std::vector<int8_t> in(size), out(size, 0);
      const int8_t pattern[] = {static_cast<int8_t>(50 * r), static_cast<int8_t>(-50 * r), 1};
      for (size_t i = 0; i < size; ++i) in[i] = pattern[i % 3];
      const TensorRef t =
          Tensor(DataType::kInt8, {static_cast<int64_t>(size)}, in.data(), out.data());
      CHECK_OK(rt.Run(Allreduce("i8", t, ReduceOp::kAverage, 2.0, 3.0)));
      // prescale 2 saturates rank 2's 100 / -100; the sums 227 / -228 / 6 wrap to -29 / 28 / 6;
      // times 3 / 3, truncated once: -29 / 28 / 6 (not -27 / 27 / 6, which truncated twice).
      const int8_t want[] = {-29, 28, 6};
      for (size_t i = 0; i < size; ++i) {
        if (out[i] != want[i % 3]) {
          CHECK_EQ(out[i], want[i % 3]) << " rank " << r << " size " << size << " i=" << i;
          break;
        }
      }
    }
  });
}

// A rank that never submits: the others fail with a fatal error within the timeout, and
// every later request fails at once, naming the earlier failure.
TEST(Runtime_MissingRankFailsAndStaysBroken) {
  RuntimeWorld world(3, 0.3);
  world.Run([](int r, Runtime& rt) {
    std::vector<float> buf(10, 1.0f);
    const auto start = keras_ring::Clock::now();
    const TensorRef t = Tensor(DataType::kFloat32, {10}, buf.data(), buf.data());
    const Status s = rt.Run(Allreduce("lonely", t));
    CHECK(!s.ok() && s.fatal()) << " rank " << r << ": " << static_cast<int>(s.code()) << " "
                                << s.message();
    CHECK_CONTAINS(s.message(), "lonely");
    CHECK(SecondsSince(start) < 30.0) << " rank " << r;  // bounded by the 0.3 s timeout
    const Status later = rt.Run(Allreduce("next", t));
    CHECK(later.code() == s.code()) << " rank " << r;
    CHECK_CONTAINS(later.message(), "earlier collective failed");
  }, {0, 1});
}

// A local transport that shows each call's bytes sent and deadline to Seen() first.
class WatchedTransport : public keras_ring::LocalTransport {
 public:
  using LocalTransport::LocalTransport;
  Status Send(int peer, const void* data, size_t bytes, keras_ring::Deadline d) override {
    Seen(bytes, d);
    return LocalTransport::Send(peer, data, bytes, d);
  }
  Status Recv(int peer, void* data, size_t bytes, keras_ring::Deadline d) override {
    Seen(0, d);
    return LocalTransport::Recv(peer, data, bytes, d);
  }
  Status SendRecv(int to, const void* send_data, size_t send_bytes, int from, void* recv_data,
                  size_t recv_bytes, keras_ring::Deadline d) override {
    Seen(send_bytes, d);
    return LocalTransport::SendRecv(to, send_data, send_bytes, from, recv_data, recv_bytes, d);
  }

 protected:
  virtual void Seen(size_t sent_bytes, keras_ring::Deadline d) = 0;
};

// Counts the waits that may yield the core (Deadline::may_yield) and those that may not.
class YieldCountingTransport : public WatchedTransport {
 public:
  using WatchedTransport::WatchedTransport;
  // (yielding, not yielding) since the last call.
  std::pair<int, int> Take() { return {yielding_.exchange(0), sleeping_.exchange(0)}; }

 private:
  void Seen(size_t, keras_ring::Deadline d) override { ++(d.may_yield() ? yielding_ : sleeping_); }
  std::atomic<int> yielding_{0};
  std::atomic<int> sleeping_{0};
};

// A graph's collective (may_yield false) that starts within chain_gap_seconds of this rank's
// previous one is part of a chain: its waits may yield. One that starts later keeps sleeping
// waits; an eager one (may_yield true) yields whatever the gap. The gap is set to "always"
// and "never" so that no thread's timing decides the outcome.
TEST(Runtime_ACollectiveRightAfterAnotherMayYieldItsWaits) {
  for (const double gap : {3600.0, 0.0}) {
    auto fabric = std::make_shared<LocalFabric>(2);
    RuntimeOptions options;
    options.size = 2;
    options.timeout_seconds = 5.0;
    options.chain_gap_seconds = gap;
    auto counting = std::make_unique<YieldCountingTransport>(fabric, 0);
    YieldCountingTransport* waits = counting.get();
    options.rank = 0;
    Runtime rank0(options, std::move(counting));
    options.rank = 1;
    Runtime rank1(options, std::make_unique<LocalTransport>(fabric, 1));
    std::thread peer([&] {
      for (const char* name : {"first", "second", "eager"}) {
        int64_t x = 1;
        CHECK_OK(rank1.Run(Allreduce(name, Tensor(DataType::kInt64, {1}, &x, &x))));
      }
    });
    std::vector<std::pair<int, int>> counts;
    for (const char* name : {"first", "second", "eager"}) {
      int64_t x = 2;
      Request req = Allreduce(name, Tensor(DataType::kInt64, {1}, &x, &x));
      req.may_yield = std::string(name) == "eager";
      CHECK_OK(rank0.Run(std::move(req)));
      CHECK_EQ(x, 3);
      counts.push_back(waits->Take());
    }
    peer.join();
    CHECK_EQ(At(counts, 0).first, 0) << "the first collective follows none (gap " << gap << ")";
    CHECK(At(counts, 0).second > 0);
    if (gap > 0) {
      CHECK(At(counts, 1).first > 0) << "the second collective follows the first closely";
      CHECK_EQ(At(counts, 1).second, 0);
    } else {
      CHECK_EQ(At(counts, 1).first, 0) << "a gap of 0 makes no chain";
      CHECK(At(counts, 1).second > 0);
    }
    CHECK(At(counts, 2).first > 0) << "an eager collective yields whatever the gap";
    CHECK_EQ(At(counts, 2).second, 0);
  }
}

// Holds every send of `min_bytes` or more (data, not signatures) until Release().
class HeldDataTransport : public WatchedTransport {
 public:
  HeldDataTransport(std::shared_ptr<LocalFabric> fabric, int rank, size_t min_bytes)
      : WatchedTransport(std::move(fabric), rank), min_bytes_(min_bytes) {}
  bool holding() const { return holding_; }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  void Seen(size_t bytes, keras_ring::Deadline) override {
    if (bytes < min_bytes_) return;
    holding_ = true;
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return released_; });
  }
  const size_t min_bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
  std::atomic<bool> holding_{false};
};

// Past the agreement, a transfer that has not finished may be a slow link still delivering:
// the warning said "not progressing" and "fails after" the timeout (it fails only after a
// silence that long), and named the one neighbour of 2 ranks twice ("ranks 1 and 1").
TEST(Runtime_AStallReportInTheTransferNamesTheNeighbourOnceAndPromisesNoFailure) {
  auto fabric = std::make_shared<LocalFabric>(2);
  RuntimeOptions options;
  options.size = 2;
  options.timeout_seconds = 30.0;
  options.stall_warning_seconds = 0;  // the test asks for the report itself
  options.rank = 0;
  Runtime rank0(options, std::make_unique<LocalTransport>(fabric, 0));
  auto held = std::make_unique<HeldDataTransport>(fabric, 1, 4096);
  HeldDataTransport* gate = held.get();
  options.rank = 1;
  Runtime rank1(options, std::move(held));
  std::vector<float> a(1 << 18, 1.0f), b(1 << 18, 2.0f);  // 1 MiB: the ring, nothing rides
  Status s0, s1;
  std::thread t0([&] {
    s0 = rank0.Run(Allreduce("held", Tensor(DataType::kFloat32, {1 << 18}, a.data(), a.data())));
  });
  std::thread t1([&] {
    s1 = rank1.Run(Allreduce("held", Tensor(DataType::kFloat32, {1 << 18}, b.data(), b.data())));
  });
  std::string report;
  const auto start = keras_ring::Clock::now();
  // Rank 1 holds its data back, so it is past the agreement; rank 0 is once its report,
  // naming the collective, no longer names ranks not yet heard from.
  while (!(gate->holding() && (report = rank0.StallReport(5.0)).find("'held': every rank") !=
                                  std::string::npos) &&
         SecondsSince(start) < 20.0) {
    std::this_thread::yield();
  }
  gate->Release();
  t0.join();
  t1.join();
  CHECK_CONTAINS(report, "has waited 5 s in allreduce 'held': every rank submitted it, and the "
                         "data transfer with rank 1 has not finished");
  CHECK(report.find("ranks 1 and 1") == std::string::npos) << report;
  CHECK_CONTAINS(report, "fails only once a peer it waits on has been silent for "
                         "KERAS_RING_TIMEOUT_SECONDS=30 s");
  CHECK(s0.ok() && s1.ok()) << s0.message() << " / " << s1.message();
  CHECK_EQ(a[12345], 3.0f);
}

}  // namespace
}  // namespace kr_test
