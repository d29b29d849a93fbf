// Signature exchange and checking over local transports, and bounded waits: deadlines that
// expire and aborts that unblock peers.
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "../core/algorithms.h"
#include "../core/request.h"
#include "../core/signature.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using keras_ring::Code;
using keras_ring::DataType;
using keras_ring::Deadline;
using keras_ring::Kind;
using keras_ring::Signature;
using keras_ring::Status;
using keras_ring::Transport;

Signature AllreduceSig(int64_t count, DataType dtype = DataType::kFloat32) {
  Signature s;
  s.seq = 7;
  s.kind = static_cast<int32_t>(Kind::kAllreduce);
  s.dtype = static_cast<int32_t>(dtype);
  s.reduce_op = 0;
  s.count = count;
  s.ndims = 1;
  s.dims[0] = count;
  s.SetName("grad_dense");
  return s;
}

// Every rank exchanges sig_for(rank) and checks the table; returns each rank's verdict.
std::vector<Status> ExchangeAndCheck(int n, Signature (*sig_for)(int rank)) {
  LocalWorld world(n);
  std::vector<Status> verdicts(static_cast<size_t>(n));
  std::vector<std::vector<Signature>> all(static_cast<size_t>(n));
  world.Run([&](int r, Transport& t) {
    Status s = keras_ring::ExchangeSignatures(t, 2.0, sig_for(r), &At(all, r));
    At(verdicts, r) = s.ok() ? keras_ring::CheckSignatures(At(all, r)) : s;
  });
  world.CheckDrained(__FILE__, __LINE__);
  return verdicts;
}

// Every rank reached the same verdict, word for word.
void CheckSameVerdict(const std::vector<Status>& v) {
  for (size_t r = 1; r < v.size(); ++r) {
    CHECK(v[r].code() == v[0].code() && v[r].message() == v[0].message() &&
          v[r].peer() == v[0].peer())
        << "rank " << r << ": '" << v[r].message() << "' vs rank 0: '" << v[0].message() << "'";
  }
}

}  // namespace

TEST(Signatures_IdenticalPass) {
  const auto verdicts = ExchangeAndCheck(4, [](int) { return AllreduceSig(10); });
  for (size_t r = 0; r < verdicts.size(); ++r) CHECK_OK(verdicts[r]) << " rank " << r;
}

// The exchanged table holds every rank's signature, in rank order, on every rank.
TEST(Signatures_ExchangeIsAnAllgatherInRankOrder) {
  for (int n : {1, 2, 5, 8}) {
    LocalWorld world(n);
    std::vector<std::vector<Signature>> tables(static_cast<size_t>(n));
    std::vector<Status> status(static_cast<size_t>(n));
    world.Run([&](int r, Transport& t) {
      Signature mine = AllreduceSig(100 + r);
      mine.SetName("from_rank_" + std::to_string(r));
      At(status, r) = keras_ring::ExchangeSignatures(t, 2.0, mine, &At(tables, r));
    });
    world.CheckDrained(__FILE__, __LINE__);
    for (size_t r = 0; r < tables.size(); ++r) {
      CHECK_OK(status[r]) << " rank " << r;
      CHECK_EQ(tables[r].size(), static_cast<size_t>(n));
      for (size_t q = 0; q < tables[r].size(); ++q) {
        CHECK_EQ(tables[r][q].count, static_cast<int64_t>(100 + q)) << " table of rank " << r;
        CHECK_EQ(std::string(tables[r][q].name), "from_rank_" + std::to_string(q));
      }
    }
  }
}

TEST(Signatures_OneRankAlone) {
  const auto verdicts = ExchangeAndCheck(1, [](int) { return AllreduceSig(3); });
  CHECK_OK(verdicts[0]);
}

TEST(Signatures_CountMismatchNamesBothRanks) {
  const auto v = ExchangeAndCheck(3, [](int r) { return AllreduceSig(r == 2 ? 12 : 10); });
  CheckSameVerdict(v);
  for (const Status& s : v) {
    CHECK(s.code() == Code::kFailedPrecondition) << static_cast<int>(s.code()) << " "
                                                 << s.message();
    CHECK_CONTAINS(s.message(), "shape mismatch");
    CHECK_CONTAINS(s.message(), "rank 0 has");
    CHECK_CONTAINS(s.message(), "rank 2 has");
    CHECK_CONTAINS(s.message(), "10 elements");
    CHECK_CONTAINS(s.message(), "12 elements");
    CHECK_CONTAINS(s.message(), "grad_dense");
    CHECK_EQ(s.peer(), 2);
  }
}

using Layout = std::vector<std::pair<DataType, std::vector<int64_t>>>;

Signature GroupSig(const Layout& layout) {
  keras_ring::Request r;
  r.kind = Kind::kGroupedAllreduce;
  for (const auto& [dtype, shape] : layout) {
    keras_ring::TensorRef t;
    t.dtype = dtype;
    t.shape = shape;
    r.tensors.push_back(t);
  }
  r.name = "bucket0";
  return keras_ring::SignatureOf(r, 5);
}

std::string GroupVerdict(const Layout& rank0, const Layout& rank1) {
  const Status s = keras_ring::CheckSignatures({GroupSig(rank0), GroupSig(rank1)});
  CHECK(s.code() == Code::kFailedPrecondition) << s.message();
  CHECK_EQ(s.peer(), 1);
  return s.message();
}

TEST(Signatures_GroupRunsCoverEveryTensorOnce) {
  for (int n = 0; n <= 40; ++n) {
    int next = 0;
    for (int run = 0; run < keras_ring::kMaxSignatureDims; ++run) {
      const auto [first, end] = keras_ring::GroupRun(n, run);
      CHECK_EQ(first, next);
      CHECK(end >= first && end - first <= (n + 7) / 8) << n << " run " << run;
      next = end;
    }
    CHECK_EQ(next, n);
  }
}

// A grouped allreduce's mismatch names the tensor (or, among many, the run of tensors) that
// differs, and how, instead of two opaque layout hashes.
TEST(Signatures_GroupedMismatchNamesTheTensor) {
  const DataType f32 = DataType::kFloat32, f64 = DataType::kFloat64;
  std::string m = GroupVerdict({{f32, {2}}, {f32, {3}}}, {{f32, {2}}, {f64, {3}}});
  CHECK_CONTAINS(m, "grouped_allreduce 'bucket0' dtype/shape mismatch: tensor 1 is float32");
  CHECK_CONTAINS(m, "tensor 1 is float32 on rank 0 and float64 on rank 1");
  m = GroupVerdict({{f32, {2, 3}}}, {{f32, {3, 2}}});
  CHECK_CONTAINS(m, "tensor 0 has the same dtype and element count in another shape");
  m = GroupVerdict({{f32, {2}}, {f32, {3}}}, {{f32, {2}}, {f32, {4}}});
  CHECK_CONTAINS(m, "tensor 1 has 3 elements on rank 0 and 4 on rank 1");
  Layout many(20, {f32, {2}}), other = many;
  other[13].first = f64;  // 20 tensors in 8 runs: 3 3 3 3 2 2 2 2, so run 4 is 12-13
  CHECK_CONTAINS(GroupVerdict(many, other), "tensors 12 to 13 differ in dtype or shape");
  m = GroupVerdict({{f32, {2}}}, {{f32, {2}}, {f32, {0}}});
  CHECK_CONTAINS(m, "rank 0 has 1 tensors, 2 elements, rank 1 has 2 tensors, 2 elements");
}

TEST(Signatures_SameCollectiveFromAnotherStepIsAMismatch) {
  // Rank 1 ran one collective fewer: its next 'grad_dense' lines up with rank 0's later one.
  const auto v = ExchangeAndCheck(2, [](int r) {
    Signature s = AllreduceSig(10);
    s.seq = r == 1 ? 6 : 7;
    return s;
  });
  CheckSameVerdict(v);
  for (const Status& s : v) {
    CHECK(s.code() == Code::kFailedPrecondition) << s.message();
    CHECK_CONTAINS(s.message(), "sequence number mismatch: rank 0 has #7");
    CHECK_CONTAINS(s.message(), "rank 1 has #6");
    CHECK_EQ(s.peer(), 1);
  }
}

TEST(Signatures_DtypeMismatchNamesBothDtypes) {
  const auto v = ExchangeAndCheck(
      4, [](int r) { return AllreduceSig(10, r == 1 ? DataType::kInt32 : DataType::kFloat32); });
  CheckSameVerdict(v);
  for (const Status& s : v) {
    CHECK(s.code() == Code::kFailedPrecondition) << s.message();
    CHECK_CONTAINS(s.message(), "dtype mismatch");
    CHECK_CONTAINS(s.message(), "float32");
    CHECK_CONTAINS(s.message(), "int32");
    CHECK_CONTAINS(s.message(), "rank 1 has");
  }
}

TEST(Signatures_SeveralRanksDiffer) {
  const auto v = ExchangeAndCheck(5, [](int r) {
    Signature s = AllreduceSig(10);
    if (r >= 3) s.reduce_op = 3;  // Max instead of Sum
    return s;
  });
  CheckSameVerdict(v);
  CHECK(v[0].code() == Code::kFailedPrecondition);
  CHECK_CONTAINS(v[0].message(), "reduce op mismatch");
  CHECK_CONTAINS(v[0].message(), "Sum");
  CHECK_CONTAINS(v[0].message(), "Max");
  CHECK_CONTAINS(v[0].message(), " 3 4)");
}

// Names longer than the signature's field (or holding a NUL) keep their start and a hash of
// the whole: two that differ only past the field or after the NUL still differ.
TEST(Signatures_LongNamesThatDifferLateAreAMismatch) {
  const std::string base(130, 'a');
  const auto v = ExchangeAndCheck(3, [](int r) {
    Signature s = AllreduceSig(10);
    s.SetName(r == 1 ? std::string(130, 'a') + "Y" : std::string(130, 'a') + "X");
    return s;
  });
  CheckSameVerdict(v);
  for (const Status& s : v) {
    CHECK(s.code() == Code::kFailedPrecondition) << s.message();
    CHECK_CONTAINS(s.message(), "name");
  }
  const auto nul = ExchangeAndCheck(2, [](int r) {
    Signature s = AllreduceSig(10);
    s.SetName(r == 0 ? std::string("grad\0one", 8) : std::string("grad\0two", 8));
    return s;
  });
  for (const Status& s : nul) CHECK(s.code() == Code::kFailedPrecondition) << s.message();
  Signature same_a, same_b;
  same_a.SetName(base + "tail");
  same_b.SetName(base + "tail");
  CHECK_EQ(std::string(same_a.name), std::string(same_b.name));
  CHECK_EQ(std::string(same_a.name).size(), sizeof same_a.name - 1);
  CHECK_EQ(std::string(same_a.name).substr(0, 20), base.substr(0, 20));
}

// Whether `s` is whole UTF-8: every lead byte followed by as many continuation bytes as it
// announces (the checks Python's decoder makes that a cut could break).
bool WholeUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto lead = static_cast<unsigned char>(s[i]);
    const size_t len = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3
                     : (lead >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

// A long name is cut between characters, never inside one, at every alignment of 2-, 3- and
// 4-byte characters ("é" * 70 was cut mid-character, and its mismatch error reached Python
// as a UnicodeDecodeError).
TEST(Signatures_LongNamesAreCutBetweenUtf8Characters) {
  for (const std::string ch : {"\xc3\xa9", "\xe6\x97\xa5", "\xf0\x9f\x98\x80"}) {
    for (int shift = 0; shift < 4; ++shift) {
      std::string n = std::string(static_cast<size_t>(shift), 'a');
      while (n.size() < 200) n += ch;
      Signature s;
      s.SetName(n);
      const std::string kept(s.name);
      CHECK(WholeUtf8(kept)) << " character of " << ch.size() << " bytes, shift " << shift;
      CHECK_CONTAINS(kept, "...#");
      CHECK_EQ(kept.substr(0, kept.find("...#")), n.substr(0, kept.find("...#")));
      CHECK(kept.size() + ch.size() > sizeof s.name - 1) << "no more cut than one character";
    }
  }
}

// A name on one rank only: the ranks disagree about which collective this is.
TEST(Signatures_NameOnOneRankOnlyIsAMismatch) {
  const auto v = ExchangeAndCheck(2, [](int r) {
    Signature s = AllreduceSig(10);
    s.SetName(r == 0 ? "grad_w" : "");
    return s;
  });
  CheckSameVerdict(v);
  for (const Status& s : v) {
    CHECK(s.code() == Code::kFailedPrecondition) << s.message();
    CHECK_CONTAINS(s.message(), "name mismatch: rank 0 has 'grad_w', rank 1 has no name");
  }
}

// Scale factors that differ past the sixth digit are shown so that the difference reads.
TEST(Signatures_ScaleFactorMismatchShowsEveryDigit) {
  const auto v = ExchangeAndCheck(2, [](int r) {
    Signature s = AllreduceSig(10);
    s.postscale = r == 0 ? 1.0 : 1.000000001;
    return s;
  });
  CheckSameVerdict(v);
  CHECK_CONTAINS(v[0].message(), "postscale factor mismatch: rank 0 has 1, rank 1 has 1.000000001");
}

TEST(Signatures_OperationMismatch) {
  const auto v = ExchangeAndCheck(2, [](int r) {
    Signature s = AllreduceSig(10);
    if (r == 1) s.kind = static_cast<int32_t>(Kind::kAllgather);
    return s;
  });
  CheckSameVerdict(v);
  CHECK(v[0].code() == Code::kFailedPrecondition);
  CHECK_CONTAINS(v[0].message(), "allreduce");
  CHECK_CONTAINS(v[0].message(), "allgather");
}

// GPU ranks pick their NCCL communicator themselves; it is compared like the shape (the
// GPU number is shown but not compared: every rank has its own).
TEST(Signatures_DeviceCommunicatorMismatch) {
  auto on = [](int comm, int fresh, int gpu) {
    Signature s = AllreduceSig(10);
    s.device = 1;
    s.comm = comm;
    s.comm_new = fresh;
    s.gpu = gpu;
    return s;
  };
  CHECK_OK(keras_ring::CheckSignatures({on(0, 0, 0), on(0, 0, 1), on(0, 0, 2)}));
  CHECK_OK(keras_ring::CheckSignatures({on(1, 1, 0), on(1, 1, 3)}));
  Status s = keras_ring::CheckSignatures({on(0, 0, 0), on(0, 0, 1), on(1, 1, 7)});
  CHECK(s.code() == Code::kFailedPrecondition) << s.message();
  CHECK_EQ(s.peer(), 2);
  CHECK_CONTAINS(s.message(), "NCCL communicator mismatch: rank 0 has NCCL communicator #0 "
                              "(GPU 0), rank 2 has a new NCCL communicator #1 to make for GPU 7");
  s = keras_ring::CheckSignatures({on(0, 0, 0), on(1, 0, 1)});
  CHECK_CONTAINS(s.message(), "rank 1 has NCCL communicator #1 (GPU 1)");
  // Host ranks have no communicator: a placement mismatch is reported first, as before.
  s = keras_ring::CheckSignatures({on(0, 0, 0), AllreduceSig(10)});
  CHECK_CONTAINS(s.message(), "placement mismatch");
}

TEST(Signatures_BroadcastRootOutOfRange) {
  for (int bad_root : {3, -1, 100}) {
    static int root;  // captureless lambdas below read it
    root = bad_root;
    const auto v = ExchangeAndCheck(3, [](int) {
      Signature s = AllreduceSig(10);
      s.kind = static_cast<int32_t>(Kind::kBroadcast);
      s.root = root;
      return s;
    });
    CheckSameVerdict(v);
    for (const Status& s : v) {
      CHECK(s.code() == Code::kInvalidArgument) << static_cast<int>(s.code()) << " " << s.message();
      CHECK_CONTAINS(s.message(), std::to_string(bad_root));
    }
  }
  // Out of range on one rank only is still an invalid argument everywhere.
  const auto v = ExchangeAndCheck(3, [](int r) {
    Signature s = AllreduceSig(10);
    s.kind = static_cast<int32_t>(Kind::kBroadcast);
    s.root = r == 1 ? 3 : 0;
    return s;
  });
  CheckSameVerdict(v);
  CHECK(v[0].code() == Code::kInvalidArgument) << v[0].message();
}

TEST(Signatures_AScalarToSplitIsRefusedOnEveryRank) {
  // A scalar on one rank would otherwise pass an alltoall as one row of shape [].
  for (Kind kind : {Kind::kReducescatter, Kind::kAlltoall}) {
    static Kind k;  // captureless lambdas below read it
    k = kind;
    const auto v = ExchangeAndCheck(3, [](int r) {
      Signature s = AllreduceSig(r == 2 ? 1 : 3);
      s.kind = static_cast<int32_t>(k);
      s.row_elems = 1;
      if (r == 2) s.ndims = 0;
      return s;
    });
    CheckSameVerdict(v);
    CHECK(v[0].code() == Code::kInvalidArgument) << v[0].message();
    CHECK_CONTAINS(v[0].message(), "rank 2 passed a scalar");
    CHECK_CONTAINS(v[0].message(), "needs a tensor of rank >= 1 on every rank");
  }
}

TEST(Transport_RecvTimesOutNamingThePeer) {
  LocalWorld world(2);
  char buf[4];
  const auto start = keras_ring::Clock::now();
  const Status s = world.transport(0).Recv(1, buf, sizeof buf, Deadline::After(0.2));
  const double took = SecondsSince(start);
  CHECK(s.code() == Code::kDeadlineExceeded) << static_cast<int>(s.code());
  CHECK_EQ(s.peer(), 1);
  CHECK_CONTAINS(s.message(), "rank 1");
  // Not before the deadline; bounded (a hang would never return). Not a speed bound.
  CHECK(took >= 0.19 && took < 30.0) << took << " s";
  // A message of another size than expected: an error naming both sizes, never a short
  // read or a read that runs into the next message.
  CHECK_OK(world.transport(1).Send(0, "ab", 2, Deadline::After(1)));
  const Status partial = world.transport(0).Recv(1, buf, sizeof buf, Deadline::After(0.1));
  CHECK(partial.code() == Code::kInternal) << static_cast<int>(partial.code());
  CHECK_CONTAINS(partial.message(), "sent 2 bytes in one message, rank 0 received 4");
}

TEST(Transport_AbortUnblocksPendingRecv) {
  LocalWorld world(2);
  Status s;
  double took = 0;
  std::thread waiter([&] {
    char buf[8];
    const auto start = keras_ring::Clock::now();
    s = world.transport(0).Recv(1, buf, sizeof buf, Deadline::After(60));
    took = SecondsSince(start);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  world.transport(1).Abort();
  waiter.join();
  CHECK(s.code() == Code::kUnavailable) << static_cast<int>(s.code()) << " " << s.message();
  CHECK_EQ(s.peer(), 1);
  CHECK(s.fatal());
  CHECK(took < 30.0) << took << " s";  // the abort, well before the 60 s deadline
  char c = 0;
  CHECK(world.transport(0).Send(1, &c, 1, Deadline::After(1)).code() == Code::kUnavailable);
}

// A rank that never joins: the others' allreduce fails within the per-wait timeout.
TEST(RingAllreduce_MissingRankTimesOut) {
  LocalWorld world(3);
  std::vector<Status> status(2);
  std::vector<double> took(2);
  keras_ring::AlgoConfig cfg;
  cfg.timeout_seconds = 0.2;
  cfg.segment_bytes = 8;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::vector<float> buf(40, 1.0f);
      const auto start = keras_ring::Clock::now();
      At(status, r) = keras_ring::RingAllreduce(
          world.transport(r), cfg, DataType::kFloat32, keras_ring::ReduceOp::kSum, buf.data(),
          buf.size(), 1.0, 1.0);
      At(took, r) = SecondsSince(start);
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(status[0].code() == Code::kDeadlineExceeded) << status[0].message();
  CHECK_EQ(status[0].peer(), 2);  // rank 0 waits for its left neighbour, rank 2
  CHECK(!status[1].ok());
  for (double t : took) CHECK(t < 1.5) << t << " s";
}

}  // namespace kr_test
