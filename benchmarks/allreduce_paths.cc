// Allreduce through the HostExecutor as the runtime runs it, without TensorFlow: n forked
// processes on this host connected like a job (shared memory, or TCP over loopback with
// "tcp"), each holding two executors on the same transport, one with the settings of before
// issue 17 ("old": full signature exchange, then the ring) and one with the defaults ("new":
// fast agreement, recursive doubling up to doubling_max_bytes, ring above). Batches of the
// two alternate, so the machine's noise falls on both alike; rank 0 prints the median time
// per allreduce of each and their ratio.
//
// Build and run (make bench does): g++ -std=c++17 -O2 -pthread -Ikeras_ring/ops/cc
//   benchmarks/allreduce_paths.cc keras_ring/ops/cc/core/*.cc keras_ring/ops/cc/core/nccl/*.cc
//   -ldl && ./a.out 2 [tcp|shm] [max_bytes] [barrier|nobarrier] [same]
// The first row times barriers (a collective that is only its agreement): the agreement's
// cost in real processes, against world size.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/host_executor.h"
#include "core/routed_transport.h"

namespace {

using namespace keras_ring;

int Listen(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(fd, 64) != 0) {
    std::perror("listen");
    std::exit(1);
  }
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

void Check(const Status& s, int rank) {
  if (!s.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, s.message().c_str());
    std::exit(1);
  }
}

void Rank(int r, int n, bool tcp, size_t max_bytes, bool barrier_row, bool same,
          const std::vector<int>& fds,
          const std::vector<PeerAddress>& peers) {
  HostTransportConfig config;
  config.rank = r;
  config.size = n;
  config.listen_fd = fds[static_cast<size_t>(r)];
  config.peers = peers;
  config.host_index.assign(static_cast<size_t>(n), 0);
  config.job_token = 0x5eed;
  config.timeout_seconds = 60;
  config.use_shm = !tcp;
  std::unique_ptr<Transport> t;
  Check(ConnectHostTransport(config, &t), r);
  AlgoConfig old_cfg, new_cfg;
  if (!same) {  // "same": an A/A run, both with the defaults, to see the bench's own bias
    old_cfg.fast_agree = false;
    old_cfg.doubling_max_bytes = 0;
  }
  HostExecutor old_ex(r, n, *t, old_cfg), new_ex(r, n, *t, new_cfg);
  uint64_t old_seq = 1, new_seq = 1;
  if (r == 0) {
    std::printf("# %d processes, %s; float32 Sum; median us per allreduce of 9 alternating "
                "batches\n%10s | %9s | %9s | %7s\n",
                n, tcp ? "tcp (loopback)" : "shm", "bytes", "old us", "new us", "new/old");
  }
  // The first size twice: its first round pays for page faults and the links' warm-up (and
  // with `barrier_row` it times barriers instead: the agreement alone).
  for (size_t bytes = 4096, round = 0; bytes <= max_bytes; bytes *= (round++ == 0 ? 1 : 2)) {
    const size_t count = bytes / 4;
    std::vector<float> in(count, 1.0f + static_cast<float>(r)), out(count);
    const bool barrier = round == 0 && barrier_row;
    auto once = [&](HostExecutor& ex, uint64_t& seq) {
      Request q;
      q.kind = barrier ? Kind::kBarrier : Kind::kAllreduce;
      q.name = "grad";
      TensorRef tr;
      tr.shape = {static_cast<int64_t>(count)};
      tr.input = in.data();
      tr.output = out.data();
      if (!barrier) q.tensors.push_back(tr);
      ExecutionStats stats;
      Check(ex.Execute(q, seq++, &stats), r);
    };
    const int iters =
        static_cast<int>(std::max<size_t>(5, std::min<size_t>(400, (8u << 20) / bytes)));
    std::vector<double> times[2];
    for (int k = 0; k < 2; ++k) once(old_ex, old_seq), once(new_ex, new_seq);
    for (int batch = 0; batch < 9; ++batch) {
      for (int k = 0; k < 2; ++k) {
        const int which = (batch + k) % 2;  // each goes first in every other batch
        HostExecutor& ex = which == 0 ? old_ex : new_ex;
        uint64_t& seq = which == 0 ? old_seq : new_seq;
        once(ex, seq);  // lines the ranks up
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) once(ex, seq);
        times[which].push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
      }
    }
    if (r == 0 && (round > 0 || barrier)) {
      for (auto& v : times) std::sort(v.begin(), v.end());
      const double o = times[0][4] * 1e6, nw = times[1][4] * 1e6;
      if (barrier) {
        std::printf("%10s | %9.1f | %9.1f | %7.2f\n", "barrier", o, nw, nw / o);
      } else {
        std::printf("%10zu | %9.1f | %9.1f | %7.2f\n", bytes, o, nw, nw / o);
      }
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2;
  const bool tcp = argc > 2 && std::string(argv[2]) == "tcp";
  const size_t max_bytes = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : (16u << 20);
  const bool barrier_row = !(argc > 4 && std::string(argv[4]) == "nobarrier");
  const bool same = argc > 5 && std::string(argv[5]) == "same";
  std::vector<int> fds(static_cast<size_t>(n));
  std::vector<PeerAddress> peers(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    int port = 0;
    fds[static_cast<size_t>(r)] = Listen(&port);
    peers[static_cast<size_t>(r)] = PeerAddress{"127.0.0.1", port};
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      Rank(r, n, tcp, max_bytes, barrier_row, same, fds, peers);
      std::fflush(stdout);
      _exit(0);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  return failed == 0 ? 0 : 1;
}
