// What opening a collective costs against world size: n ranks as threads over the local
// transport (one process), each running barriers (a collective that is nothing but its
// agreement) and 4 KiB allreduces through the HostExecutor, with the fast agreement
// (recursive doubling of signature digests, log2 n rounds) and with the full slot exchange
// (every rank's 4.6 KB slot to every rank). Also prints each rank's messages and bytes per
// collective, counted at the transport. Threads outnumber cores here: the times include
// scheduling, so read them as a trend against n, not as network latency.
//
// Build and run (make bench does): g++ -std=c++17 -O2 -pthread -Ikeras_ring/ops/cc
//   benchmarks/agreement.cc keras_ring/ops/cc/core/*.cc -ldl && ./a.out [max_ranks]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "core/host_executor.h"
#include "core/local_transport.h"

namespace {

using namespace keras_ring;

// Counts what this rank sends.
class Counting : public Transport {
 public:
  explicit Counting(Transport& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const char* name() const override { return "counting"; }
  Status Send(int peer, const void* data, size_t bytes, Deadline d) override {
    Note(bytes);
    return inner_.Send(peer, data, bytes, d);
  }
  Status Recv(int peer, void* data, size_t bytes, Deadline d) override {
    return inner_.Recv(peer, data, bytes, d);
  }
  Status SendRecv(int to, const void* s, size_t sb, int from, void* r, size_t rb,
                  Deadline d) override {
    Note(sb);
    return inner_.SendRecv(to, s, sb, from, r, rb, d);
  }
  size_t BufferedSendBytes() const override { return inner_.BufferedSendBytes(); }
  void AbortWith(const Status& cause) override { inner_.AbortWith(cause); }
  long messages = 0;
  long bytes = 0;

 private:
  void Note(size_t b) {
    ++messages;
    bytes += static_cast<long>(b);
  }
  Transport& inner_;
};

struct Result {
  double us;
  double messages;
  double bytes;
};

Result Run(int n, bool fast, Kind kind, int iters) {
  auto fabric = std::make_shared<LocalFabric>(n);
  std::vector<std::unique_ptr<LocalTransport>> ts;
  for (int r = 0; r < n; ++r) ts.push_back(std::make_unique<LocalTransport>(fabric, r));
  std::vector<double> seconds(static_cast<size_t>(n));
  std::vector<long> msgs(static_cast<size_t>(n)), bytes(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Counting t(*ts[static_cast<size_t>(r)]);
      AlgoConfig cfg;
      cfg.timeout_seconds = 60;
      cfg.fast_agree = fast;
      HostExecutor ex(r, n, t, cfg);
      std::vector<float> in(1024, 1.0f), out(1024);
      uint64_t seq = 1;
      auto once = [&] {
        Request q;
        q.kind = kind;
        q.name = "step";
        if (kind == Kind::kAllreduce) {
          TensorRef tr;
          tr.shape = {1024};
          tr.input = in.data();
          tr.output = out.data();
          q.tensors.push_back(tr);
        }
        ExecutionStats stats;
        Status s = ex.Execute(q, seq++, &stats);
        if (!s.ok()) {
          std::fprintf(stderr, "rank %d: %s\n", r, s.message().c_str());
          std::exit(1);
        }
      };
      for (int i = 0; i < 20; ++i) once();  // warm-up
      t.messages = t.bytes = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) once();
      seconds[static_cast<size_t>(r)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      msgs[static_cast<size_t>(r)] = t.messages;
      bytes[static_cast<size_t>(r)] = t.bytes;
    });
  }
  for (auto& th : threads) th.join();
  const double worst = *std::max_element(seconds.begin(), seconds.end());
  return Result{worst / iters * 1e6, static_cast<double>(msgs[0]) / iters,
                static_cast<double>(bytes[0]) / iters};
}

}  // namespace

int main(int argc, char** argv) {
  const int max_ranks = argc > 1 ? std::atoi(argv[1]) : 32;
  std::printf("# %u cores; ranks as threads over the local transport; per collective: the\n"
              "# slowest rank's mean time, rank 0's messages and bytes sent\n",
              std::thread::hardware_concurrency());
  std::printf("%5s | %-28s | %-28s | %-28s | %-28s\n", "", "barrier, full exchange",
              "barrier, fast agreement", "4 KiB allreduce, full", "4 KiB allreduce, fast");
  std::printf("%5s |", "ranks");
  for (int c = 0; c < 4; ++c) std::printf(" %9s %6s %10s |", "time(us)", "msgs", "bytes");
  std::printf("\n");
  for (int n : {2, 3, 4, 6, 8, 12, 16, 24, 32}) {
    if (n > max_ranks) break;
    const int iters = std::max(50, 4000 / n);
    std::printf("%5d |", n);
    for (Kind kind : {Kind::kBarrier, Kind::kAllreduce}) {
      for (bool fast : {false, true}) {
        const Result r = Run(n, fast, kind, iters);
        std::printf(" %9.1f %6.1f %10.0f |", r.us, r.messages, r.bytes);
      }
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  return 0;
}
