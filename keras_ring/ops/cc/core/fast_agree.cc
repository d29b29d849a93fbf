#include "fast_agree.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "reduce.h"

namespace keras_ring {
namespace {

// The words of a signature that CheckSignatures compares for its kind (FieldsFor), in one
// order. A field compared there but missing here would let a mismatch through; a field here
// that is not compared there only costs a fallback to the full exchange.
std::vector<uint64_t> ComparedWords(const Signature& s) {
  std::vector<uint64_t> w;
  auto bits = [](double d) {
    uint64_t u;
    std::memcpy(&u, &d, sizeof u);
    return u;
  };
  const Kind kind = static_cast<Kind>(s.kind);
  w.push_back(static_cast<uint64_t>(s.kind));
  for (size_t i = 0; i < sizeof s.name; i += 8) {
    uint64_t u;
    std::memcpy(&u, s.name + i, sizeof u);  // SetName zero-fills: no stale bytes
    w.push_back(u);
  }
  w.push_back(s.seq);
  if (kind == Kind::kBarrier) return w;
  w.push_back(static_cast<uint64_t>(s.device));
  if (s.device) {
    w.push_back(static_cast<uint64_t>(s.comm));
    w.push_back(static_cast<uint64_t>(s.comm_new));
  }
  w.push_back(static_cast<uint64_t>(s.dtype));
  if (kind == Kind::kAllreduce || kind == Kind::kGroupedAllreduce ||
      kind == Kind::kReducescatter) {
    w.push_back(static_cast<uint64_t>(s.reduce_op));
    w.push_back(bits(s.prescale));
    w.push_back(bits(s.postscale));
  }
  if (kind == Kind::kBroadcast) w.push_back(static_cast<uint64_t>(s.root));
  // The shape; allgather's rows too, which the full check lets differ (allgatherv): equal
  // rows are what lets a fast agreement stand in for the table of every rank's signature.
  w.push_back(static_cast<uint64_t>(s.count));
  w.push_back(static_cast<uint64_t>(s.row_elems));
  w.push_back(static_cast<uint64_t>(s.ndims));
  w.push_back(s.layout_hash);
  for (int64_t d : s.dims) w.push_back(static_cast<uint64_t>(d));
  return w;
}

uint64_t Fnv(const std::vector<uint64_t>& words, uint64_t h) {
  for (uint64_t v : words) h = HashMix(h, v);
  return h;
}

// A second, unrelated digest (multiply-xorshift, as in splitmix64), so that a collision
// would have to hit both.
uint64_t SplitMix(const std::vector<uint64_t>& words, uint64_t h) {
  for (uint64_t v : words) {
    h += v + 0x9e3779b97f4a7c15ull;
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
  }
  return h;
}

}  // namespace

void DigestSignature(const Signature& s, int size, uint64_t config, uint64_t digest[2],
                     uint32_t* flags) {
  std::vector<uint64_t> words = ComparedWords(s);
  words.push_back(config);
  digest[0] = Fnv(words, 1469598103934665603ull);
  digest[1] = SplitMix(words, 0x243f6a8885a308d3ull);
  const Kind kind = static_cast<Kind>(s.kind);
  *flags = 0;
  if (kind == Kind::kJoin || kind == Kind::kAlltoall) *flags |= kFastNeedsTable;
  if (kind == Kind::kReducescatter && s.ndims == 0) *flags |= kFastNeedsTable;  // a scalar
  if (kind == Kind::kBroadcast && (s.root < 0 || s.root >= size)) *flags |= kFastNeedsTable;
  if (s.concurrent) *flags |= kFastNeedsTable;  // CheckArguments fails it on every rank
  // NaN compares unequal to itself in the full check, while its bits digest equal.
  if (std::isnan(s.prescale) || std::isnan(s.postscale)) *flags |= kFastNeedsTable;
}

size_t FastRideLimit(const AlgoConfig& cfg, const Transport& t) {
  size_t limit = std::min(cfg.doubling_max_bytes, kFastPayloadBytes);
  // Riding saves the rounds of a doubling of its own and costs a copy of the data per round
  // (received whole, then reduced; a doubling reduces straight out of a shm ring). With one
  // round of a few µs that copy costs more than it saves from 16 KiB on (C++ bench, 2 ranks
  // on shm, agreement + doubling / riding, µs: 16 KiB 8.4-9.1 / 9.2-10.9, 32 KiB 12.4-14.6 /
  // 15.6-17.6); over tcp, or with more rounds, riding wins at every size up to 32 KiB.
  if (t.size() == 2 && t.ReadsInPlace(1 - t.rank())) limit = std::min<size_t>(limit, 8 << 10);
  return std::max<size_t>(4096, limit);
}

FastAgreement::Ride FastAgreement::Pack(const Request& r, int rank, int size, size_t limit,
                                        FastMessage* msg) const {
  if (r.placement != Placement::kHost) return Ride::kNone;
  size_t bytes = 0;
  for (const TensorRef& t : r.tensors) bytes += t.num_bytes();
  char* payload = msg->payload;
  Ride ride = Ride::kNone;
  switch (r.kind) {
    case Kind::kAllreduce:
    case Kind::kGroupedAllreduce:
    case Kind::kReducescatter: {
      if (bytes > limit) return Ride::kNone;
      size_t off = 0;
      for (const TensorRef& t : r.tensors) {
        if (t.num_bytes() == 0) continue;
        std::memcpy(payload + off, t.input, t.num_bytes());
        Scale(t.dtype, payload + off, static_cast<size_t>(t.num_elements()), r.prescale);
        off += t.num_bytes();
      }
      ride = Ride::kReduce;
      break;
    }
    case Kind::kBroadcast:
      if (bytes > limit) return Ride::kNone;
      if (rank == r.root && bytes > 0) std::memcpy(payload, r.tensors[0].input, bytes);
      ride = Ride::kBroadcast;
      break;
    case Kind::kAllgather: {
      // Equal rows on every rank (the digest says so once agreed): block q at q * bytes.
      if (bytes * static_cast<size_t>(size) > limit) return Ride::kNone;
      if (bytes > 0) {
        std::memcpy(payload + static_cast<size_t>(rank) * bytes, r.tensors[0].input, bytes);
      }
      bytes *= static_cast<size_t>(size);
      ride = Ride::kAllgather;
      break;
    }
    default:
      return Ride::kNone;
  }
  msg->header.payload_bytes = static_cast<uint32_t>(bytes);
  return ride;
}

void FastAgreement::PackAhead(const FastLookahead& ahead, int size, uint64_t config,
                              FastMessage* msg) const {
  auto* slots = reinterpret_cast<FastAheadSlot*>(msg->payload);
  size_t k = 0;
  for (const Signature& s : ahead.next) {
    if (k == kMaxAhead) break;
    uint64_t digest[2];
    uint32_t flags = 0;
    DigestSignature(s, size, config, digest, &flags);
    if (flags != 0) break;  // only the full exchange can agree on it: it gets its own round
    for (int i = 0; i < 2; ++i) slots[k].lo[i] = slots[k].hi[i] = digest[i];
    ++k;
  }
  msg->header.ahead = k;
  msg->header.payload_bytes = static_cast<uint32_t>(k * sizeof(FastAheadSlot));
}

char* FastAgreement::Combine(Ride ride, const Request& r, char* mine, char* peer,
                             bool mine_is_lower, const Held& peer_holds) const {
  FastHeader& a = reinterpret_cast<FastMessage*>(mine)->header;
  FastHeader& b = reinterpret_cast<FastMessage*>(peer)->header;
  for (int i = 0; i < 2; ++i) {
    a.lo[i] = std::min(a.lo[i], b.lo[i]);
    a.hi[i] = std::max(a.hi[i], b.hi[i]);
  }
  a.flags |= b.flags;
  // The count first, whatever this rank's ride: the verdict reads it only where every rank
  // submitted the same collective, hence took the same ride and merged the same slots.
  a.ahead = std::min(a.ahead, b.ahead);
  if (ride == Ride::kAhead) {
    const size_t k = std::min<size_t>(a.ahead, kMaxAhead);
    auto* mine_slots = reinterpret_cast<FastAheadSlot*>(reinterpret_cast<FastMessage*>(mine)->payload);
    const auto* peer_slots =
        reinterpret_cast<const FastAheadSlot*>(reinterpret_cast<FastMessage*>(peer)->payload);
    for (size_t j = 0; j < k; ++j) {
      for (int i = 0; i < 2; ++i) {
        mine_slots[j].lo[i] = std::min(mine_slots[j].lo[i], peer_slots[j].lo[i]);
        mine_slots[j].hi[i] = std::max(mine_slots[j].hi[i], peer_slots[j].hi[i]);
      }
    }
    a.payload_bytes = static_cast<uint32_t>(k * sizeof(FastAheadSlot));
    return mine;
  }
  // Both ends of the pair decide alike: equal data combines, anything else stops the data
  // (a mismatch the digests will show, or a rank whose data did not ride).
  if (a.payload_bytes != b.payload_bytes) a.flags |= kFastNoData;
  if (ride == Ride::kNone || (a.flags & kFastNoData) != 0) {
    a.payload_bytes = 0;
    return mine;
  }
  char* my_data = reinterpret_cast<FastMessage*>(mine)->payload;
  char* peer_data = reinterpret_cast<FastMessage*>(peer)->payload;
  switch (ride) {
    case Ride::kNone:
    case Ride::kAhead:
      break;
    case Ride::kReduce: {
      // The lower ranks' partial first, on both ends of the pair: the same bits on both.
      // Reduce's destination may be its first operand only, so the upper end reduces into
      // the peer's buffer and takes the header there: that buffer holds the result.
      char* dst = mine_is_lower ? my_data : peer_data;
      const char* upper = mine_is_lower ? peer_data : my_data;
      size_t off = 0;
      for (const TensorRef& t : r.tensors) {
        const size_t count = static_cast<size_t>(t.num_elements());
        if (count == 0) continue;
        Reduce(t.dtype, r.op, dst + off, dst + off, upper + off, count);
        off += t.num_bytes();
      }
      if (mine_is_lower) break;
      b = a;
      return peer;
    }
    case Ride::kBroadcast:
      if (peer_holds.Contains(r.root)) {
        std::memcpy(my_data, peer_data, r.tensors[0].num_bytes());
      }
      break;
    case Ride::kAllgather: {
      const size_t bytes = r.tensors[0].num_bytes();
      for (int q = 0; q < peer_holds.n; ++q) {
        if (!peer_holds.Contains(q)) continue;
        const size_t at = static_cast<size_t>(q) * bytes;
        std::memcpy(my_data + at, peer_data + at, bytes);
      }
      break;
    }
  }
  return mine;
}

Status FastAgreement::Deliver(Ride ride, const Signature& mine, Request& r, int rank, int size,
                              char* payload) {
  switch (ride) {
    case Ride::kNone:
    case Ride::kAhead:
      return Status::OK();
    case Ride::kReduce: {
      if (r.kind == Kind::kReducescatter) {
        const TensorRef& t = r.tensors[0];
        const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
        const int64_t row_elems = rows == 0 ? 0 : t.num_elements() / rows;
        const std::vector<int64_t> parts = ReducescatterRows(rows, size);
        int64_t first = 0;
        for (int q = 0; q < rank; ++q) first += parts[static_cast<size_t>(q)];
        const size_t esize = DataTypeSize(t.dtype);
        char* mine = payload + static_cast<size_t>(first * row_elems) * esize;
        const size_t count = static_cast<size_t>(parts[static_cast<size_t>(rank)] * row_elems);
        FinishReduction(t.dtype, r.op, mine, count, size, r.postscale);
        if (count > 0) std::memcpy(t.output, mine, count * esize);
        return Status::OK();
      }
      size_t off = 0;
      for (TensorRef& t : r.tensors) {
        if (t.num_bytes() == 0) continue;
        FinishReduction(t.dtype, r.op, payload + off, static_cast<size_t>(t.num_elements()),
                        size, r.postscale);
        std::memcpy(t.output, payload + off, t.num_bytes());
        off += t.num_bytes();
      }
      return Status::OK();
    }
    case Ride::kBroadcast: {
      TensorRef& t = r.tensors[0];
      if (t.num_bytes() > 0) std::memcpy(t.output, payload, t.num_bytes());
      return Status::OK();
    }
    case Ride::kAllgather: {
      TensorRef& t = r.tensors[0];
      void* out = nullptr;
      KR_RETURN_IF_ERROR(r.allocate_output(mine.count * size, &out));  // nothing in flight
      const size_t bytes = t.num_bytes() * static_cast<size_t>(size);
      if (bytes > 0) std::memcpy(out, payload, bytes);
      return Status::OK();
    }
  }
  return Status::OK();
}

Status FastAgreement::Run(Transport& t, const AlgoConfig& cfg, uint64_t config,
                          const Request& request, Request* deliver, const Signature& mine,
                          bool* agreed, bool* delivered, std::atomic<int>* progress,
                          int* waited_on, FastLookahead* ahead) {
  FastMessage& msg = buf_[0];
  uint64_t digest[2];
  DigestSignature(mine, t.size(), config, digest, &msg.header.flags);
  for (int i = 0; i < 2; ++i) msg.header.lo[i] = msg.header.hi[i] = digest[i];
  msg.header.payload_bytes = 0;
  msg.header.ahead = 0;
  Ride ride = Ride::kNone;
  if (ahead != nullptr) {
    ahead->agreed = 0;
    PackAhead(*ahead, t.size(), config, &msg);
    ride = Ride::kAhead;
  } else if (deliver != nullptr) {
    ride = Pack(request, t.rank(), t.size(), FastRideLimit(cfg, t), &msg);
  }
  const DoublingCombine combine = [&](char* a, char* b, bool lower, const Held& held) {
    return Combine(ride, request, a, b, lower, held);
  };
  const FrameLength length = [](const void* head) {
    return sizeof(FastHeader) + static_cast<const FastHeader*>(head)->payload_bytes;
  };
  char* result = nullptr;
  KR_RETURN_IF_ERROR(RecursiveDoubling(
      t, cfg, reinterpret_cast<char*>(&buf_[0]), reinterpret_cast<char*>(&buf_[1]),
      sizeof(FastHeader), sizeof(FastMessage), length, combine, &result, progress, waited_on));
  const FastHeader& h = reinterpret_cast<const FastMessage*>(result)->header;
  *agreed = (h.flags & kFastNeedsTable) == 0 && h.lo[0] == h.hi[0] && h.lo[1] == h.hi[1];
  *delivered = false;
  if (*agreed && ride == Ride::kAhead) {
    // The leading slots equal on every rank: those collectives are agreed as this one is.
    const auto* slots = reinterpret_cast<const FastAheadSlot*>(
        reinterpret_cast<const FastMessage*>(result)->payload);
    const size_t k = std::min<size_t>(h.ahead, kMaxAhead);
    while (ahead->agreed < k && slots[ahead->agreed].lo[0] == slots[ahead->agreed].hi[0] &&
           slots[ahead->agreed].lo[1] == slots[ahead->agreed].hi[1]) {
      ++ahead->agreed;
    }
    return Status::OK();
  }
  if (!*agreed || ride == Ride::kNone || (h.flags & kFastNoData) != 0) return Status::OK();
  KR_RETURN_IF_ERROR(Deliver(ride, mine, *deliver, t.rank(), t.size(),
                             reinterpret_cast<FastMessage*>(result)->payload));
  *delivered = true;
  return Status::OK();
}

}  // namespace keras_ring
