// Collective algorithms written only against Transport. Each takes a per-wait timeout: any
// single wait for a peer is bounded, while a long transfer that keeps moving is not cut off.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common.h"
#include "transport.h"

namespace keras_ring {

struct AlgoConfig {
  double timeout_seconds = 300.0;
  size_t segment_bytes = 1 << 20;  // unit of one transfer step; bounds scratch memory
  // Allreduce outputs at least this large are written with non-temporal stores: they cannot
  // stay in cache anyway, and skipping the read-for-ownership nearly halves the traffic.
  size_t stream_bytes = 32 << 20;
  bool may_yield = false;  // see Deadline::may_yield
  // Collectives open with the fast agreement (fast_agree.h) before falling back to the full
  // signature exchange. Must be equal on all ranks: it decides the first message's shape.
  bool fast_agree = true;
  // Allreduces of at most this many bytes run by recursive doubling (log2 n rounds of the
  // whole vector) instead of the ring (2(n-1) rounds of 1/n of it), after a fast agreement.
  // 32 KiB: below it doubling won or tied at 2 and 4 ranks on shm and TCP, at 64 KiB it lost
  // on a quiet machine (docs/performance.md, benchmarks/allreduce_paths.cc).
  size_t doubling_max_bytes = 32 << 10;

  // The bound of one wait: every step of an algorithm gets a fresh one.
  Deadline NextDeadline() const { return Deadline::After(timeout_seconds).Yielding(may_yield); }
};

// In-place ring allreduce (reduce-scatter, then allgather) of `count` elements at `buf`.
// prescale is applied before the reduction, postscale (and 1/size for Average) after it, on
// the chunk this rank owns, so every rank ends with bitwise identical results.
Status RingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                     void* buf, size_t count, double prescale, double postscale);
// Out of place: `input` is only read (it may equal `output`).
Status RingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                     const void* input, void* output, size_t count, double prescale,
                     double postscale);

// One tensor of a fused allreduce: `count` elements read from `input` and written to
// `output` (which may equal input).
struct Part {
  const void* input;
  void* output;
  size_t count;
};

// Allreduce of several tensors of one dtype as one vector, without packing them: each ring
// segment travels as pieces cut at the tensors' boundaries.
Status RingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                     std::vector<Part> parts, double prescale, double postscale);

// Ring allgather of blocks of different sizes: block r (block_bytes[r] bytes) belongs to
// rank r, blocks lie back to back in rank order in `out`, and this rank's block must
// already be in place.
// `steps_done`, if given, counts completed steps (block r-1-k has arrived after k+1 steps).
Status RingAllgatherv(Transport& t, const AlgoConfig& cfg, void* out,
                      const std::vector<size_t>& block_bytes,
                      std::atomic<int>* steps_done = nullptr);

// Allgather of equal blocks in one round: every rank sends its block (block `rank` of
// `out`) to every other rank, then receives theirs, from rank-1 downwards. The latency is one
// hop instead of n-1 chained ring steps. Requires t.BufferedSendBytes() >= block_bytes, so
// that no send waits for a peer that is itself still sending. `steps_done` counts blocks
// received (block r-k has arrived after k).
Status DirectAllgather(Transport& t, const AlgoConfig& cfg, void* out, size_t block_bytes,
                       std::atomic<int>* steps_done = nullptr);

// Ring reduce-scatter: every rank holds `counts` summed elements at `input` (the spans of
// ranks 0..n-1, back to back); rank r gets the reduction of its span, scaled like
// RingAllreduce's chunks, in `output` (counts[r] elements). The input is only read; the scratch
// is two of the largest span (three with a prescale, which needs a scaled copy of the input).
Status RingReduceScatter(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                         const void* input, void* output, const std::vector<size_t>& counts,
                         double prescale, double postscale);

// Personalized all-to-all in n-1 pairwise rounds (round k: send to rank+k, receive from
// rank-k). Block p of `input` (send_bytes[p] bytes, blocks back to back in rank order) goes to
// rank p; block p of `output` (recv_bytes[p]) comes from rank p. The own block is copied.
Status PairwiseAlltoall(Transport& t, const AlgoConfig& cfg, const void* input,
                        const std::vector<size_t>& send_bytes, void* output,
                        const std::vector<size_t>& recv_bytes);

// Pipelined chain broadcast: root -> root+1 -> ... in segments. `buf` holds the data on the
// root and receives it elsewhere.
Status ChainBroadcast(Transport& t, const AlgoConfig& cfg, void* buf, size_t bytes, int root);

}  // namespace keras_ring
