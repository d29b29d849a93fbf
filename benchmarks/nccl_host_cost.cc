// The host-side cost of one NCCL collective: the runtime and the NCCL backend driven through
// the fake GPU of the C++ tests (keras_ring/ops/cc/tests/nccl_fake.h), whose "device" finishes
// a small allreduce `device_us` after every rank launched it (and after the one before it on
// the stream): 0 leaves only what the host spends per collective (the signature agreement,
// the launch calls, the completion); 20 is about a small NCCL allreduce within one node. Ranks
// are threads of this process over the local transport, each submitting `count` in-place
// allreduces and keeping `window` of them outstanding (1: each waits for the previous one; 64:
// as a step's gradient buckets do). Prints, for each window and `repeat` times, microseconds
// per collective: wall time / count on the slowest rank, and the process's CPU time /
// (count * ranks), i.e. per collective per rank (less noisy on a shared machine).
//
//   make build/nccl_host_cost && ./build/nccl_host_cost [ranks count bytes depth repeat device_us
//                                                        control_us]
//
// The same measurement on a GPU, through the real NCCL: benchmarks/gpu_check.sh (in flight).
// Built with -DKR_BENCH_BASELINE against an older core (one collective at a time), it measures
// the code before collectives were kept in flight.
//
// `control_us` (7th argument, default 0) makes every framed message between the ranks (the
// fast agreement's) leave that long after it was sent, a control path as slow as the GPU
// machine's (docs/performance.md: 130-300 us a round trip under gVisor). Built against the
// core before the lookahead, every collective pays it; with it, a round pays it for the
// collectives queued behind one.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>

#include "core/local_transport.h"
#include "core/nccl/backend.h"
#include "core/runtime.h"
#include "tests/nccl_fake.h"

namespace {

using keras_ring::Clock;

// A local transport whose framed messages (the fast agreement's) take `delay_us` to leave.
class SlowLocalTransport : public keras_ring::LocalTransport {
 public:
  SlowLocalTransport(std::shared_ptr<keras_ring::LocalFabric> fabric, int rank, int delay_us)
      : LocalTransport(std::move(fabric), rank), delay_us_(delay_us) {}
  keras_ring::Status SendFramed(int peer, const void* data, size_t bytes, size_t head,
                                keras_ring::Deadline deadline) override {
    if (delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
    return LocalTransport::SendFramed(peer, data, bytes, head, deadline);
  }

 private:
  const int delay_us_;
};

struct Outstanding {
  std::mutex mu;
  std::condition_variable cv;
  int completed = 0;
  int failed = 0;
};

// One rank: `count` allreduces of `bytes`, at most `window` outstanding; seconds taken.
double RunRank(keras_ring::Runtime& runtime, const std::shared_ptr<kr_test::FakeDeviceApi>& api,
               int rank, int count, size_t bytes, int window, int* failed) {
  std::vector<std::vector<float>> buffers(static_cast<size_t>(window),
                                          std::vector<float>(std::max<size_t>(bytes / 4, 1), 1.0f));
  Outstanding out;
  const auto start = Clock::now();
  for (int i = 0; i < count; ++i) {
    {
      std::unique_lock<std::mutex> lock(out.mu);
      out.cv.wait(lock, [&] { return i - out.completed < window; });
    }
    std::vector<float>& x = buffers[static_cast<size_t>(i % window)];
    keras_ring::Request r;
    r.kind = keras_ring::Kind::kAllreduce;
    // One name per collective, as a step's buckets have: one name pending twice is refused.
    r.name = "bucket." + std::to_string(i);
    r.op = keras_ring::ReduceOp::kMax;  // values stay put however often they are reduced
    keras_ring::TensorRef t;
    t.dtype = keras_ring::DataType::kFloat32;
    t.shape = {static_cast<int64_t>(x.size())};
    t.input = x.data();
    t.output = x.data();
    r.tensors.push_back(t);
    keras_ring::nccl::AttachNccl(runtime, 0, kr_test::CallerStream(rank), &r, api);
    r.done = [&out](const keras_ring::Status& s) {
      std::lock_guard<std::mutex> lock(out.mu);
      out.completed++;
      out.failed += s.ok() ? 0 : 1;
      out.cv.notify_all();
    };
    runtime.Submit(std::move(r));
  }
  std::unique_lock<std::mutex> lock(out.mu);
  out.cv.wait(lock, [&] { return out.completed == count; });
  *failed = out.failed;
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

struct Cost {
  double wall_us;  // per collective, slowest rank
  double cpu_us;   // per collective per rank
};

// On a fresh world (its first collective, which makes the communicator, is run before the
// clock starts).
Cost Measure(int ranks, int count, size_t bytes, int window, int depth, int device_us,
             int control_us) {
  auto fake = std::make_shared<kr_test::FakeNcclWorld>(ranks);
  fake->device_us = device_us;
  auto fabric = std::make_shared<keras_ring::LocalFabric>(ranks);
  std::vector<std::unique_ptr<keras_ring::Runtime>> runtimes;
  std::vector<std::shared_ptr<kr_test::FakeDeviceApi>> apis;
  for (int r = 0; r < ranks; ++r) {
    keras_ring::RuntimeOptions options;
    options.rank = r;
    options.size = ranks;
    options.timeout_seconds = 60;
    options.stall_warning_seconds = 0;
#ifndef KR_BENCH_BASELINE
    options.device_max_in_flight = depth;
#else
    (void)depth;
#endif
    runtimes.push_back(std::make_unique<keras_ring::Runtime>(
        options, std::make_unique<SlowLocalTransport>(fabric, r, control_us)));
    apis.push_back(std::make_shared<kr_test::FakeDeviceApi>(fake, r));
  }
  std::vector<double> seconds(static_cast<size_t>(ranks));
  std::vector<int> failed(static_cast<size_t>(ranks));
  double cpu = 0;
  for (int pass = 0; pass < 2; ++pass) {  // warm-up (communicator, events), then timed
    cpu = CpuSeconds();
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        const size_t i = static_cast<size_t>(r);
        seconds[i] = RunRank(*runtimes[i], apis[i], r, pass == 0 ? 1 : count, bytes, window,
                             &failed[i]);
      });
    }
    for (std::thread& t : threads) t.join();
    cpu = CpuSeconds() - cpu;
  }
  std::vector<std::thread> teardown;
  for (auto& rt : runtimes) teardown.emplace_back([&rt] { rt.reset(); });
  for (std::thread& t : teardown) t.join();
  for (int f : failed) {
    if (f != 0) {
      std::fprintf(stderr, "nccl_host_cost: %d collectives failed\n", f);
      std::exit(1);
    }
  }
  return {*std::max_element(seconds.begin(), seconds.end()) * 1e6 / count,
          cpu * 1e6 / count / ranks};
}

}  // namespace

int main(int argc, char** argv) {
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 2;
  const int count = argc > 2 ? std::atoi(argv[2]) : 2000;
  const size_t bytes = argc > 3 ? static_cast<size_t>(std::atoll(argv[3])) : 1024;
  const int depth = argc > 4 ? std::atoi(argv[4]) : 64;
  const int repeat = argc > 5 ? std::atoi(argv[5]) : 3;
  const int device_us = argc > 6 ? std::atoi(argv[6]) : 0;
  const int control_us = argc > 7 ? std::atoi(argv[7]) : 0;
#ifdef KR_BENCH_BASELINE
  const char* build = "baseline (one collective at a time)";
#else
  const char* build = "in flight";
#endif
  std::printf("# NCCL host cost through the fake GPU: %s, %d ranks, %d allreduces of %zu B, "
              "device_max_in_flight=%d, %d us on the fake GPU each, framed messages "
              "leaving %d us late\n"
              "# window  wall/cpu us per collective (each repeat)\n",
              build, ranks, count, bytes, depth, device_us, control_us);
  for (int window : {1, 64}) {
    std::printf("%8d ", window);
    for (int i = 0; i < repeat; ++i) {
      const Cost c = Measure(ranks, count, bytes, window, depth, device_us, control_us);
      std::printf("  %6.1f/%-6.1f", c.wall_us, c.cpu_us);
      std::fflush(stdout);
    }
    std::printf("\n");
  }
  return 0;
}
