// The shared-memory transport with ranks as threads of this process (the regions, rings,
// doorbells and futexes are the real ones): ring algorithms over tiny channels so every
// message wraps around, odd message sizes before element-typed reductions, and no region
// left in /dev/shm.
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../core/algorithms.h"
#include "../core/reduce.h"
#include "../core/shm_transport.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using namespace keras_ring;  // NOLINT: test-local

int CountRegionsOfThisProcess() {
  const std::string suffix = "." + std::to_string(getpid());
  int count = 0;
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      const std::string name = e->d_name;
      if (name.rfind("keras_ring.", 0) == 0 && name.size() > suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
        ++count;
      }
    }
    closedir(dir);
  }
  return count;
}

// n ranks, each with a ShmTransport to all others, set up over a LocalWorld control plane.
std::vector<std::unique_ptr<ShmTransport>> MakeShmWorld(LocalWorld& control, size_t channel,
                                                        uint64_t token) {
  const int n = control.size();
  std::vector<std::unique_ptr<ShmTransport>> shm(static_cast<size_t>(n));
  control.Run([&](int rank, Transport& t) {
    std::vector<int> local;
    for (int r = 0; r < n; ++r) {
      if (r != rank) local.push_back(r);
    }
    ShmOptions options;
    options.job_token = token;
    options.channel_bytes = channel;
    options.spin_iterations = 50;
    Status s = ShmTransport::Create(t, local, std::vector<int>(static_cast<size_t>(n), -1),
                                    options, 5.0, &At(shm, rank));
    CHECK(s.ok()) << s.message();
  });
  return shm;
}

TEST(Shm_AllreduceThroughTinyRingsMatchesExpected) {
  for (int n : {2, 3, 4}) {
    LocalWorld control(n);
    auto shm = MakeShmWorld(control, 4096, Mix(n, 1));
    CHECK(CountRegionsOfThisProcess() == 0) << "regions must be unlinked once mapped";
    for (size_t count : {size_t{1}, size_t{13}, size_t{1000}, size_t{70001}}) {
      for (DataType dtype : {DataType::kFloat64, DataType::kFloat16, DataType::kInt8}) {
        std::vector<std::vector<char>> out(static_cast<size_t>(n));
        control.Run([&](int rank, Transport&) {
          std::vector<char> in(count * DataTypeSize(dtype));
          for (size_t i = 0; i < count; ++i) SetFromDouble(dtype, in.data(), i, (rank + i) % 7);
          At(out, rank).resize(in.size());
          AlgoConfig cfg;
          cfg.timeout_seconds = 5;
          cfg.segment_bytes = 1000;  // not a multiple of the ring or the cache line
          cfg.stream_bytes = count >= 1000 ? 0 : cfg.stream_bytes;  // streaming stores too
          Status s = RingAllreduce(*At(shm, rank), cfg, dtype, ReduceOp::kSum, in.data(),
                                   At(out, rank).data(), count, 1.0, 1.0);
          CHECK(s.ok()) << s.message();
        });
        for (size_t i = 0; i < count; i += 97) {
          double want = 0;
          for (int r = 0; r < n; ++r) want += (r + i) % 7;
          if (dtype == DataType::kInt8) want = static_cast<int8_t>(static_cast<int>(want));
          CHECK(GetAsDouble(dtype, At(out, 0).data(), i) == want) << "n=" << n << " i=" << i;
        }
        for (int r = 1; r < n; ++r) CHECK(At(out, r) == At(out, 0)) << "rank " << r << " differs";
      }
    }
  }
}

TEST(Shm_OddSizedMessagesThenTypedReduction) {
  // Allgather blocks of 3, 5 and 7 bytes leave the ring positions unaligned; the next
  // float64 reduction must still see whole elements.
  LocalWorld control(3);
  auto shm = MakeShmWorld(control, 4096, Mix(3, 2));
  control.Run([&](int rank, Transport&) {
    AlgoConfig cfg;
    cfg.timeout_seconds = 5;
    cfg.segment_bytes = 5;
    for (int round = 0; round < 50; ++round) {
      std::vector<size_t> blocks = {3, 5, 7};
      std::vector<char> gathered(15, 0);
      size_t off = rank == 0 ? 0 : rank == 1 ? 3 : 8;
      std::memset(gathered.data() + off, 'a' + rank, blocks[static_cast<size_t>(rank)]);
      CHECK(RingAllgatherv(*At(shm, rank), cfg, gathered.data(), blocks).ok());
      CHECK(std::string(gathered.begin(), gathered.end()) == "aaabbbbbccccccc");
      std::vector<double> x(517, rank + 0.5);
      AlgoConfig big = cfg;
      big.segment_bytes = 1 << 12;
      CHECK(RingAllreduce(*At(shm, rank), big, DataType::kFloat64, ReduceOp::kSum, x.data(),
                          x.size(), 1.0, 1.0)
                .ok());
      CHECK(x[0] == 4.5 && x[516] == 4.5) << x[0] << " " << x[516];
    }
  });
}

// Both ends of a link may cut one message into different pieces: rank 0 sends and rank 1
// receives through cuts that never line up (empty pieces included), over the local
// transport (gather/scatter default) and shm (in place, through a ring smaller than the
// message). Plain copies, and int32 sums whose cuts fall on element boundaries.
TEST(Shm_PiecesMayBeCutDifferentlyOnEachEnd) {
  LocalWorld control(2);
  auto shm = MakeShmWorld(control, 4096, Mix(2, 7));
  const std::vector<size_t> cuts[2] = {{4, 4996, 0, 5000}, {3000, 0, 7000}};
  const ReduceFn add = [](void* dst, const void* local, const void* peer, size_t bytes) {
    keras_ring::Reduce(DataType::kInt32, ReduceOp::kSum, dst, local, peer, bytes / 4);
  };
  for (bool use_shm : {false, true}) {
    for (bool reduce : {false, true}) {
      control.Run([&](int rank, Transport& local_t) {
        Transport& t = use_shm ? static_cast<Transport&>(*At(shm, rank)) : local_t;
        const int peer = 1 - rank;
        std::vector<int32_t> src(2500), local(2500), dst(2500, -1);
        for (size_t i = 0; i < src.size(); ++i) {
          src[i] = static_cast<int32_t>(1000 * rank + i);
          local[i] = static_cast<int32_t>(i % 7);
        }
        // Rank r sends with cuts[r] and receives with cuts[1 - r].
        std::vector<SendPiece> send;
        std::vector<RecvPiece> recv;
        size_t off = 0;
        for (size_t len : cuts[rank]) {
          send.push_back(SendPiece{reinterpret_cast<char*>(src.data()) + off, len});
          off += len;
        }
        off = 0;
        for (size_t len : cuts[peer]) {
          recv.push_back(RecvPiece{reinterpret_cast<char*>(dst.data()) + off,
                                   reinterpret_cast<char*>(local.data()) + off, len});
          off += len;
        }
        Status s = t.SendRecvPieces(peer, send, peer, recv, 4, reduce ? &add : nullptr,
                                    Deadline::After(5.0));
        CHECK_OK(s);
        for (size_t i = 0; i < dst.size(); ++i) {
          const int32_t want = static_cast<int32_t>(1000 * peer + i) + (reduce ? local[i] : 0);
          CHECK_EQ(dst[i], want) << t.name() << " reduce=" << reduce << " i=" << i;
        }
      });
    }
  }
}

// A fused allreduce over tensors where they lie gives bit for bit what one allreduce of the
// concatenated tensors gives, whatever the parts' sizes (empty ones too), in place or not,
// over local and shm transports.
TEST(Shm_PartsAllreduceMatchesOneBuffer) {
  const std::vector<size_t> sizes = {0, 3, 1, 0, 100, 17, 0, 1000, 5};
  size_t total = 0;
  for (size_t c : sizes) total += c;
  for (int n : {2, 3, 4}) {
    LocalWorld control(n);
    auto shm = MakeShmWorld(control, 4096, Mix(n, 8));
    for (DataType dtype : {DataType::kFloat32, DataType::kFloat16, DataType::kInt64}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
        for (bool use_shm : {false, true}) {
          control.Run([&](int rank, Transport& local_t) {
            Transport& t = use_shm ? static_cast<Transport&>(*At(shm, rank)) : local_t;
            const size_t es = DataTypeSize(dtype);
            std::vector<char> whole(total * es);
            for (size_t i = 0; i < total; ++i) {
              SetFromDouble(dtype, whole.data(), i, static_cast<double>((rank * 31 + i) % 13));
            }
            AlgoConfig cfg;
            cfg.timeout_seconds = 5;
            cfg.segment_bytes = 96;  // segments span several parts and cut inside others
            std::vector<char> in = whole, out(total * es, 0);
            std::vector<keras_ring::Part> parts;
            size_t at = 0;
            for (size_t k = 0; k < sizes.size(); ++k) {
              // Odd parts in place, even parts out of place.
              char* o = (k % 2 == 1 ? in.data() : out.data()) + at * es;
              parts.push_back(keras_ring::Part{in.data() + at * es, o, sizes[k]});
              at += sizes[k];
            }
            CHECK_OK(RingAllreduce(t, cfg, dtype, op, parts, 0.5, 3.0));
            CHECK_OK(RingAllreduce(t, cfg, dtype, op, whole.data(), total, 0.5, 3.0));
            at = 0;
            for (size_t k = 0; k < sizes.size(); ++k) {
              const char* got = static_cast<const char*>(parts[k].output);
              CHECK(std::memcmp(got, whole.data() + at * es, sizes[k] * es) == 0)
                  << t.name() << " n=" << n << " " << keras_ring::DataTypeName(dtype)
                  << " part " << k;
              at += sizes[k];
            }
          });
        }
      }
    }
  }
}

// The one-round allgather (used for the signature exchange where links buffer a slot): every
// rank gets every block, over local queues and over shm rings that hold a block but not two,
// round after round; it refuses a block the links cannot buffer instead of risking a hang.
TEST(Shm_DirectAllgatherDeliversEveryBlock) {
  for (int n : {2, 3, 4}) {
    LocalWorld control(n);
    auto shm = MakeShmWorld(control, 4096, Mix(n, 9));
    for (bool use_shm : {false, true}) {
      control.Run([&](int rank, Transport& local_t) {
        Transport& t = use_shm ? static_cast<Transport&>(*At(shm, rank)) : local_t;
        AlgoConfig cfg;
        cfg.timeout_seconds = 5;
        const size_t block = 3000;
        for (int round = 0; round < 20; ++round) {
          std::vector<char> all(block * static_cast<size_t>(n), 0);
          std::memset(all.data() + block * static_cast<size_t>(rank), 'a' + rank + round, block);
          std::atomic<int> steps{0};
          CHECK_OK(keras_ring::DirectAllgather(t, cfg, all.data(), block, &steps));
          CHECK_EQ(steps.load(), n - 1);
          for (int r = 0; r < n; ++r) {
            CHECK(all[block * static_cast<size_t>(r)] == 'a' + r + round &&
                  all[block * static_cast<size_t>(r + 1) - 1] == 'a' + r + round)
                << t.name() << " n=" << n << " rank " << rank << " block " << r;
          }
        }
        if (use_shm) {
          std::vector<char> big(8192 * static_cast<size_t>(n));
          Status s = keras_ring::DirectAllgather(t, cfg, big.data(), 8192);
          CHECK(s.code() == Code::kInternal) << s.message();
        }
      });
    }
  }
}

TEST(Shm_TimeoutNamesThePeerAndAbortWakesIt) {
  LocalWorld control(2);
  auto shm = MakeShmWorld(control, 4096, Mix(2, 3));
  char byte = 0;
  for (bool yield : {false, true}) {  // an eager caller's yielding wait is bounded alike
    const auto start = Clock::now();
    Status s = At(shm, 0)->Recv(1, &byte, 1, Deadline::After(0.2).Yielding(yield));
    // Bounded (a hang would never return), not a speed bound.
    CHECK(s.code() == Code::kDeadlineExceeded) << s.message();
    CHECK(s.peer() == 1 && s.message().find("rank 1") != std::string::npos) << s.message();
    CHECK(SecondsSince(start) < 30.0);
  }
  Status s;
  At(shm, 1)->Abort();  // a failure, not a shutdown: the cause travels
  s = At(shm, 0)->Recv(1, &byte, 1, Deadline::After(5.0));
  CHECK(s.code() == Code::kAborted && s.peer() == 1) << s.message();  // its cause travels
  CHECK(s.message().find("aborted") != std::string::npos) << s.message();
}

}  // namespace
}  // namespace kr_test
