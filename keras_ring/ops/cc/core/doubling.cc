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
                         size_t head, size_t capacity, const FrameLength& length,
                         const DoublingCombine& combine, char** result,
                         std::atomic<int>* progress, int* waited_on) {
  const int n = t.size();
  const int r = t.rank();
  const int p = PowerOfTwoBelow(n);
  char* mine = state;
  char* other = scratch;
  *result = mine;
  size_t got = 0;
  auto fail = [&](int peer, const Status& s) {
    if (waited_on != nullptr) *waited_on = peer;
    return s;
  };
  int rounds = 0;
  for (int m = 1; m < p; m *= 2) ++rounds;
  if (r >= p) {
    // An extra: hand the state to the core rank, then wait for the finished one.
    const int core = r - p;
    Status s = t.SendFramed(core, mine, length(mine), head, DepthDeadline(cfg, 0));
    if (!s.ok()) return fail(core, s);
    s = t.RecvFramed(core, mine, head, capacity, length, &got, DepthDeadline(cfg, rounds + 2));
    if (!s.ok()) return fail(core, s);
    Count(progress);
    return Status::OK();
  }
  const int extra = r + p;
  if (extra < n) {
    Status s = t.RecvFramed(extra, other, head, capacity, length, &got, DepthDeadline(cfg, 0));
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
    Status s = t.SendRecvFramed(peer, mine, length(mine), other, head, capacity, length, &got,
                                DepthDeadline(cfg, k + 1));
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
    Status s = t.SendFramed(extra, mine, length(mine), head, DepthDeadline(cfg, rounds + 1));
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

namespace {

// One doubling round of a vector: sends `mine` to `peer` while its vector arrives and is
// combined, lower ranks' first, into `dst` (neither operand: a transport may still be reading
// `mine` for the send, and Reduce's destination may not be its second operand). On shm the
// peer's bytes are reduced straight out of the ring, with no scratch copy.
Status ReduceRound(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op, int peer,
                   bool mine_is_lower, const char* mine, char* dst, size_t bytes) {
  const size_t esize = DataTypeSize(dtype);
  const ReduceFn combine = [&](void* out, const void* local, const void* theirs, size_t len) {
    if (mine_is_lower) {
      Reduce(dtype, op, out, local, theirs, len / esize);
    } else {
      Reduce(dtype, op, out, theirs, local, len / esize);
    }
  };
  const size_t seg = std::max(esize, cfg.segment_bytes / esize * esize);
  std::vector<SendPiece> send(1);
  std::vector<RecvPiece> recv(1);
  size_t off = 0;
  do {
    const size_t len = std::min(seg, bytes - off);
    send[0] = SendPiece{mine + off, len};
    recv[0] = RecvPiece{dst + off, mine + off, len};
    KR_RETURN_IF_ERROR(t.SendRecvPieces(peer, send, peer, recv, esize, &combine,
                                        cfg.NextDeadline()));
    off += len;
  } while (off < bytes);
  return Status::OK();
}

}  // namespace

Status DoublingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                         const void* input, void* output, size_t count, double prescale,
                         double postscale, std::vector<char>* scratch) {
  const int n = t.size();
  const int r = t.rank();
  const int p = PowerOfTwoBelow(n);
  const size_t bytes = count * DataTypeSize(dtype);
  if (input != output && bytes > 0) std::memcpy(output, input, bytes);
  Scale(dtype, output, count, prescale);
  if (n > 1 && bytes > 0) {
    scratch->resize(bytes);
    char* mine = static_cast<char*>(output);
    char* other = scratch->data();
    if (r >= p) {
      // An extra: hand the vector to the core rank, get the finished one back.
      KR_RETURN_IF_ERROR(t.Send(r - p, mine, bytes, cfg.NextDeadline()));
      KR_RETURN_IF_ERROR(t.Recv(r - p, mine, bytes, cfg.NextDeadline()));
      return Status::OK();  // finished (and scaled) by the core rank
    }
    if (r + p < n) {
      KR_RETURN_IF_ERROR(t.Recv(r + p, other, bytes, cfg.NextDeadline()));
      Reduce(dtype, op, mine, mine, other, count);  // the extra's is the upper
    }
    for (int m = 1; m < p; m *= 2) {
      const int peer = r ^ m;
      KR_RETURN_IF_ERROR(ReduceRound(t, cfg, dtype, op, peer, r < peer, mine, other, bytes));
      std::swap(mine, other);
    }
    FinishReduction(dtype, op, mine, count, n, postscale);
    if (r + p < n) KR_RETURN_IF_ERROR(t.Send(r + p, mine, bytes, cfg.NextDeadline()));
    if (mine != output) std::memcpy(output, mine, bytes);
    return Status::OK();
  }
  FinishReduction(dtype, op, output, count, n, postscale);
  return Status::OK();
}

}  // namespace keras_ring
