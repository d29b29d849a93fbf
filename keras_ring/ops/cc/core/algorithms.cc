#include "algorithms.h"

#include <algorithm>
#include <cstring>

#include "copy.h"
#include "reduce.h"

namespace keras_ring {
namespace {

struct Span {
  size_t offset;  // in elements
  size_t count;
};

// Splits count elements into n nearly equal chunks; the first count % n get one extra.
Span Chunk(size_t count, int n, int index) {
  const size_t base = count / static_cast<size_t>(n);
  const size_t extra = count % static_cast<size_t>(n);
  const size_t i = static_cast<size_t>(index);
  return Span{i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
}

int Mod(int a, int n) { return ((a % n) + n) % n; }

void FinishScaling(DataType dtype, ReduceOp op, void* data, size_t count, int size,
                   double postscale) {
  if (op == ReduceOp::kAverage) {
    AverageScale(dtype, data, count, size, postscale);
  } else {
    Scale(dtype, data, count, postscale);
  }
}

// Combines a received segment with the local one into the output. On the last
// reduce-scatter step it also applies the final scaling while the segment is in cache, and
// for large outputs it goes through a small L1 block so the output is written with streaming
// stores.
struct Combiner {
  DataType dtype;
  ReduceOp op;
  size_t esize;
  bool stream;
  bool finish;
  int size;
  double postscale;

  void Apply(void* dst, const void* local, const void* peer, size_t count) const {
    Reduce(dtype, op, dst, local, peer, count);
    if (finish) FinishScaling(dtype, op, dst, count, size, postscale);
  }

  void operator()(void* dst, const void* local, const void* peer, size_t bytes) const {
    if (!stream) return Apply(dst, local, peer, bytes / esize);
    constexpr size_t kBlock = 8192;  // a multiple of every element size
    alignas(64) thread_local char block[kBlock];
    for (size_t off = 0; off < bytes; off += kBlock) {
      const size_t len = std::min(kBlock, bytes - off);
      Apply(block, static_cast<const char*>(local) + off, static_cast<const char*>(peer) + off,
            len / esize);
      StreamCopyUnfenced(static_cast<char*>(dst) + off, block, len);
    }
    StreamFence();
  }
};

}  // namespace

Status RingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                     void* buf, size_t count, double prescale, double postscale) {
  return RingAllreduce(t, cfg, dtype, op, buf, buf, count, prescale, postscale);
}

Status RingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                     const void* input, void* output, size_t count, double prescale,
                     double postscale) {
  const int n = t.size();
  const int r = t.rank();
  const size_t esize = DataTypeSize(dtype);
  char* out = static_cast<char*>(output);
  if (prescale != 1.0 || n == 1 || count == 0) {
    // Scaling must not touch the caller's input: work in place on the output.
    if (input != output && count > 0) std::memcpy(output, input, count * esize);
    input = output;
    Scale(dtype, output, count, prescale);
  }
  const char* in = static_cast<const char*>(input);
  if (n == 1 || count == 0) {
    FinishScaling(dtype, op, output, count, n, postscale);
    return Status::OK();
  }
  const int right = Mod(r + 1, n);
  const int left = Mod(r - 1, n);
  const size_t seg = std::max<size_t>(1, cfg.segment_bytes / esize);
  const bool stream = count * esize >= cfg.stream_bytes;
  const Combiner combine{dtype, op, esize, stream, /*finish=*/false, n, postscale};
  const Combiner combine_last{dtype, op, esize, stream, /*finish=*/true, n, postscale};
  const ReduceFn reduce = combine;
  const ReduceFn reduce_last = combine_last;

  // Reduce-scatter: after n-1 steps rank r holds the full reduction of chunk r+1. Step 0
  // sends straight from the input, and each received chunk is combined with the input's
  // (every chunk is reduced at most once per rank), so the input is never copied.
  for (int step = 0; step < n - 1; ++step) {
    const Span s = Chunk(count, n, Mod(r - step, n));
    const Span v = Chunk(count, n, Mod(r - step - 1, n));
    const char* send_base = step == 0 ? in : out;
    for (size_t off = 0; off < std::max(s.count, v.count); off += seg) {
      const size_t sc = off < s.count ? std::min(seg, s.count - off) : 0;
      const size_t vc = off < v.count ? std::min(seg, v.count - off) : 0;
      const size_t recv_at = (v.offset + off) * esize;
      KR_RETURN_IF_ERROR(t.SendRecvReduce(right, send_base + (s.offset + off) * esize,
                                          sc * esize, left, out + recv_at, in + recv_at,
                                          vc * esize, esize,
                                          step == n - 2 ? reduce_last : reduce,
                                          Deadline::After(cfg.timeout_seconds)));
    }
  }

  // Allgather of the finished chunks (chunk r, never reduced here, arrives first). Large
  // outputs are delivered with streaming stores where the transport lets us read in place.
  const bool deliver = stream && t.ReadsInPlace(left);
  const ReduceFn stream_copy = [](void* dst, const void*, const void* peer, size_t bytes) {
    StreamCopy(dst, peer, bytes);
  };
  for (int step = 0; step < n - 1; ++step) {
    const Span s = Chunk(count, n, Mod(r + 1 - step, n));
    const Span v = Chunk(count, n, Mod(r - step, n));
    for (size_t off = 0; off < std::max(s.count, v.count); off += seg) {
      const size_t sc = off < s.count ? std::min(seg, s.count - off) : 0;
      const size_t vc = off < v.count ? std::min(seg, v.count - off) : 0;
      char* recv_at = out + (v.offset + off) * esize;
      const Deadline deadline = Deadline::After(cfg.timeout_seconds);
      KR_RETURN_IF_ERROR(
          deliver ? t.SendRecvReduce(right, out + (s.offset + off) * esize, sc * esize, left,
                                     recv_at, nullptr, vc * esize, 1, stream_copy, deadline)
                  : t.SendRecv(right, out + (s.offset + off) * esize, sc * esize, left, recv_at,
                               vc * esize, deadline));
    }
  }
  return Status::OK();
}

Status RingAllgatherv(Transport& t, const AlgoConfig& cfg, void* out,
                      const std::vector<size_t>& block_bytes, std::atomic<int>* steps_done) {
  const int n = t.size();
  const int r = t.rank();
  if (n == 1) return Status::OK();
  std::vector<size_t> offsets(block_bytes.size() + 1, 0);
  for (size_t i = 0; i < block_bytes.size(); ++i) offsets[i + 1] = offsets[i] + block_bytes[i];
  char* base = static_cast<char*>(out);
  const int right = Mod(r + 1, n);
  const int left = Mod(r - 1, n);
  const size_t seg = std::max<size_t>(1, cfg.segment_bytes);
  for (int step = 0; step < n - 1; ++step) {
    const int sb = Mod(r - step, n);
    const int vb = Mod(r - step - 1, n);
    const size_t slen = block_bytes[static_cast<size_t>(sb)];
    const size_t vlen = block_bytes[static_cast<size_t>(vb)];
    // At least one (possibly empty) exchange per step keeps every rank in lock step.
    size_t off = 0;
    do {
      const size_t sc = off < slen ? std::min(seg, slen - off) : 0;
      const size_t vc = off < vlen ? std::min(seg, vlen - off) : 0;
      KR_RETURN_IF_ERROR(t.SendRecv(right, base + offsets[static_cast<size_t>(sb)] + off, sc, left,
                                    base + offsets[static_cast<size_t>(vb)] + off, vc,
                                    Deadline::After(cfg.timeout_seconds)));
      off += seg;
    } while (off < std::max(slen, vlen));
    if (steps_done != nullptr) steps_done->fetch_add(1);
  }
  return Status::OK();
}

Status ChainBroadcast(Transport& t, const AlgoConfig& cfg, void* buf, size_t bytes, int root) {
  const int n = t.size();
  if (n == 1 || bytes == 0) return Status::OK();
  const int pos = Mod(t.rank() - root, n);  // position along the chain
  const int right = Mod(t.rank() + 1, n);
  const int left = Mod(t.rank() - 1, n);
  char* base = static_cast<char*>(buf);
  const size_t seg = std::max<size_t>(1, cfg.segment_bytes);
  for (size_t off = 0; off < bytes; off += seg) {
    const size_t len = std::min(seg, bytes - off);
    if (pos > 0) {
      KR_RETURN_IF_ERROR(t.Recv(left, base + off, len, Deadline::After(cfg.timeout_seconds)));
    }
    if (pos < n - 1) {
      KR_RETURN_IF_ERROR(t.Send(right, base + off, len, Deadline::After(cfg.timeout_seconds)));
    }
  }
  return Status::OK();
}

}  // namespace keras_ring
