// The fast agreement: how a collective opens in steady state. Instead of allgathering every
// rank's full signature (O(n) messages and bytes per rank), the ranks reduce a fixed-size
// message by recursive doubling (log2 n rounds): two independent 64-bit digests of everything
// CheckSignatures compares, as (min, max) pairs, and flags for what only the full table can
// decide (join, alltoall splits, an out-of-range root). Every rank ends with the same reduced
// message, so every rank reaches the same verdict: all digests equal and no flag means every
// rank submitted the same collective; anything else sends ALL ranks to the full slot
// exchange, which names the differing field and ranks exactly as before.
//
// Small collectives ride along: their data (up to FastRideLimit) is combined in the same
// rounds (reduced, the root's copied, or gathered), and outputs are written only after the
// verdict, so a mismatch never delivers anything. Messages are framed: a collective whose
// data does not ride sends the 64-byte header alone.
//
// Device collectives look ahead instead: their data never rides, so the payload carries the
// digests of the device collectives queued behind this one (FastLookahead), reduced the same
// way with the least count of any rank. Where the collective agrees, the leading queued ones
// whose digests are equal on every rank are agreed too, and run without a round of their
// own: one round trip for a step's buckets instead of one per bucket.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "algorithms.h"
#include "doubling.h"
#include "request.h"
#include "signature.h"
#include "transport.h"

namespace keras_ring {

constexpr size_t kFastPayloadBytes = 64 << 10;  // the most data that may ride

// The most bytes of data that ride with `cfg` over `t`: what recursive doubling would move
// anyway (KERAS_RING_DOUBLING_MAX_BYTES), at least 4 KiB; 8 KiB where one round on a link
// that reduces in place is all the agreement takes (2 ranks on shm). Equal on every rank.
size_t FastRideLimit(const AlgoConfig& cfg, const Transport& t);

struct FastHeader {
  uint64_t lo[2];  // the smallest digest of any rank, per lane
  uint64_t hi[2];  // the largest
  uint32_t flags;  // OR of every rank's flags
  uint32_t payload_bytes = 0;  // the data that follows (equal on every rank, or 0)
  // The fewest queued collectives any rank digested in the payload. Builds before the
  // lookahead send 0 here (it was reserved, zeroed), so nothing is agreed ahead with them.
  uint64_t ahead = 0;
  uint64_t reserved[2] = {};
};
static_assert(sizeof(FastHeader) == 64, "the fast header has one layout on every rank");

struct FastMessage {
  FastHeader header;
  char payload[kFastPayloadBytes];
};

// One queued collective's digests in a lookahead payload, as (min, max) over the ranks.
struct FastAheadSlot {
  uint64_t lo[2];
  uint64_t hi[2];
};
constexpr size_t kMaxAhead = 63;  // a round agrees on 64 at most (device_max_in_flight's default)
static_assert(kMaxAhead * sizeof(FastAheadSlot) <= kFastPayloadBytes, "the slots fit");

// A device collective's lookahead: the signatures of the collectives queued behind it (with
// the seqs they will run as), and how many of them the round agreed.
struct FastLookahead {
  std::vector<Signature> next;
  size_t agreed = 0;
};

enum FastFlag : uint32_t {
  kFastNeedsTable = 1,  // something only the full exchange can check or carry
  kFastNoData = 2,      // some rank's data did not ride: agreed or not, nothing is delivered
};

// Two independent 64-bit digests of the fields CheckSignatures compares for `s` (and
// `config`, the settings that pick algorithms, so ranks configured differently never take
// different algorithms after a fast agreement); `flags` for what needs the full table.
void DigestSignature(const Signature& s, int size, uint64_t config, uint64_t digest[2],
                     uint32_t* flags);

class FastAgreement {
 public:
  // Agrees on `request` (signature `mine`). *agreed: every rank submitted the same
  // collective; *delivered: its data rode along and the outputs of `deliver` (the request
  // itself, or null: no data rides) are written, the collective is complete. Not agreed:
  // the caller runs the full slot exchange, on every rank alike. *waited_on names the peer
  // of a failed wait. With `ahead` (device collectives, never with `deliver`), ahead->agreed
  // says how many of ahead->next were agreed too (0 unless *agreed).
  Status Run(Transport& t, const AlgoConfig& cfg, uint64_t config, const Request& request,
             Request* deliver, const Signature& mine, bool* agreed, bool* delivered,
             std::atomic<int>* progress, int* waited_on, FastLookahead* ahead = nullptr);

 private:
  enum class Ride { kNone, kReduce, kBroadcast, kAllgather, kAhead };
  // Puts the digests of ahead's leading collectives that could agree fast into the payload.
  void PackAhead(const FastLookahead& ahead, int size, uint64_t config, FastMessage* msg) const;
  // Copies the data that rides into msg's payload and sets its length (left 0 if none).
  Ride Pack(const Request& r, int rank, int size, size_t limit, FastMessage* msg) const;
  char* Combine(Ride ride, const Request& r, char* mine, char* peer, bool mine_is_lower,
                const Held& peer_holds) const;
  Status Deliver(Ride ride, const Signature& mine, Request& r, int rank, int size,
                 char* payload);

  FastMessage buf_[2];
};

}  // namespace keras_ring
