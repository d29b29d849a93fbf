#include "host_executor.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "reduce.h"

namespace keras_ring {
namespace {

void CopyIfDistinct(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes > 0) std::memcpy(dst, src, bytes);
}

// A ring allreduce's passes in a slot payload, for a joined rank that must add zeros to it:
// [passes][(dtype, elements) per pass], one pass per dtype in order of first appearance, as
// the grouped allreduce runs them.
struct Pass {
  int64_t dtype;
  int64_t count;
};

void DescribeLayout(const Request& r, Slot* slot) {
  std::vector<Pass> passes;
  for (const TensorRef& t : r.tensors) {
    auto it = std::find_if(passes.begin(), passes.end(), [&](const Pass& p) {
      return p.dtype == static_cast<int64_t>(t.dtype);
    });
    if (it == passes.end()) {
      passes.push_back(Pass{static_cast<int64_t>(t.dtype), t.num_elements()});
    } else {
      it->count += t.num_elements();
    }
  }
  const int64_t n = static_cast<int64_t>(passes.size());  // at most kNumDataTypes: fits
  std::memcpy(slot->payload, &n, sizeof n);
  std::memcpy(slot->payload + sizeof n, passes.data(), passes.size() * sizeof(Pass));
}

std::vector<Pass> ReadLayout(const char* payload) {
  int64_t n = 0;
  std::memcpy(&n, payload, sizeof n);
  std::vector<Pass> passes(static_cast<size_t>(n));
  std::memcpy(passes.data(), payload + sizeof n, passes.size() * sizeof(Pass));
  return passes;
}

}  // namespace

HostExecutor::HostExecutor(int rank, int size, Transport& transport, const AlgoConfig& algo)
    : rank_(rank), size_(size), transport_(transport), algo_(algo),
      slots_(static_cast<size_t>(size)) {}

AlgoConfig HostExecutor::ConfigFor(const Request& request) const {
  AlgoConfig cfg = algo_;
  cfg.may_yield = request.may_yield;
  return cfg;
}

Status HostExecutor::Agree(const Request& request, uint64_t seq, std::vector<Signature>* sigs,
                           bool* all_inlined, FastLookahead* ahead) {
  Agreement how;
  KR_RETURN_IF_ERROR(AgreeOn(request, seq, nullptr, /*want_sigs=*/true, sigs, &how, ahead));
  *all_inlined = how.inlined;
  return Status::OK();
}

uint64_t HostExecutor::ConfigWord() const {
  constexpr uint64_t kProtocol = 1;  // bump when what follows a fast agreement changes
  return HashMix(kProtocol, static_cast<uint64_t>(algo_.doubling_max_bytes));
}

Status HostExecutor::FastAgree(const Request& request, uint64_t seq, Request* deliver,
                               bool* agreed, bool* delivered, FastLookahead* ahead) {
  const Signature mine = SignatureOf(request, seq);
  int waited_on = -1;
  fast_progress_.store(0);
  Status s = fast_.Run(transport_, ConfigFor(request), ConfigWord(), request, deliver, mine,
                       agreed, delivered, &fast_progress_, &waited_on, ahead);
  if (!s.ok()) s = PassOnBlame(s, mine.Label());  // while the progress is still known
  fast_progress_.store(-1);
  if (s.code() == Code::kDeadlineExceeded && s.reporter() < 0 && waited_on >= 0) {
    // Our own wait on a partner that has not submitted (or waits itself on one that has
    // not: the deeper waits last longer, so that one's direct waiter reports it first).
    return Status(Code::kDeadlineExceeded,
                  "timed out waiting for rank " + std::to_string(waited_on) + " to submit " +
                      mine.Label() +
                      " (it has not reached it, is stalled, runs a different program, or the "
                      "network to it drops what is sent)",
                  waited_on);
  }
  return s;
}

Status HostExecutor::AgreeOn(const Request& request, uint64_t seq, Request* deliver,
                             bool want_sigs, std::vector<Signature>* sigs, Agreement* how,
                             FastLookahead* ahead) {
  if (ahead != nullptr) ahead->agreed = 0;
  if (algo_.fast_agree && size_ > 1) {
    bool agreed = false;
    bool delivered = false;
    KR_RETURN_IF_ERROR(FastAgree(request, seq, deliver, &agreed, &delivered, ahead));
    if (agreed) {
      // Equal digests: every rank's signature is this one (up to what is shown, not compared).
      // Copied out only when wanted: n copies per collective would undo the O(log n).
      if (want_sigs) sigs->assign(static_cast<size_t>(size_), SignatureOf(request, seq));
      how->fast = true;
      how->inlined = delivered;
      return Status::OK();
    }
    // A miss, on every rank alike: the full exchange says what differs, or that nothing
    // does (an unnamed collective, uneven allgather rows, a join) and the collective runs.
  }
  Slot& mine = slots_[static_cast<size_t>(rank_)];
  mine.sig = SignatureOf(request, seq);
  mine.sig.inlined = PackInline(request, &mine) ? 1 : 0;
  exchange_steps_.store(0);
  Status s = ExchangeSlots(transport_, ConfigFor(request), &slots_, &exchange_steps_);
  if (!s.ok()) s = PassOnBlame(s, mine.sig.Label());
  const int steps = exchange_steps_.exchange(-1);
  if (s.code() == Code::kDeadlineExceeded && s.reporter() < 0) {
    s = BlameForExchangeTimeout(request, seq, steps);  // our own wait, not a relayed notice
  }
  if (!s.ok()) return s;
  sigs->clear();
  how->fast = false;
  how->inlined = true;
  for (const Slot& slot : slots_) {
    sigs->push_back(slot.sig);
    how->inlined = how->inlined && slot.sig.inlined != 0;
  }
  return CheckSignatures(*sigs);
}

bool HostExecutor::NotYetHeardFrom(std::vector<int>* missing) const {
  const int fast = fast_progress_.load();
  if (fast >= 0) {
    *missing = DoublingNotHeardFrom(rank_, size_, fast);
    return true;
  }
  const int steps = exchange_steps_.load();
  if (steps < 0) return false;
  // After k ring steps the slots of ranks r-1 .. r-k have arrived.
  missing->clear();
  for (int k = steps + 1; k < size_; ++k) missing->push_back(((rank_ - k) % size_ + size_) % size_);
  return true;
}

Status HostExecutor::PassOnBlame(const Status& s, const std::string& label) const {
  std::vector<int> missing;
  if (s.code() != Code::kDeadlineExceeded || s.reporter() < 0 || s.peer() != rank_ ||
      !NotYetHeardFrom(&missing) || missing.empty()) {
    return s;
  }
  std::string ranks;
  for (int q : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(q);
  return Status(Code::kDeadlineExceeded,
                "rank " + std::to_string(rank_) + " was still waiting in " + label +
                    " for ranks not yet heard from: " + ranks +
                    " (one of them is stalled, or the network to it is down) when rank " +
                    std::to_string(s.reporter()) + " gave up waiting for it",
                missing.front())
      .ReportedBy(s.reporter());
}

Status HostExecutor::Execute(Request& request, uint64_t seq, ExecutionStats* stats) {
  if (request.kind == Kind::kJoin) return ExecuteJoin(request, seq, stats);
  std::vector<Signature> sigs;
  Agreement how;
  // Of what follows, only an allgather reads the signatures after a fast agreement (its
  // blocks' sizes; it moves O(n) blocks anyway). Alltoall and join always miss it.
  KR_RETURN_IF_ERROR(
      AgreeOn(request, seq, &request, request.kind == Kind::kAllgather, &sigs, &how));
  stats->agreed = Clock::now();
  stats->inlined = how.inlined;
  if (how.inlined) return how.fast ? Status::OK() : ExecuteInline(request, sigs);
  switch (request.kind) {
    case Kind::kAllreduce: return ExecuteAllreduce(request, how.fast);
    case Kind::kGroupedAllreduce: return ExecuteGrouped(request);
    case Kind::kAllgather: return ExecuteAllgather(request, sigs);
    case Kind::kBroadcast: return ExecuteBroadcast(request);
    case Kind::kBarrier: return Status::OK();
    case Kind::kReducescatter: return ExecuteReducescatter(request);
    case Kind::kAlltoall: return ExecuteAlltoall(request, sigs);
    case Kind::kJoin: break;  // handled above
  }
  return Status::OK();
}

// The ring exchange stalls at the first rank that has not submitted the collective: after
// k completed steps this rank has heard from ranks r-1 .. r-k, so it waits for rank r-k-1
// (possibly through live ranks that have nothing to forward yet). Blaming that rank, not
// the neighbour, makes every waiting rank name the same stalled one.
Status HostExecutor::BlameForExchangeTimeout(const Request& request, uint64_t seq,
                                             int steps) const {
  const int blamed = ((rank_ - std::max(steps, 0) - 1) % size_ + size_) % size_;
  return Status(Code::kDeadlineExceeded,
                "timed out waiting for rank " + std::to_string(blamed) + " to submit " +
                    SignatureOf(request, seq).Label() +
                    " (it has not reached it, is stalled, runs a different program, or the "
                    "network to it drops what is sent)",
                blamed);
}

bool HostExecutor::PackInline(const Request& r, Slot* slot) const {
  if (r.kind == Kind::kAlltoall) {
    // Not the data but the splits ride along: [count][splits...], checked after the exchange
    // (on either placement: the splits are in host memory, and NCCL's alltoall needs them).
    const int64_t n = r.splits.size() <= kMaxInlineSplits ? static_cast<int64_t>(r.splits.size()) : -1;
    std::memcpy(slot->payload, &n, sizeof n);
    if (n > 0) std::memcpy(slot->payload + sizeof n, r.splits.data(), r.splits.size() * sizeof n);
    return false;
  }
  if (r.placement != Placement::kHost) return false;  // pointers into device memory
  if (r.kind == Kind::kJoin) {
    // Zeros of any size up to the capacity: what a joined rank adds to a small allreduce.
    std::memset(slot->payload, 0, sizeof slot->payload);
    return true;
  }
  size_t bytes = 0;
  for (const TensorRef& t : r.tensors) bytes += t.num_bytes();
  if (bytes > kInlineCapacity) {
    if (r.kind == Kind::kAllreduce || r.kind == Kind::kGroupedAllreduce) DescribeLayout(r, slot);
    return false;
  }
  if (r.kind == Kind::kBroadcast && rank_ != r.root) return true;  // receives only
  size_t off = 0;
  for (const TensorRef& t : r.tensors) {
    if (t.num_bytes() > 0) std::memcpy(slot->payload + off, t.input, t.num_bytes());
    off += t.num_bytes();
  }
  return true;
}

// Every rank combines the ranks' contributions in rank order, so all get the same bits.
void HostExecutor::ReduceInline(const Request& r, DataType dtype, size_t offset, size_t count,
                                void* out) {
  const size_t bytes = count * DataTypeSize(dtype);
  if (bytes == 0) return;
  std::memcpy(out, slots_[0].payload + offset, bytes);
  Scale(dtype, out, count, r.prescale);
  for (size_t rank = 1; rank < slots_.size(); ++rank) {
    const void* peer = slots_[rank].payload + offset;
    if (r.prescale != 1.0) {
      scratch_.resize(bytes);
      std::memcpy(scratch_.data(), peer, bytes);
      Scale(dtype, scratch_.data(), count, r.prescale);
      peer = scratch_.data();
    }
    Reduce(dtype, r.op, out, peer, count);
  }
  FinishReduction(dtype, r.op, out, count, size_, r.postscale);
}

Status HostExecutor::ExecuteInline(Request& r, const std::vector<Signature>& sigs) {
  switch (r.kind) {
    case Kind::kAllreduce:
    case Kind::kGroupedAllreduce: {
      size_t offset = 0;
      for (TensorRef& t : r.tensors) {
        ReduceInline(r, t.dtype, offset, static_cast<size_t>(t.num_elements()), t.output);
        offset += t.num_bytes();
      }
      return Status::OK();
    }
    case Kind::kAllgather: {
      TensorRef& t = r.tensors[0];
      int64_t rows = 0;
      for (const Signature& s : sigs) rows += s.count;
      void* out = nullptr;
      KR_RETURN_IF_ERROR(r.allocate_output(rows, &out));  // nothing is in flight: not fatal
      char* dst = static_cast<char*>(out);
      for (size_t rank = 0; rank < sigs.size(); ++rank) {
        const size_t bytes =
            static_cast<size_t>(sigs[rank].count * sigs[rank].row_elems) * DataTypeSize(t.dtype);
        if (bytes > 0) std::memcpy(dst, slots_[rank].payload, bytes);
        dst += bytes;
      }
      return Status::OK();
    }
    case Kind::kBroadcast: {
      TensorRef& t = r.tensors[0];
      if (t.num_bytes() > 0) {
        std::memcpy(t.output, slots_[static_cast<size_t>(r.root)].payload, t.num_bytes());
      }
      return Status::OK();
    }
    case Kind::kReducescatter: {
      const std::vector<size_t> counts = ReducescatterCounts(r);
      size_t first = 0;
      for (int i = 0; i < rank_; ++i) first += counts[static_cast<size_t>(i)];
      const TensorRef& t = r.tensors[0];
      ReduceInline(r, t.dtype, first * DataTypeSize(t.dtype), counts[static_cast<size_t>(rank_)],
                   t.output);
      return Status::OK();
    }
    case Kind::kBarrier:
    case Kind::kAlltoall:  // never inlined
    case Kind::kJoin:      // runs its own exchanges
      return Status::OK();
  }
  return Status::OK();
}

Status HostExecutor::ExecuteAllreduce(Request& r, bool fast) {
  TensorRef& t = r.tensors[0];
  // Only after a fast agreement, whose digest covers doubling_max_bytes: ranks configured
  // differently miss it and all take the ring.
  if (fast && t.num_bytes() <= algo_.doubling_max_bytes) {
    return DoublingAllreduce(transport_, ConfigFor(r), t.dtype, r.op, t.input, t.output,
                             static_cast<size_t>(t.num_elements()), r.prescale, r.postscale,
                             &doubling_scratch_);
  }
  return RingAllreduce(transport_, ConfigFor(r), t.dtype, r.op, t.input, t.output,
                       static_cast<size_t>(t.num_elements()), r.prescale, r.postscale);
}

Status HostExecutor::ExecuteGrouped(Request& r) {
  // One ring pass per dtype, dtypes in order of first appearance, over the tensors where
  // they lie (no fusion buffer: the ring cuts its segments at the tensors' boundaries).
  std::vector<DataType> order;
  for (const TensorRef& t : r.tensors) {
    if (std::find(order.begin(), order.end(), t.dtype) == order.end()) order.push_back(t.dtype);
  }
  for (DataType dtype : order) {
    std::vector<Part> parts;
    for (TensorRef& t : r.tensors) {
      if (t.dtype == dtype) {
        parts.push_back(Part{t.input, t.output, static_cast<size_t>(t.num_elements())});
      }
    }
    KR_RETURN_IF_ERROR(RingAllreduce(transport_, ConfigFor(r), dtype, r.op, std::move(parts),
                                     r.prescale, r.postscale));
  }
  return Status::OK();
}

Status HostExecutor::ExecuteAllgather(Request& r, const std::vector<Signature>& sigs) {
  TensorRef& t = r.tensors[0];
  const size_t esize = DataTypeSize(t.dtype);
  int64_t total_rows = 0;
  std::vector<size_t> block_bytes;
  for (const Signature& s : sigs) {
    total_rows += s.count;
    block_bytes.push_back(static_cast<size_t>(s.count * s.row_elems) * esize);
  }
  void* out = nullptr;
  Status alloc = r.allocate_output(total_rows, &out);
  if (!alloc.ok()) {
    // Peers are about to exchange data with us; failing alone would leave them waiting.
    return Status(Code::kAborted, "could not allocate the allgather output: " + alloc.message());
  }
  size_t offset = 0;
  for (int i = 0; i < rank_; ++i) offset += block_bytes[static_cast<size_t>(i)];
  CopyIfDistinct(static_cast<char*>(out) + offset, t.input, t.num_bytes());
  return RingAllgatherv(transport_, ConfigFor(r), out, block_bytes);
}

Status HostExecutor::ExecuteBroadcast(Request& r) {
  TensorRef& t = r.tensors[0];
  if (rank_ == r.root) CopyIfDistinct(t.output, t.input, t.num_bytes());
  return ChainBroadcast(transport_, ConfigFor(r), t.output, t.num_bytes(), r.root);
}

std::vector<size_t> HostExecutor::ReducescatterCounts(const Request& r) const {
  const TensorRef& t = r.tensors[0];
  const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  const int64_t row_elems = rows == 0 ? 0 : t.num_elements() / rows;
  std::vector<size_t> counts;
  for (int64_t n : ReducescatterRows(rows, size_)) {
    counts.push_back(static_cast<size_t>(n * row_elems));
  }
  return counts;
}

Status HostExecutor::ExecuteReducescatter(Request& r) {
  const TensorRef& t = r.tensors[0];
  return RingReduceScatter(transport_, ConfigFor(r), t.dtype, r.op, t.input, t.output,
                           ReducescatterCounts(r), r.prescale, r.postscale);
}

namespace {

std::string Join(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return "[" + out + "]";
}

}  // namespace

Status HostExecutor::AlltoallSplits(const std::vector<Signature>& sigs,
                                    std::vector<std::vector<int64_t>>* splits) const {
  const std::string label = sigs[0].Label();
  splits->assign(static_cast<size_t>(size_), {});
  for (int p = 0; p < size_; ++p) {
    const char* payload = slots_[static_cast<size_t>(p)].payload;
    const int64_t rows = sigs[static_cast<size_t>(p)].count;
    int64_t n = 0;
    std::memcpy(&n, payload, sizeof n);
    auto& mine = (*splits)[static_cast<size_t>(p)];
    auto fail = [&](const std::string& why) {
      return Status(Code::kInvalidArgument, label + ": rank " + std::to_string(p) + " " + why, p);
    };
    if (n < 0) {
      return fail("passed more than " + std::to_string(kMaxInlineSplits) + " splits, more than "
                  "a signature slot carries: splits need one entry per rank (" +
                  std::to_string(size_) + " here), and explicit splits work up to " +
                  std::to_string(kMaxInlineSplits) + " ranks (equal parts, splits=None, at "
                  "any size)");
    }
    if (n == 0) {
      if (rows % size_ != 0) {
        return fail("has " + std::to_string(rows) + " rows, which do not split evenly over " +
                    std::to_string(size_) + " ranks; pass splits");
      }
      mine.assign(static_cast<size_t>(size_), rows / size_);
      continue;
    }
    mine.resize(static_cast<size_t>(n));
    std::memcpy(mine.data(), payload + sizeof n, mine.size() * sizeof n);
    int64_t sum = 0;
    bool negative = false;
    for (int64_t s : mine) {
      sum += s;
      negative = negative || s < 0;
    }
    if (n != size_ || negative || sum != rows) {
      return fail("passed splits " + Join(mine) + " for a tensor of " + std::to_string(rows) +
                  " rows; splits need one non-negative entry per rank (" +
                  std::to_string(size_) + ") summing to the rows");
    }
  }
  return Status::OK();
}

Status HostExecutor::ExecuteAlltoall(Request& r, const std::vector<Signature>& sigs) {
  std::vector<std::vector<int64_t>> splits;
  KR_RETURN_IF_ERROR(AlltoallSplits(sigs, &splits));
  const TensorRef& t = r.tensors[0];
  const size_t row_bytes = static_cast<size_t>(sigs[0].row_elems) * DataTypeSize(t.dtype);
  const size_t me = static_cast<size_t>(rank_);
  std::vector<size_t> send_bytes, recv_bytes;
  int64_t total_rows = 0;
  for (size_t p = 0; p < splits.size(); ++p) {
    send_bytes.push_back(static_cast<size_t>(splits[me][p]) * row_bytes);
    recv_bytes.push_back(static_cast<size_t>(splits[p][me]) * row_bytes);
    if (r.received_splits != nullptr) {
      r.received_splits[p] = static_cast<int32_t>(splits[p][me]);
    }
    total_rows += splits[p][me];
  }
  void* out = nullptr;
  Status alloc = r.allocate_output(total_rows, &out);
  if (!alloc.ok()) {
    return Status(Code::kAborted, "could not allocate the alltoall output: " + alloc.message());
  }
  return PairwiseAlltoall(transport_, ConfigFor(r), t.input, send_bytes, out, recv_bytes);
}

Status HostExecutor::ExecuteJoin(Request& request, uint64_t seq, ExecutionStats* stats) {
  Request round;
  round.kind = Kind::kJoin;
  round.name = "join";
  round.joined_at = seq;
  round.may_yield = request.may_yield;
  for (uint64_t s = seq;; ++s) {
    // Counted before the round: one that fails (a collective refused while ranks have
    // joined) was taken by every rank, and the next collective must follow it on all.
    stats->extra_seqs = s - seq;
    std::vector<Signature> sigs;
    bool all_inlined = false;
    KR_RETURN_IF_ERROR(Agree(round, s, &sigs, &all_inlined));  // joins miss the fast path
    const auto active = std::find_if(sigs.begin(), sigs.end(), [](const Signature& sig) {
      return static_cast<Kind>(sig.kind) != Kind::kJoin;
    });
    if (active == sigs.end()) {
      // Everyone joined: the last is the one that joined latest (the highest rank of those).
      int last = 0;
      for (size_t r = 1; r < sigs.size(); ++r) {
        if (sigs[r].count >= sigs[static_cast<size_t>(last)].count) last = static_cast<int>(r);
      }
      if (request.last_joined != nullptr) *request.last_joined = last;
      return Status::OK();
    }
    // The others completed it from the slots (this rank's zeros among them) or run the ring.
    if (!all_inlined) {
      const size_t ref = static_cast<size_t>(active - sigs.begin());
      KR_RETURN_IF_ERROR(AddZeros(round, *active, slots_[ref].payload));
    }
  }
}

Status HostExecutor::AddZeros(const Request& join, const Signature& ref, const char* ref_payload) {
  const ReduceOp op = static_cast<ReduceOp>(ref.reduce_op);
  for (const Pass& pass : ReadLayout(ref_payload)) {
    const DataType dtype = static_cast<DataType>(pass.dtype);
    scratch_.assign(static_cast<size_t>(pass.count) * DataTypeSize(dtype), 0);
    KR_RETURN_IF_ERROR(RingAllreduce(transport_, ConfigFor(join), dtype, op, scratch_.data(),
                                     static_cast<size_t>(pass.count), ref.prescale,
                                     ref.postscale));
  }
  return Status::OK();
}

}  // namespace keras_ring
