// Runs collectives on host memory. Every collective opens with an exchange of Slots (each
// rank's signature and, when small, its data), checked before any data moves; small
// collectives then complete from the slots alone, the others run the ring algorithms over
// the transport. The device executor reuses the exchange to agree (Agree).
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "algorithms.h"
#include "fast_agree.h"
#include "executor.h"
#include "transport.h"

namespace keras_ring {

class HostExecutor : public Executor {
 public:
  HostExecutor(int rank, int size, Transport& transport, const AlgoConfig& algo);

  Status Execute(Request& request, uint64_t seq, ExecutionStats* stats) override;

  // Exchanges the signatures (with this rank's data when it fits and the request allows)
  // and checks them: every rank computes the same verdict. `sigs` gets every rank's
  // signature; `all_inlined` whether every rank's data came along. With `ahead` (a device
  // collective's lookahead, fast agreement only), ahead->agreed of the collectives queued
  // behind it are agreed too (FastLookahead).
  Status Agree(const Request& request, uint64_t seq, std::vector<Signature>* sigs,
               bool* all_inlined, FastLookahead* ahead = nullptr);

  // Ring steps of the slot exchange in progress, -1 when none runs (for the stall report).
  int exchange_steps() const { return exchange_steps_.load(); }
  // The ranks this rank has not heard from in the agreement in progress (the stalled one is
  // among them); false when no agreement runs.
  bool NotYetHeardFrom(std::vector<int>* missing) const;
  // `s` as this rank reports it. A peer's notice that blames this rank for not submitting,
  // while this rank still waits in the agreement of `label` (an earlier collective: the peer
  // got through it, this rank did not), passes the blame on to the ranks this rank has not
  // heard from, where the stalled rank or the lost link is. Any thread.
  Status PassOnBlame(const Status& s, const std::string& label) const;
  Transport& transport() { return transport_; }
  // Alltoall, right after Agree: every rank's splits, read from the slots and checked (the
  // same verdict everywhere, so a refusal needs no further agreement).
  Status AlltoallSplits(const std::vector<Signature>& sigs,
                        std::vector<std::vector<int64_t>>* splits) const;
  // The algorithms' settings for `request` (its wait policy).
  AlgoConfig ConfigFor(const Request& request) const;

 private:
  // How a collective was agreed: by the fast agreement (every rank's signature equals this
  // rank's), and whether its data came along (complete, or completes from the slots).
  struct Agreement {
    bool fast = false;
    bool inlined = false;
  };
  // Agree's body. With `deliver`, small data may ride the fast agreement, which then
  // writes the outputs (how.fast && how.inlined: the collective is complete). After a fast
  // agreement `sigs` is filled only if `want_sigs`; after the full exchange, always.
  Status AgreeOn(const Request& request, uint64_t seq, Request* deliver, bool want_sigs,
                 std::vector<Signature>* sigs, Agreement* how, FastLookahead* ahead = nullptr);
  Status FastAgree(const Request& request, uint64_t seq, Request* deliver, bool* agreed,
                   bool* delivered, FastLookahead* ahead);
  // The settings that pick algorithms, digested into the fast agreement.
  uint64_t ConfigWord() const;
  bool PackInline(const Request& request, Slot* slot) const;
  Status ExecuteInline(Request& request, const std::vector<Signature>& sigs);
  void ReduceInline(const Request& r, DataType dtype, size_t offset, size_t count, void* out);
  Status ExecuteAllreduce(Request& request, bool fast);
  Status ExecuteGrouped(Request& request);
  Status ExecuteAllgather(Request& request, const std::vector<Signature>& sigs);
  Status ExecuteBroadcast(Request& request);
  // Reducescatter: elements of each rank's part, in rank order.
  std::vector<size_t> ReducescatterCounts(const Request& request) const;
  Status ExecuteReducescatter(Request& request);
  Status ExecuteAlltoall(Request& request, const std::vector<Signature>& sigs);
  // Join: takes part in the other ranks' allreduces with zeros until every rank joined.
  Status ExecuteJoin(Request& request, uint64_t seq, ExecutionStats* stats);
  Status AddZeros(const Request& join, const Signature& ref, const char* ref_payload);
  Status BlameForExchangeTimeout(const Request& request, uint64_t seq, int steps) const;

  const int rank_;
  const int size_;
  Transport& transport_;
  const AlgoConfig algo_;
  std::vector<Slot> slots_;    // one per rank, reused by every exchange
  std::vector<char> scratch_;  // prescaled peer data on the inline path
  std::vector<char> doubling_scratch_;  // the peer's vector in DoublingAllreduce
  std::atomic<int> exchange_steps_{-1};
  std::atomic<int> fast_progress_{-1};  // receives of the fast agreement, -1 when none runs
  FastAgreement fast_;
};

}  // namespace keras_ring
