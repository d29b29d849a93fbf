// Recursive doubling: the exchange pattern behind the fast agreement and the short-vector
// allreduce. In round k rank v trades its whole state with v ^ 2^k, so after log2(p) rounds
// (p the largest power of two <= n) every rank's state covers every rank, with one message
// per round per rank instead of the ring's n-1 chained steps. The n - p "extra" ranks first
// fold their state into rank (extra - p) and get the finished state back at the end.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <vector>

#include "algorithms.h"
#include "common.h"
#include "transport.h"

namespace keras_ring {

// The largest power of two <= n (n >= 1).
int PowerOfTwoBelow(int n);

// The ranks whose contributions a state holds: the core ranks [first, first + len) with their
// extras (rank + p), or a single rank (an extra folding in).
struct Held {
  int first = 0;
  int len = 0;
  int n = 1;
  bool single = false;
  bool Contains(int rank) const;
};

// Combines the peer's state with this rank's. `lower` is the state of the ranks that come
// first (it holds the lower ranks): combining lower with upper, never the reverse, gives
// both ends of a pair the same bits. Returns the buffer that holds the result (one of the
// two); the other becomes the next round's receive buffer.
using DoublingCombine =
    std::function<char*(char* mine, char* peer, bool mine_is_lower, const Held& peer_holds)>;

// Runs the exchange on states sent as framed messages (Transport::SendRecvFramed): a
// `head` that `length` reads a state's length from, up to `capacity`, so a state carries only
// the bytes it uses. `state` holds this rank's, `scratch` is `capacity` long too. On return
// *result points at the finished state (state or scratch). Every wait at depth d
// (fold-in 0, round k at k + 1, the extras' wait for the result last) is bounded by the
// timeout plus d * DepthMargin: a stalled rank's direct waiters give up first, and their
// error, which names it, reaches the ranks that wait on it indirectly before their own
// deadline would make them blame an innocent partner. `progress` counts completed receives.
Status RecursiveDoubling(Transport& t, const AlgoConfig& cfg, char* state, char* scratch,
                         size_t head, size_t capacity, const FrameLength& length,
                         const DoublingCombine& combine, char** result,
                         std::atomic<int>* progress = nullptr, int* waited_on = nullptr);

// The extra bound per depth of a recursive-doubling wait (see above).
double DepthMargin(double timeout_seconds);

// The ranks (other than `rank`) whose contributions had not reached `rank` after `progress`
// completed receives of RecursiveDoubling: the stalled rank is among them.
std::vector<int> DoublingNotHeardFrom(int rank, int n, int progress);

// Allreduce by recursive doubling on whole vectors: log2(n) (+2) rounds of `count` elements,
// against the ring's 2(n-1) rounds of count/n. Faster while a round's latency outweighs its
// bytes (short vectors); every rank combines the same pairs in the same order, so all end
// with the same bits. `scratch` is resized to the vector's bytes.
Status DoublingAllreduce(Transport& t, const AlgoConfig& cfg, DataType dtype, ReduceOp op,
                         const void* input, void* output, size_t count, double prescale,
                         double postscale, std::vector<char>* scratch);

}  // namespace keras_ring
