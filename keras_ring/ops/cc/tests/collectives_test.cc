// RingAllgatherv, ChainBroadcast and PairwiseAlltoall over the local transport, 1-8 ranks as
// threads.
#include <cstdint>
#include <string>
#include <vector>

#include "../core/algorithms.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::AlgoConfig;
using keras_ring::Status;
using keras_ring::Transport;

constexpr char kUnset = static_cast<char>(0xEE);

char PatternByte(int owner, size_t j, uint64_t salt) {
  return static_cast<char>(Mix(salt, static_cast<uint64_t>(owner), j) & 0xff);
}

AlgoConfig Config(size_t segment_bytes) {
  AlgoConfig cfg;
  cfg.timeout_seconds = 2.0;  // per wait: a bug fails fast instead of hanging
  cfg.segment_bytes = segment_bytes;
  return cfg;
}

// Block sizes per rank for layout `kind`: zero-size blocks mixed in, all empty, or equal.
std::vector<size_t> BlockSizes(int n, int kind) {
  std::vector<size_t> sizes(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    size_t s = 0;
    if (kind == 0) s = r % 3 == 1 ? 0 : static_cast<size_t>(r * 37 % 101 + 1);
    if (kind == 2) s = 13;
    if (kind == 3) s = r == n - 1 ? 250 : static_cast<size_t>(r % 2);
    At(sizes, r) = s;
  }
  return sizes;
}

// One allgatherv per (layout, segment size), all on the same transports; then checks that
// every rank holds every block and that no stray bytes are left behind.
void AllgathervSweep(int n) {
  struct Run {
    std::vector<size_t> sizes;
    size_t segment;
    std::vector<std::vector<char>> out;  // per rank
    std::vector<Status> status;
  };
  std::vector<Run> runs;
  for (int kind = 0; kind < 4; ++kind) {
    for (size_t seg : {1, 5, 64, 1 << 20}) runs.push_back(Run{BlockSizes(n, kind), seg, {}, {}});
  }
  for (size_t k = 0; k < runs.size(); ++k) {
    Run& run = runs[k];
    size_t total = 0, offset = 0;
    for (size_t s : run.sizes) total += s;
    run.out.assign(static_cast<size_t>(n), std::vector<char>(total, kUnset));
    run.status.resize(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      for (size_t j = 0; j < At(run.sizes, r); ++j) {
        At(run.out, r)[offset + j] = PatternByte(r, j, k);
      }
      offset += At(run.sizes, r);
    }
  }
  LocalWorld world(n);
  world.Run([&](int r, Transport& t) {
    for (Run& run : runs) {
      Status& s = At(run.status, r);
      s = keras_ring::RingAllgatherv(t, Config(run.segment), At(run.out, r).data(), run.sizes);
      if (!s.ok()) return;
    }
  });
  for (size_t k = 0; k < runs.size(); ++k) {
    const Run& run = runs[k];
    std::vector<char> want;
    for (int owner = 0; owner < n; ++owner) {
      for (size_t j = 0; j < At(run.sizes, owner); ++j) want.push_back(PatternByte(owner, j, k));
    }
    for (int r = 0; r < n; ++r) {
      CHECK_OK(At(run.status, r)) << "ranks=" << n << " run " << k << " rank " << r;
      CHECK(At(run.out, r) == want)
          << "ranks=" << n << " run " << k << " (segment " << run.segment << "): rank " << r
          << " holds wrong data";
    }
  }
  world.CheckDrained(__FILE__, __LINE__);
}

// Broadcasts from every root, of 0, 1 and 1000 bytes (many segments), on the same transports.
void BroadcastSweep(int n) {
  struct Run {
    int root;
    size_t bytes;
    size_t segment;
    std::vector<std::vector<char>> buf;
    std::vector<Status> status;
  };
  std::vector<Run> runs;
  for (int root = 0; root < n; ++root) {
    for (size_t bytes : {0, 1, 1000}) {
      for (size_t seg : {7, 64}) runs.push_back(Run{root, bytes, seg, {}, {}});
    }
  }
  for (size_t k = 0; k < runs.size(); ++k) {
    Run& run = runs[k];
    run.buf.assign(static_cast<size_t>(n), std::vector<char>(run.bytes, kUnset));
    run.status.resize(static_cast<size_t>(n));
    for (size_t j = 0; j < run.bytes; ++j) At(run.buf, run.root)[j] = PatternByte(run.root, j, k);
  }
  LocalWorld world(n);
  world.Run([&](int r, Transport& t) {
    for (Run& run : runs) {
      Status& s = At(run.status, r);
      s = keras_ring::ChainBroadcast(t, Config(run.segment), At(run.buf, r).data(), run.bytes,
                                     run.root);
      if (!s.ok()) return;
    }
  });
  for (size_t k = 0; k < runs.size(); ++k) {
    const Run& run = runs[k];
    std::vector<char> want(run.bytes);
    for (size_t j = 0; j < run.bytes; ++j) want[j] = PatternByte(run.root, j, k);
    for (int r = 0; r < n; ++r) {
      CHECK_OK(At(run.status, r)) << "ranks=" << n << " root " << run.root << " rank " << r;
      CHECK(At(run.buf, r) == want)
          << "ranks=" << n << " root " << run.root << " bytes " << run.bytes << " segment "
          << run.segment << ": rank " << r << " holds wrong data";
    }
  }
  world.CheckDrained(__FILE__, __LINE__);
}

}  // namespace

TEST(RingAllgatherv_1To8Ranks) {
  for (int n = 1; n <= 8; ++n) AllgathervSweep(n);
}

TEST(ChainBroadcast_EveryRoot_1To8Ranks) {
  for (int n = 1; n <= 8; ++n) BroadcastSweep(n);
}

// A broadcast, an allgatherv and an allreduce back to back keep the byte streams aligned.
TEST(Collectives_MixedSequence) {
  const int n = 4;
  LocalWorld world(n);
  std::vector<std::vector<int32_t>> data(n, std::vector<int32_t>(10));
  std::vector<std::vector<char>> gathered(n);
  std::vector<int> failures(n, 0);
  world.Run([&](int r, Transport& t) {
    const AlgoConfig cfg = Config(12);
    std::vector<int32_t>& d = At(data, r);
    for (size_t i = 0; i < d.size(); ++i) d[i] = r == 2 ? static_cast<int32_t>(i) : -1;
    At(failures, r) += !keras_ring::ChainBroadcast(t, cfg, d.data(), 40, 2).ok();
    std::vector<size_t> sizes = {3, 0, 5, 1};
    std::vector<char>& g = At(gathered, r);
    g.assign(9, 'x');
    const size_t offs[] = {0, 3, 3, 8};
    for (size_t j = 0; j < At(sizes, r); ++j) g[offs[r] + j] = static_cast<char>('a' + r);
    At(failures, r) += !keras_ring::RingAllgatherv(t, cfg, g.data(), sizes).ok();
    At(failures, r) += !keras_ring::RingAllreduce(t, cfg, keras_ring::DataType::kInt32,
                                                  keras_ring::ReduceOp::kSum, d.data(), 10, 1.0,
                                                  1.0).ok();
  });
  for (size_t r = 0; r < n; ++r) {
    CHECK_EQ(failures[r], 0) << " rank " << r;
    for (size_t i = 0; i < 10; ++i) {
      CHECK_EQ(data[r][i], static_cast<int32_t>(4 * i)) << " rank " << r;
    }
    CHECK_EQ(std::string(gathered[r].begin(), gathered[r].end()), std::string("aaacccccd"));
  }
  world.CheckDrained(__FILE__, __LINE__);
}

namespace {

// Bytes rank `from` sends to rank `to` in layout `kind`: uneven with empty blocks, all empty,
// or one large block per rank that spans many segments.
size_t AlltoallBytes(int from, int to, int n, int kind) {
  if (kind == 0) return (from + 2 * to) % 3 == 0 ? 0 : static_cast<size_t>((from * 7 + to * 3) % 23 + 1);
  if (kind == 1) return 0;
  return to == (from + 1) % n ? 1000 : static_cast<size_t>(from % 2);
}

void AlltoallSweep(int n) {
  struct Run {
    int kind;
    size_t segment;
    std::vector<std::vector<char>> out;
    std::vector<Status> status;
  };
  std::vector<Run> runs;
  for (int kind = 0; kind < 3; ++kind) {
    for (size_t seg : {1, 64, 1 << 20}) runs.push_back(Run{kind, seg, {}, {}});
  }
  auto sizes = [n](int kind, bool sending, int me) {
    std::vector<size_t> v;
    for (int p = 0; p < n; ++p) v.push_back(sending ? AlltoallBytes(me, p, n, kind) : AlltoallBytes(p, me, n, kind));
    return v;
  };
  // Block from rank `from` to rank `to`: byte j of it is PatternByte(from * n + to, j, salt).
  auto input = [&](int kind, int me, uint64_t salt) {
    std::vector<char> in;
    for (int to = 0; to < n; ++to) {
      for (size_t j = 0; j < AlltoallBytes(me, to, n, kind); ++j) in.push_back(PatternByte(me * n + to, j, salt));
    }
    return in;
  };
  LocalWorld world(n);
  for (Run& run : runs) {
    run.out.resize(static_cast<size_t>(n));
    run.status.resize(static_cast<size_t>(n));
  }
  world.Run([&](int r, Transport& t) {
    for (size_t k = 0; k < runs.size(); ++k) {
      Run& run = runs[k];
      const std::vector<size_t> recv = sizes(run.kind, false, r);
      size_t total = 0;
      for (size_t b : recv) total += b;
      At(run.out, r).assign(total, kUnset);
      const std::vector<char> in = input(run.kind, r, k);
      Status& s = At(run.status, r);
      s = keras_ring::PairwiseAlltoall(t, Config(run.segment), in.data(), sizes(run.kind, true, r),
                                       At(run.out, r).data(), recv);
      if (!s.ok()) return;
    }
  });
  for (size_t k = 0; k < runs.size(); ++k) {
    const Run& run = runs[k];
    for (int r = 0; r < n; ++r) {
      CHECK_OK(At(run.status, r)) << "ranks=" << n << " run " << k << " rank " << r;
      std::vector<char> want;
      for (int from = 0; from < n; ++from) {
        for (size_t j = 0; j < AlltoallBytes(from, r, n, run.kind); ++j) want.push_back(PatternByte(from * n + r, j, k));
      }
      CHECK(At(run.out, r) == want) << "ranks=" << n << " layout " << run.kind << " segment "
                                    << run.segment << ": rank " << r << " received wrong data";
    }
  }
  world.CheckDrained(__FILE__, __LINE__);
}

}  // namespace

TEST(PairwiseAlltoall_1To8Ranks) {
  for (int n = 1; n <= 8; ++n) AlltoallSweep(n);
}

}  // namespace kr_test
