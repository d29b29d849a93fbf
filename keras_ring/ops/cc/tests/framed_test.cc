// Framed messages (a head that says the length, then the body) on every transport: shm
// through tiny rings (so large bodies take the two-exchange fallback, small ones the buffered
// path), TCP streams, links of both kinds in one world, and the local fabric. The two ends of
// a trade send different lengths, and a length out of bounds is a clear protocol error.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../core/transport.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using namespace keras_ring;  // NOLINT: test-local

constexpr size_t kHead = 64;
constexpr size_t kCapacity = 80000;

size_t LengthOf(const void* head) {
  uint64_t total;
  std::memcpy(&total, head, sizeof total);
  return static_cast<size_t>(total);
}

// Rank `from`'s message in `round`: its length varies by rank and round (head alone, bodies
// under and over a 4 KiB ring, up to most of the capacity); the bytes say who sent them.
std::vector<char> MessageOf(int from, int round) {
  static const size_t kLengths[] = {kHead, kHead + 1, 1000, 4096 + kHead, 9001, 70000};
  const size_t total = kLengths[(static_cast<size_t>(from) * 5 + static_cast<size_t>(round)) % 6];
  std::vector<char> m(total);
  for (size_t i = 0; i < total; ++i) m[i] = static_cast<char>(Mix(from, round, i));
  const uint64_t t = total;
  std::memcpy(m.data(), &t, sizeof t);
  return m;
}

std::string CheckFrom(int from, int round, const std::vector<char>& got, size_t received) {
  const std::vector<char> want = MessageOf(from, round);
  if (received != want.size()) {
    return "received " + std::to_string(received) + " bytes, rank " + std::to_string(from) +
           " sent " + std::to_string(want.size());
  }
  if (std::memcmp(got.data(), want.data(), want.size()) != 0) {
    return "the bytes of rank " + std::to_string(from) + " round " + std::to_string(round) +
           " differ";
  }
  return "";
}

// Every rank trades with r^1 and r^2 (several rounds, so later messages start mid-ring), then
// rank r sends one way to r^1 when r is even.
void TradeEverywhere(const std::function<void(const std::function<void(int, Transport&)>&)>& run,
                     int n, const std::string& where) {
  std::vector<std::string> failures(static_cast<size_t>(n));
  const FrameLength length = LengthOf;
  run([&](int r, Transport& t) {
    std::vector<char> got(kCapacity);
    size_t received = 0;
    for (int round = 0; round < 6; ++round) {
      for (int m = 1; m < n; m *= 2) {
        const int peer = r ^ m;
        const std::vector<char> mine = MessageOf(r, round);
        Status s = t.SendRecvFramed(peer, mine.data(), mine.size(), got.data(), kHead, kCapacity,
                                    length, &received, Deadline::After(30));
        std::string bad = s.ok() ? CheckFrom(peer, round, got, received) : s.message();
        if (!bad.empty() && At(failures, r).empty()) At(failures, r) = bad;
      }
    }
    const int peer = r ^ 1;
    const std::vector<char> mine = MessageOf(r, 7);
    Status s = r % 2 == 0
                   ? t.SendFramed(peer, mine.data(), mine.size(), kHead, Deadline::After(30))
                   : t.RecvFramed(peer, got.data(), kHead, kCapacity, length, &received,
                                  Deadline::After(30));
    std::string bad = !s.ok() ? s.message() : r % 2 == 0 ? "" : CheckFrom(peer, 7, got, received);
    if (!bad.empty() && At(failures, r).empty()) At(failures, r) = bad;
  });
  for (int r = 0; r < n; ++r) {
    CHECK(At(failures, r).empty()) << where << " rank " << r << ": " << At(failures, r);
  }
}

}  // namespace

TEST(Framed_DifferentLengthsBothWaysOnEveryTransport) {
  // One host (shm), four hosts (tcp), two hosts of two ranks (both kinds of link).
  for (const std::vector<int>& hosts :
       {std::vector<int>{0, 0, 0, 0}, std::vector<int>{0, 1, 2, 3}, std::vector<int>{0, 0, 1, 1}}) {
    auto world = ConnectHostWorld(hosts, Mix(23, hosts[1], hosts[3]));
    TradeEverywhere([&](const std::function<void(int, Transport&)>& fn) { RunAll(world, fn); },
                    4, "hosts " + std::to_string(hosts[1]) + std::to_string(hosts[3]));
  }
  LocalWorld local(4);
  TradeEverywhere([&](const std::function<void(int, Transport&)>& fn) { local.Run(fn); }, 4,
                  "local");
  local.CheckDrained(__FILE__, __LINE__);
}

TEST(Framed_LengthOutOfBoundsIsAProtocolErrorNamingTheSender) {
  for (const std::vector<int>& hosts : {std::vector<int>{0, 0}, std::vector<int>{0, 1}}) {
    auto world = ConnectHostWorld(hosts, Mix(29, hosts[1]));
    std::vector<Status> got(2);
    RunAll(world, [&](int r, Transport& t) {
      std::vector<char> mine(kHead, 0), buf(kHead);
      const uint64_t claimed = r == 0 ? 1 << 20 : kHead;  // rank 0 claims 1 MiB
      std::memcpy(mine.data(), &claimed, sizeof claimed);
      size_t received = 0;
      At(got, r) = t.SendRecvFramed(1 - r, mine.data(), kHead, buf.data(), kHead, kHead,
                                    LengthOf, &received, Deadline::After(30));
      // As the runtime does: the error ends the job, so rank 0 need not wait for the rest
      // of rank 1's message (on tcp the error may come before rank 1 sent it).
      if (!At(got, r).ok()) t.AbortWith(At(got, r));
    });
    const Status& s = At(got, 1);
    CHECK(s.code() == Code::kInternal) << "hosts " << hosts[1] << ": " << s.message();
    CHECK_EQ(s.peer(), 0);
    CHECK(s.message().find("rank 0 announced a message of 1048576 bytes") != std::string::npos)
        << s.message();
  }
}

}  // namespace kr_test
