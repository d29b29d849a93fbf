// join(): ranks that ran out of data add zeros to the others' allreduces until all joined.
// Runtimes over local transports, one thread per rank.
#include <memory>
#include <string>
#include <thread>
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

std::vector<std::unique_ptr<Runtime>> MakeRuntimes(int n) {
  auto fabric = std::make_shared<LocalFabric>(n);
  std::vector<std::unique_ptr<Runtime>> out;
  for (int r = 0; r < n; ++r) {
    RuntimeOptions options;
    options.rank = r;
    options.size = n;
    options.timeout_seconds = 10.0;
    options.segment_bytes = 256;  // the large tensors take many ring steps
    out.push_back(std::make_unique<Runtime>(options, std::make_unique<LocalTransport>(fabric, r)));
  }
  return out;
}

Request Join(int32_t* last) {
  Request req;
  req.kind = Kind::kJoin;
  req.name = "join";
  req.last_joined = last;
  return req;
}

TensorRef Floats(std::vector<float>& in, std::vector<float>& out) {
  TensorRef t;
  t.dtype = DataType::kFloat32;
  t.shape = {static_cast<int64_t>(in.size())};
  t.input = in.data();
  t.output = out.data();
  return t;
}

// Ranks 0 and 1 of 4 run a small (inline) allreduce, a large (ring) Average and a grouped
// float + int64 Sum while ranks 2 and 3 have joined; then 1 and finally 0 join.
TEST(Join_JoinedRanksAddZerosUntilEveryoneJoined) {
  const int n = 4;
  auto runtimes = MakeRuntimes(n);
  std::vector<std::vector<float>> small(n), large(n), out_small(n), out_large(n);
  std::vector<std::vector<int64_t>> ints(n), out_ints(n);
  std::vector<int32_t> last(n, -7);
  std::vector<Status> status(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Runtime& rt = *runtimes[static_cast<size_t>(r)];
      if (r < 2) {
        At(small, r) = {1.0f + r, 2.0f};
        At(large, r).assign(5000, 0.5f * (r + 1));
        At(ints, r) = {10 + r, -r};
        At(out_small, r).resize(2);
        At(out_large, r).resize(5000);
        At(out_ints, r).resize(2);
        Request a;
        a.kind = Kind::kAllreduce;
        a.name = "small";
        a.tensors.push_back(Floats(At(small, r), At(out_small, r)));
        At(status, r) = rt.Run(std::move(a));
        Request b;
        b.kind = Kind::kGroupedAllreduce;
        b.name = "grouped";
        b.op = ReduceOp::kAverage;
        b.tensors.push_back(Floats(At(large, r), At(out_large, r)));
        TensorRef t;
        t.dtype = DataType::kInt64;
        t.shape = {2};
        t.input = At(ints, r).data();
        t.output = At(out_ints, r).data();
        b.tensors.push_back(t);
        if (At(status, r).ok()) At(status, r) = rt.Run(std::move(b));
      }
      if (At(status, r).ok()) At(status, r) = rt.Run(Join(&At(last, r)));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) CHECK_OK(At(status, r)) << "rank " << r;
  for (int r = 0; r < 2; ++r) {
    CHECK(At(out_small, r) == std::vector<float>({3.0f, 4.0f})) << "rank " << r;
    // Average over all 4 ranks, the joined ones adding zeros: (0.5 + 1.0) / 4.
    CHECK(At(out_large, r) == std::vector<float>(5000, 0.375f)) << "rank " << r;
    CHECK(At(out_ints, r) == std::vector<int64_t>({5, 0})) << "rank " << r;  // (21, -1) / 4
  }
  // Ranks 0 and 1 joined at the same collective, after 2 and 3: the highest of them.
  for (int r = 0; r < n; ++r) CHECK(At(last, r) == 1) << "rank " << r << " says " << At(last, r);
}

// What a joined rank cannot take part in fails on every rank (the joined one's join too),
// naming the joined ranks; the runtime goes on and a later join completes.
TEST(Join_OnlySumAndAverageAllreducesRunWhileRanksHaveJoined) {
  const int n = 3;
  auto runtimes = MakeRuntimes(n);
  std::vector<Status> first(n), second(n);
  std::vector<int32_t> last(n, -7);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Runtime& rt = *runtimes[static_cast<size_t>(r)];
      if (r == 2) {
        At(first, r) = rt.Run(Join(&At(last, r)));
        At(second, r) = rt.Run(Join(&At(last, r)));
        return;
      }
      std::vector<float> in = {1.0f}, out(1);
      Request max;
      max.kind = Kind::kAllreduce;
      max.name = "max";
      max.op = ReduceOp::kMax;
      max.tensors.push_back(Floats(in, out));
      At(first, r) = rt.Run(std::move(max));
      At(second, r) = rt.Run(Join(&At(last, r)));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    CHECK(At(first, r).code() == Code::kInvalidArgument) << "rank " << r << ": "
                                                         << At(first, r).message();
    CHECK(At(first, r).message().find("rank(s) 2 have called keras_ring.join()") !=
          std::string::npos) << At(first, r).message();
    CHECK(At(first, r).message().find("only Sum and Average") != std::string::npos);
    CHECK_OK(At(second, r)) << "rank " << r;
    // The failed join ended rank 2's; all three joined again at the same collective: the
    // highest rank counts as the last.
    CHECK(At(last, r) == 2) << "rank " << r;
  }
}

// A collective refused after the joined rank served others: every rank counted it, so the
// next collective, the same on both, runs (it failed for ever with a sequence mismatch).
TEST(Join_AfterARefusalServedCollectivesLeaveTheRanksInStep) {
  const int n = 2;
  auto runtimes = MakeRuntimes(n);
  std::vector<Status> refused(n), after(n);
  std::vector<float> sums(n, 0.0f);
  std::vector<std::thread> threads;
  auto allreduce = [](Runtime& rt, ReduceOp op, std::vector<float>& in, std::vector<float>& out) {
    Request req;
    req.kind = Kind::kAllreduce;
    req.name = "x";
    req.op = op;
    req.tensors.push_back(Floats(in, out));
    return rt.Run(std::move(req));
  };
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Runtime& rt = *runtimes[static_cast<size_t>(r)];
      std::vector<float> in = {static_cast<float>(r + 1)}, out(1);
      if (r == 1) {
        int32_t last = -1;
        At(refused, r) = rt.Run(Join(&last));
      } else {
        CHECK_OK(allreduce(rt, ReduceOp::kSum, in, out));  // served: 1 + 0
        CHECK(out[0] == 1.0f) << out[0];
        At(refused, r) = allreduce(rt, ReduceOp::kMax, in, out);
      }
      At(after, r) = allreduce(rt, ReduceOp::kSum, in, out);
      At(sums, r) = out[0];
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    CHECK(At(refused, r).code() == Code::kInvalidArgument) << At(refused, r).message();
    CHECK_OK(At(after, r)) << "rank " << r;
    CHECK(At(sums, r) == 3.0f) << "rank " << r << ": " << At(sums, r);
  }
}

}  // namespace
}  // namespace kr_test
