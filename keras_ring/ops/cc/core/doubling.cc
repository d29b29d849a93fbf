#include "doubling.h"

#include <algorithm>
#include <cstring>

#include "reduce.h"

namespace keras_ring {

int PowerOfTwoBelow(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

bool Held::Contains(int rank) const {
  if (single) return rank == first;
  const int p = PowerOfTwoBelow(n);
  const int core = rank < p ? rank : rank - p;
  return core >= first && core < first + len;
}

double DepthMargin(double timeout_seconds) { return std::min(2.0, timeout_seconds / 4); }

namespace {

Deadline DepthDeadline(const AlgoConfig& cfg, int depth) {
  return Deadline::After(cfg.timeout_seconds + depth * DepthMargin(cfg.timeout_seconds))
      .Yielding(cfg.may_yield);
}

void Count(std::atomic<int>* progress) {
  if (progress != nullptr) progress->fetch_add(1);
}

}  // namespace

Status RecursiveDoubling(Transport& t, const AlgoConfig& cfg, char* state, char* scratch,
                         size_t bytes, const DoublingCombine& combine, char** result,
                         std::atomic<int>* progress, int* waited_on) {
  const int n = t.size();
  const int r = t.rank();
  const int p = PowerOfTwoBelow(n);
  char* mine = state;
  char* other = scratch;
  *result = mine;
  auto fail = [&](int peer, const Status& s) {
    if (waited_on != nullptr) *waited_on = peer;
    return s;
  };
  int rounds = 0;
  for (int m = 1; m < p; m *= 2) ++rounds;
  const bool buffered = t.BufferedSendBytes() >= bytes;
  if (r >= p) {
    // An extra: hand the state to the core rank, then wait for the finished one.
    const int core = r - p;
    Status s = t.Send(core, mine, bytes, DepthDeadline(cfg, 0));
    if (!s.ok()) return fail(core, s);
    s = t.Recv(core, mine, bytes, DepthDeadline(cfg, rounds + 2));
    if (!s.ok()) return fail(core, s);
    Count(progress);
    return Status::OK();
  }
  const int extra = r + p;
  if (extra < n) {
    Status s = t.Recv(extra, other, bytes, DepthDeadline(cfg, 0));
    if (!s.ok()) return fail(extra, s);
    Held held;
    held.first = extra;
    held.len = 1;
    held.n = n;
    held.single = true;
    char* out = combine(mine, other, /*mine_is_lower=*/true, held);
    other = out == mine ? other : mine;
    mine = out;
    Count(progress);
  }
  for (int k = 0, m = 1; m < p; ++k, m *= 2) {
    const int peer = r ^ m;
    const Deadline deadline = DepthDeadline(cfg, k + 1);
    // A link that buffers the whole state takes the send at once: then a plain receive,
    // cheaper than the general exchange, which must make progress both ways at once.
    Status s = buffered ? t.Send(peer, mine, bytes, deadline)
                        : t.SendRecv(peer, mine, bytes, peer, other, bytes, deadline);
    if (s.ok() && buffered) s = t.Recv(peer, other, bytes, deadline);
    if (!s.ok()) return fail(peer, s);
    Held held;
    held.first = peer & ~(m - 1);
    held.len = m;
    held.n = n;
    char* out = combine(mine, other, /*mine_is_lower=*/r < peer, held);
    other = out == mine ? other : mine;
    mine = out;
    Count(progress);
  }
  if (extra < n) {
    Status s = t.Send(extra, mine, bytes, DepthDeadline(cfg, rounds + 1));
    if (!s.ok()) return fail(extra, s);
  }
  *result = mine;
  return Status::OK();
}

std::vector<int> DoublingNotHeardFrom(int rank, int n, int progress) {
  const int p = PowerOfTwoBelow(n);
  Held heard;
  heard.n = n;
  heard.single = true;
  heard.first = rank;
  if (rank < p) {
    const bool has_extra = rank + p < n;
    const int rounds = has_extra ? progress - 1 : progress;
    if (rounds >= 0) {
      heard.single = false;
      heard.len = 1 << rounds;
      heard.first = rank & ~(heard.len - 1);
    }
  } else if (progress > 0) {
    return {};
  }
  std::vector<int> missing;
  for (int q = 0; q < n; ++q) {
    if (q != rank && !heard.Contains(q)) missing.push_back(q);
  }
  return missing;
}

Status DoublingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                         const void* input, void* output, size_t count, double prescale,
                         double postscale, std::vector<char>* scratch) {
  const size_t bytes = count * DataTypeSize(dtype);
  if (input != output && bytes > 0) std::memcpy(output, input, bytes);
  Scale(dtype, output, count, prescale);
  scratch->resize(bytes);
  const DoublingCombine reduce = [&](char* mine, char* peer, bool mine_is_lower, const Held&) {
    // dst may be Reduce's first operand, not its second: the result lands in the lower's.
    char* lower = mine_is_lower ? mine : peer;
    Reduce(dtype, op, lower, lower, mine_is_lower ? peer : mine, count);
    return lower;
  };
  char* result = nullptr;
  KR_RETURN_IF_ERROR(RecursiveDoubling(t, cfg, static_cast<char*>(output), scratch->data(), bytes,
                                       reduce, &result));
  FinishReduction(dtype, op, result, count, t.size(), postscale);
  if (result != output && bytes > 0) std::memcpy(output, result, bytes);
  return Status::OK();
}

}  // namespace keras_ring
