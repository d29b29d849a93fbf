// The shared-memory transport with ranks as threads of this process (the segments, rings,
// doorbells and futexes are the real ones): ring algorithms over tiny channels so every
// message wraps around, odd message sizes before element-typed reductions, and no segment
// left in /dev/shm.
#include <dirent.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../core/algorithms.h"
#include "../core/shm_transport.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using namespace keras_ring;  // NOLINT: test-local

int CountSegmentsOfThisProcess() {
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
    CHECK(CountSegmentsOfThisProcess() == 0) << "segments must be unlinked once mapped";
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

TEST(Shm_TimeoutNamesThePeerAndAbortWakesIt) {
  LocalWorld control(2);
  auto shm = MakeShmWorld(control, 4096, Mix(2, 3));
  char byte = 0;
  const auto start = Clock::now();
  Status s = At(shm, 0)->Recv(1, &byte, 1, Deadline::After(0.2));
  CHECK(s.code() == Code::kDeadlineExceeded) << s.message();
  CHECK(s.peer() == 1 && s.message().find("rank 1") != std::string::npos) << s.message();
  CHECK(SecondsSince(start) < 2.0);
  At(shm, 1)->Abort();  // a failure, not a shutdown: the cause travels
  s = At(shm, 0)->Recv(1, &byte, 1, Deadline::After(5.0));
  CHECK(s.code() == Code::kAborted && s.peer() == 1) << s.message();  // its cause travels
  CHECK(s.message().find("aborted") != std::string::npos) << s.message();
}

}  // namespace
}  // namespace kr_test
