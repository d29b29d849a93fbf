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
    if (finish) FinishReduction(dtype, op, dst, count, size, postscale);
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

// The parts seen as one vector of elements: cuts logical ranges at the parts' boundaries.
class PartsLayout {
 public:
  PartsLayout(const std::vector<Part>& parts, size_t esize) : parts_(parts), esize_(esize) {
    starts_.push_back(0);
    for (const Part& p : parts) starts_.push_back(starts_.back() + p.count);
  }

  // The non-empty pieces of elements [first, first + count) of the inputs or outputs.
  void SendPieces(size_t first, size_t count, bool from_input, std::vector<SendPiece>* out) const {
    out->clear();
    ForEach(first, count, [&](const Part& p, size_t at, size_t len) {
      const void* base = from_input ? p.input : p.output;
      out->push_back(SendPiece{static_cast<const char*>(base) + at * esize_, len * esize_});
    });
  }

  // Pieces receiving into the outputs, combined with the inputs if `with_local`.
  void RecvPieces(size_t first, size_t count, bool with_local, std::vector<RecvPiece>* out) const {
    out->clear();
    ForEach(first, count, [&](const Part& p, size_t at, size_t len) {
      out->push_back(RecvPiece{static_cast<char*>(p.output) + at * esize_,
                               with_local ? static_cast<const char*>(p.input) + at * esize_
                                          : nullptr,
                               len * esize_});
    });
  }

 private:
  template <typename F>
  void ForEach(size_t first, size_t count, F&& f) const {
    if (count == 0) return;
    size_t lo = first;
    const size_t hi = first + count;
    size_t i = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), lo) -
                                   starts_.begin()) - 1;
    while (lo < hi) {
      const size_t end = std::min(hi, starts_[i + 1]);
      if (end > lo) f(parts_[i], lo - starts_[i], end - lo);
      lo = std::max(lo, end);
      ++i;
    }
  }

  const std::vector<Part>& parts_;
  size_t esize_;
  std::vector<size_t> starts_;  // logical index of each part's first element, then the total
};

}  // namespace

Status RingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                     void* buf, size_t count, double prescale, double postscale) {
  return RingAllreduce(t, cfg, dtype, op, buf, buf, count, prescale, postscale);
}

Status RingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                     const void* input, void* output, size_t count, double prescale,
                     double postscale) {
  return RingAllreduce(t, cfg, dtype, op, std::vector<Part>{Part{input, output, count}},
                       prescale, postscale);
}

Status RingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                     std::vector<Part> parts, double prescale, double postscale) {
  const int n = t.size();
  const int r = t.rank();
  const size_t esize = DataTypeSize(dtype);
  size_t count = 0;
  for (const Part& p : parts) count += p.count;
  if (prescale != 1.0 || n == 1 || count == 0) {
    // Scaling must not touch the caller's input: work in place on the output.
    for (Part& p : parts) {
      if (p.input != p.output && p.count > 0) std::memcpy(p.output, p.input, p.count * esize);
      p.input = p.output;
      Scale(dtype, p.output, p.count, prescale);
    }
  }
  if (n == 1 || count == 0) {
    for (Part& p : parts) FinishReduction(dtype, op, p.output, p.count, n, postscale);
    return Status::OK();
  }
  const PartsLayout layout(parts, esize);
  const int right = Mod(r + 1, n);
  const int left = Mod(r - 1, n);
  const size_t seg = std::max<size_t>(1, cfg.segment_bytes / esize);
  const bool stream = count * esize >= cfg.stream_bytes;
  const ReduceFn reduce = Combiner{dtype, op, esize, stream, /*finish=*/false, n, postscale};
  const ReduceFn reduce_last = Combiner{dtype, op, esize, stream, /*finish=*/true, n, postscale};
  std::vector<SendPiece> send;
  std::vector<RecvPiece> recv;

  // Reduce-scatter: after n-1 steps rank r holds the full reduction of chunk r+1. Step 0
  // sends straight from the input, and each received chunk is combined with the input's
  // (every chunk is reduced at most once per rank), so the input is never copied.
  for (int step = 0; step < n - 1; ++step) {
    const Span s = Chunk(count, n, Mod(r - step, n));
    const Span v = Chunk(count, n, Mod(r - step - 1, n));
    for (size_t off = 0; off < std::max(s.count, v.count); off += seg) {
      const size_t sc = off < s.count ? std::min(seg, s.count - off) : 0;
      const size_t vc = off < v.count ? std::min(seg, v.count - off) : 0;
      layout.SendPieces(s.offset + off, sc, /*from_input=*/step == 0, &send);
      layout.RecvPieces(v.offset + off, vc, /*with_local=*/true, &recv);
      KR_RETURN_IF_ERROR(t.SendRecvPieces(right, send, left, recv, esize,
                                          step == n - 2 ? &reduce_last : &reduce,
                                          cfg.NextDeadline()));
    }
  }

  // Allgather of the finished chunks (chunk r, never reduced here, arrives first). Large
  // outputs are delivered with streaming stores where the transport lets us read in place.
  const ReduceFn stream_copy = [](void* dst, const void*, const void* peer, size_t bytes) {
    StreamCopy(dst, peer, bytes);
  };
  const ReduceFn* deliver = stream && t.ReadsInPlace(left) ? &stream_copy : nullptr;
  for (int step = 0; step < n - 1; ++step) {
    const Span s = Chunk(count, n, Mod(r + 1 - step, n));
    const Span v = Chunk(count, n, Mod(r - step, n));
    for (size_t off = 0; off < std::max(s.count, v.count); off += seg) {
      const size_t sc = off < s.count ? std::min(seg, s.count - off) : 0;
      const size_t vc = off < v.count ? std::min(seg, v.count - off) : 0;
      layout.SendPieces(s.offset + off, sc, /*from_input=*/false, &send);
      layout.RecvPieces(v.offset + off, vc, /*with_local=*/false, &recv);
      KR_RETURN_IF_ERROR(t.SendRecvPieces(right, send, left, recv, esize, deliver,
                                          cfg.NextDeadline()));
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
                                    cfg.NextDeadline()));
      off += seg;
    } while (off < std::max(slen, vlen));
    if (steps_done != nullptr) steps_done->fetch_add(1);
  }
  return Status::OK();
}

Status DirectAllgather(Transport& t, const AlgoConfig& cfg, void* out, size_t block_bytes,
                       std::atomic<int>* steps_done) {
  const int n = t.size();
  const int r = t.rank();
  char* base = static_cast<char*>(out);
  if (t.BufferedSendBytes() < block_bytes) {
    return Status(Code::kInternal, "DirectAllgather needs links that buffer a whole block");
  }
  const char* mine = base + static_cast<size_t>(r) * block_bytes;
  for (int k = 1; k < n; ++k) {
    KR_RETURN_IF_ERROR(
        t.Send(Mod(r + k, n), mine, block_bytes, cfg.NextDeadline()));
  }
  for (int k = 1; k < n; ++k) {
    const int from = Mod(r - k, n);
    KR_RETURN_IF_ERROR(t.Recv(from, base + static_cast<size_t>(from) * block_bytes, block_bytes,
                              cfg.NextDeadline()));
    if (steps_done != nullptr) steps_done->fetch_add(1);
  }
  return Status::OK();
}

namespace {

std::vector<size_t> Offsets(const std::vector<size_t>& sizes) {
  std::vector<size_t> offsets(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) offsets[i + 1] = offsets[i] + sizes[i];
  return offsets;
}

// One step between two peers: `send_len` bytes to `to` while `recv_len` arrive from `from`,
// cut into segments; at least one (possibly empty) exchange keeps both ends in lock step.
// With `reduce`, received bytes are combined with `local` into `dst`.
Status SegmentedStep(Transport& t, const AlgoConfig& cfg, size_t esize, int to,
                     const char* send, size_t send_len, int from, char* dst, const char* local,
                     size_t recv_len, const ReduceFn* reduce) {
  const size_t seg = std::max<size_t>(esize, cfg.segment_bytes / esize * esize);
  std::vector<SendPiece> sp(1);
  std::vector<RecvPiece> rp(1);
  size_t off = 0;
  do {
    const size_t sc = off < send_len ? std::min(seg, send_len - off) : 0;
    const size_t vc = off < recv_len ? std::min(seg, recv_len - off) : 0;
    sp[0] = SendPiece{send + off, sc};
    rp[0] = RecvPiece{dst + off, local == nullptr ? nullptr : local + off, vc};
    KR_RETURN_IF_ERROR(t.SendRecvPieces(to, sp, from, rp, esize, reduce, cfg.NextDeadline()));
    off += seg;
  } while (off < std::max(send_len, recv_len));
  return Status::OK();
}

}  // namespace

Status RingReduceScatter(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                         const void* input, void* output, const std::vector<size_t>& counts,
                         double prescale, double postscale) {
  const int n = t.size();
  const int r = t.rank();
  const size_t esize = DataTypeSize(dtype);
  const std::vector<size_t> at = Offsets(counts);  // in elements
  const char* in = static_cast<const char*>(input);
  std::vector<char> scaled;
  if (prescale != 1.0 && at.back() > 0) {
    scaled.assign(in, in + at.back() * esize);
    Scale(dtype, scaled.data(), at.back(), prescale);
    in = scaled.data();
  }
  const size_t mine = counts[static_cast<size_t>(r)];
  if (n == 1) {
    if (mine > 0) std::memmove(output, in, mine * esize);
    FinishReduction(dtype, op, output, mine, n, postscale);
    return Status::OK();
  }
  // Step k sends span r-k-1 (the input's at k = 0, else what arrived at step k-1) and
  // combines span r-k-2 arriving from the left with the input's; the last step (k = n-2)
  // receives span r, finished into the output.
  const size_t largest = *std::max_element(counts.begin(), counts.end()) * esize;
  std::vector<char> buf[2];
  for (auto& b : buf) b.resize(n > 2 ? largest : 0);
  const ReduceFn partial = Combiner{dtype, op, esize, false, /*finish=*/false, n, postscale};
  const ReduceFn last = Combiner{dtype, op, esize, false, /*finish=*/true, n, postscale};
  for (int step = 0; step < n - 1; ++step) {
    const size_t s = static_cast<size_t>(Mod(r - step - 1, n));
    const size_t v = static_cast<size_t>(Mod(r - step - 2, n));
    const bool final_step = step == n - 2;
    const char* send = step == 0 ? in + at[s] * esize : buf[(step - 1) % 2].data();
    char* dst = final_step ? static_cast<char*>(output) : buf[step % 2].data();
    KR_RETURN_IF_ERROR(SegmentedStep(t, cfg, esize, Mod(r + 1, n), send, counts[s] * esize,
                                     Mod(r - 1, n), dst, in + at[v] * esize, counts[v] * esize,
                                     final_step ? &last : &partial));
  }
  return Status::OK();
}

Status PairwiseAlltoall(Transport& t, const AlgoConfig& cfg, const void* input,
                        const std::vector<size_t>& send_bytes, void* output,
                        const std::vector<size_t>& recv_bytes) {
  const int n = t.size();
  const int r = t.rank();
  const std::vector<size_t> send_at = Offsets(send_bytes);
  const std::vector<size_t> recv_at = Offsets(recv_bytes);
  const char* in = static_cast<const char*>(input);
  char* out = static_cast<char*>(output);
  const size_t self = static_cast<size_t>(r);
  if (recv_bytes[self] > 0) std::memcpy(out + recv_at[self], in + send_at[self], recv_bytes[self]);
  for (int k = 1; k < n; ++k) {
    const size_t to = static_cast<size_t>(Mod(r + k, n));
    const size_t from = static_cast<size_t>(Mod(r - k, n));
    KR_RETURN_IF_ERROR(SegmentedStep(t, cfg, 1, static_cast<int>(to), in + send_at[to],
                                     send_bytes[to], static_cast<int>(from), out + recv_at[from],
                                     nullptr, recv_bytes[from], nullptr));
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
      KR_RETURN_IF_ERROR(t.Recv(left, base + off, len, cfg.NextDeadline()));
    }
    if (pos < n - 1) {
      KR_RETURN_IF_ERROR(t.Send(right, base + off, len, cfg.NextDeadline()));
    }
  }
  return Status::OK();
}

}  // namespace keras_ring
