// What each rank says it is about to do. Signatures are exchanged before any data moves, so
// programs that diverge across ranks fail with a message instead of reducing garbage.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "transport.h"

namespace keras_ring {

enum class Kind : int32_t {
  kAllreduce = 0,
  kGroupedAllreduce = 1,
  kAllgather = 2,
  kBroadcast = 3,
  kBarrier = 4,
  kReducescatter = 5,
  kAlltoall = 6,
  kJoin = 7,  // this rank ran out of data: it adds zeros to the others' allreduces
};
const char* KindName(Kind k);

constexpr int kMaxSignatureDims = 8;

// A broadcast root at or below this is a global rank outside the collective's process set,
// encoded as kRootNotInSet - rank by the Python layer (which alone knows global ranks), so
// that every member reports it instead of only the rank that named it.
constexpr int32_t kRootNotInSet = -(1 << 30);

// Plain data with a fixed layout; every rank runs the same build, so it is sent as bytes.
struct Signature {
  uint64_t seq = 0;
  int32_t kind = 0;
  int32_t dtype = 0;
  int32_t reduce_op = 0;
  int32_t root = -1;
  int64_t count = 0;      // elements; allgather, alltoall: rows; join: seq when it joined
  int64_t row_elems = 0;  // allgather, alltoall: elements per row
  int32_t ndims = 0;      // rank of the shape; for grouped, number of tensors
  int32_t inlined = 0;    // 1 if this rank's data rides along in its Slot's payload
  int32_t device = 0;     // 1 if the data is in device (GPU) memory: NCCL moves it, not the ring
  // With device data, the NCCL communicator it needs (DeviceComm in request.h): ordinal,
  // whether this collective makes it, and the GPU (shown, not compared: ranks differ).
  int32_t comm = -1;
  int32_t comm_new = 0;
  int32_t gpu = -1;
  // 1: this rank submitted it while another collective of its name was pending (Request).
  int32_t concurrent = 0;
  int32_t unused = 0;  // keeps the layout free of padding (slots travel as bytes)
  int64_t dims[kMaxSignatureDims] = {};
  uint64_t layout_hash = 0;  // dims beyond the 8th; grouped: dtypes and counts of all tensors
  double prescale = 1.0;
  double postscale = 1.0;
  char name[128] = {};

  void SetName(const std::string& n);
  std::string Label() const;  // "allreduce 'grad_dense_1'" or "allreduce #12"
};

// What each rank contributes to the exchange that opens every collective: its signature and,
// when the data is small, the data itself. If every rank inlined its data the collective
// completes from the exchanged slots alone: n-1 ring hops instead of about 3(n-1).
constexpr size_t kSlotBytes = 4608;
struct Slot {
  Signature sig;
  char payload[kSlotBytes - sizeof(Signature)];
};
constexpr size_t kInlineCapacity = sizeof(Slot::payload);
static_assert(sizeof(Slot) == kSlotBytes, "Slot must have a fixed size on every rank");
static_assert(kInlineCapacity >= 4096, "4 KiB collectives should complete inline");
// Alltoall's splits ride in the slot after their count: explicit splits for at most this many
// ranks.
constexpr size_t kMaxInlineSplits = kInlineCapacity / sizeof(int64_t) - 1;

struct AlgoConfig;

// Allgathers every rank's slot (in rank order) through the transport, with `cfg`'s bound
// and wait policy per step.
Status ExchangeSlots(Transport& t, const AlgoConfig& cfg, std::vector<Slot>* slots,
                     std::atomic<int>* steps_done = nullptr);

// Allgathers the signatures of all ranks (in rank order) through the transport. This is
// also a barrier: it returns only once every rank has submitted the same collective.
Status ExchangeSignatures(Transport& t, double timeout_seconds, const Signature& mine,
                          std::vector<Signature>* all);

// Compares all ranks' signatures; a FailedPrecondition status says what differed and on
// which ranks. Every rank computes the same verdict from the same table.
Status CheckSignatures(const std::vector<Signature>& all);

// Mixes a value into a running hash (FNV-1a on the value's bytes).
uint64_t HashMix(uint64_t h, uint64_t v);

// A grouped allreduce's tensors in kMaxSignatureDims runs of consecutive tensors, one
// signature dim each: run `run` of `n` tensors is [first, end) (empty past the last).
std::pair<int, int> GroupRun(int n, int run);
// A run of one tensor is this digest of it (dtype, a 15-bit hash of its shape, and its
// element count below 2^40), which a mismatch message can read back; longer runs a hash.
int64_t GroupDigest(DataType dtype, uint64_t shape_hash, int64_t elements);

}  // namespace keras_ring
