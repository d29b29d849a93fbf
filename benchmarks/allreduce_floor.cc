// The memory-bound floor of a 2-rank allreduce on this machine: two processes, each summing
// its half straight from both inputs (as if every buffer were shared, no ring, no copies)
// with streaming stores, then copying the peer's finished half. Each rank moves the least
// data any allreduce can: reads 1.5x and writes 1x the buffer, so this time bounds every
// allreduce on this machine from below; the allreduce table is read against it.
//
// Build and run (make bench does): g++ -std=c++17 -O3 -Ikeras_ring/ops/cc
//   benchmarks/allreduce_floor.cc keras_ring/ops/cc/core/{copy,reduce,common}.cc && ./a.out
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/copy.h"
#include "core/reduce.h"

namespace {

using keras_ring::DataType;
using keras_ring::ReduceOp;

struct Shared {
  std::atomic<int> arrived[2];
  double best[2];
};

void* SharedMap(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  return p;
}

void Rank(int r, size_t bytes, Shared* sh, char* in[2], char* out[2]) {
  const int peer = 1 - r;
  const size_t half = bytes / 2;
  int phase = 0;
  auto sync = [&] {
    ++phase;
    sh->arrived[r].store(phase);
    while (sh->arrived[peer].load() < phase) {
    }
  };
  for (size_t i = 0; i < bytes / 4; ++i) reinterpret_cast<float*>(in[r])[i] = 1.0f + r;
  std::memset(out[r], 0, bytes);
  alignas(64) static char block[8192];
  double best = 1e9;
  for (int it = 0; it < 10; ++it) {
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    const size_t mine = static_cast<size_t>(r) * half;
    for (size_t off = 0; off < half; off += sizeof block) {
      const size_t len = std::min(sizeof block, half - off);
      keras_ring::Reduce(DataType::kFloat32, ReduceOp::kSum, block, in[r] + mine + off,
                         in[peer] + mine + off, len / 4);
      keras_ring::StreamCopyUnfenced(out[r] + mine + off, block, len);
    }
    keras_ring::StreamFence();
    sync();
    const size_t theirs = static_cast<size_t>(peer) * half;
    keras_ring::StreamCopy(out[r] + theirs, out[peer] + theirs, half);
    sync();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const float* o = reinterpret_cast<const float*>(out[r]);
  if (o[0] != 3.0f || o[bytes / 4 - 1] != 3.0f) std::fprintf(stderr, "wrong result on rank %d\n", r);
  sh->best[r] = best;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 64) << 20;
  auto* sh = new (SharedMap(sizeof(Shared))) Shared();
  char* in[2] = {static_cast<char*>(SharedMap(bytes)), static_cast<char*>(SharedMap(bytes))};
  char* out[2] = {static_cast<char*>(SharedMap(bytes)), static_cast<char*>(SharedMap(bytes))};
  for (int r = 0; r < 2; ++r) {
    if (fork() == 0) {
      Rank(r, bytes, sh, in, out);
      _exit(0);
    }
  }
  while (wait(nullptr) > 0) {
  }
  const double t = std::max(sh->best[0], sh->best[1]);
  std::printf("# memory-bound floor, 2 ranks, %zu MiB float32: %.1f us, busbw %.2f GB/s "
              "(both inputs read in place, streaming stores: the least memory traffic of any allreduce)\n",
              bytes >> 20, t * 1e6, static_cast<double>(bytes) / t / 1e9);
  return 0;
}
