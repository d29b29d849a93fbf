// The routed transport over real shared memory and real TCP sockets (loopback), ranks as
// threads of this process on fake "hosts": every ring mixes shm links and TCP links, as on a
// cluster with several ranks per host. Messages of many pieces whose sizes are not multiples
// of a cache line cross both kinds of link, through tiny shm rings so they wrap around.
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../core/algorithms.h"
#include "../core/routed_transport.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using namespace keras_ring;  // NOLINT: test-local

// The layouts of a cluster: 2 hosts x 2 ranks, interleaved hosts (every link crosses
// hosts but not every pair), and 3 hosts with 3, 1 and 2 ranks.
const std::vector<std::vector<int>>& Layouts() {
  static const std::vector<std::vector<int>> layouts = {
      {0, 0, 1, 1}, {0, 1, 0, 1}, {0, 0, 0, 1, 2, 2}};
  return layouts;
}

std::string Describe(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return "[" + s + "]";
}

// One ring step on every rank at once: a message of several odd-sized pieces to the right,
// received on the left cut at other places, so no piece boundary lines up with another.
TEST(Routed_MultiPieceMessagesCrossShmAndTcpLinksIntact) {
  for (const std::vector<int>& hosts : Layouts()) {
    auto world = ConnectHostWorld(hosts, Mix(7, hosts.size()));
    const int n = static_cast<int>(hosts.size());
    const std::vector<size_t> send_cuts = {3, 61, 130, 1, 9000};   // 9195 bytes in all
    const std::vector<size_t> recv_cuts = {100, 94, 5000, 4001};   // the same 9195
    RunAll(world, [&](int rank, Transport& t) {
      const int right = (rank + 1) % n, left = (rank + n - 1) % n;
      std::vector<std::vector<char>> src;
      std::vector<SendPiece> send;
      size_t at = 0;
      for (size_t len : send_cuts) {
        src.emplace_back(len);
        for (size_t i = 0; i < len; ++i) src.back()[i] = static_cast<char>(Mix(rank, at + i));
        send.push_back(SendPiece{src.back().data(), len});
        at += len;
      }
      std::vector<std::vector<char>> dst;
      std::vector<RecvPiece> recv;
      for (size_t len : recv_cuts) {
        dst.emplace_back(len, 0);
        recv.push_back(RecvPiece{dst.back().data(), nullptr, len});
      }
      for (int round = 0; round < 3; ++round) {  // later messages start mid-ring
        CHECK_OK(t.SendRecvPieces(right, send, left, recv, 1, nullptr, Deadline::After(30)))
            << "rank " << rank << " hosts " << Describe(hosts);
        size_t pos = 0, bad = 0;
        for (const auto& piece : dst) {
          for (char c : piece) bad += c != static_cast<char>(Mix(left, pos++)) ? 1 : 0;
        }
        CHECK_EQ(bad, size_t{0}) << "rank " << rank << " round " << round << " hosts "
                                 << Describe(hosts);
      }
    });
  }
}

// Grouped allreduce whose ring chunks span tensor boundaries (the shapes that returned
// garbage when a multi-piece message went out piece by piece over shm), every dtype size.
TEST(Routed_GroupedAllreduceOverMixedRingsMatchesExpected) {
  struct Group {
    DataType dtype;
    std::vector<size_t> counts;
  };
  const std::vector<Group> groups = {
      {DataType::kFloat32, {4, 40000}},         {DataType::kFloat32, {1000, 300000}},
      {DataType::kInt32, {4, 262144}},          {DataType::kFloat64, {3, 17, 1001, 5, 0, 777}},
      {DataType::kFloat16, {7, 333, 1, 4095}},  {DataType::kInt8, {1, 2, 3, 5000, 61}},
      {DataType::kInt64, {9, 1}}};
  for (const std::vector<int>& hosts : Layouts()) {
    auto world = ConnectHostWorld(hosts, Mix(11, hosts.size()));
    const int n = static_cast<int>(hosts.size());
    for (const Group& g : groups) {
      const size_t esize = DataTypeSize(g.dtype);
      RunAll(world, [&](int rank, Transport& t) {
        std::vector<std::vector<char>> bufs;
        std::vector<Part> parts;
        for (size_t p = 0; p < g.counts.size(); ++p) {
          bufs.emplace_back(g.counts[p] * esize + 1);  // +1: never a null data pointer
          for (size_t i = 0; i < g.counts[p]; ++i) {
            SetFromDouble(g.dtype, bufs.back().data(), i, static_cast<double>((rank + i + p) % 5));
          }
        }
        for (auto& b : bufs) parts.push_back(Part{b.data(), b.data(), 0});
        for (size_t p = 0; p < g.counts.size(); ++p) parts[p].count = g.counts[p];
        AlgoConfig cfg;
        cfg.timeout_seconds = 30;
        cfg.segment_bytes = 1000;  // not a multiple of the element or the cache line
        const Status s = RingAllreduce(t, cfg, g.dtype, ReduceOp::kSum, parts, 1.0, 1.0);
        CHECK_OK(s) << "rank " << rank << " " << DataTypeName(g.dtype) << " hosts "
                    << Describe(hosts);
        if (!s.ok()) return;
        size_t bad = 0;
        double first_got = 0, first_want = 0;
        for (size_t p = 0; p < g.counts.size(); ++p) {
          for (size_t i = 0; i < g.counts[p]; ++i) {
            double want = 0;
            for (int q = 0; q < n; ++q) want += static_cast<double>((q + i + p) % 5);
            const double got = GetAsDouble(g.dtype, bufs[p].data(), i);
            if (got != want && bad++ == 0) first_got = got, first_want = want;
          }
        }
        CHECK_EQ(bad, size_t{0}) << "rank " << rank << " " << DataTypeName(g.dtype) << " hosts "
                                 << Describe(hosts) << ": got " << first_got << " want "
                                 << first_want;
      });
    }
  }
}

}  // namespace
}  // namespace kr_test
