// One round of agreement for several device collectives. The worker launches a device
// collective and goes on to the next one without waiting for the GPU, so once the GPU path is
// in flight, what it waits for is the agreement: a round trip between the ranks per
// collective, 130-300 us on a machine where every wake-up is a system call into a user-space
// kernel (docs/performance.md, "Two ranks on one H200"). A round therefore also carries the
// digests of the device collectives queued behind this one (FastLookahead), and those equal
// on every rank run without a round of their own: a step's gradient buckets, submitted
// together, are agreed in one round trip.
//
// Every rank reaches the same verdict from the same reduced message, so every rank takes the
// same pre-agreed collectives next, in the same order, with the same seqs; a collective that
// differs anywhere is not pre-agreed and gets its own round, whose miss names what differs.
#include "../fast_agree.h"
#include "backend.h"

namespace keras_ring {
namespace nccl {
namespace {

bool SameSignature(const Signature& a, const Signature& b, int size) {
  uint64_t da[2], db[2];
  uint32_t fa = 0, fb = 0;
  DigestSignature(a, size, 0, da, &fa);
  DigestSignature(b, size, 0, db, &fb);
  return da[0] == db[0] && da[1] == db[1];
}

}  // namespace

void NcclBackend::PeekAhead(const Request& request, uint64_t seq, FastLookahead* ahead) {
  // A round that makes a communicator agrees alone: behind it, the others use the one made.
  if (!peek_ || size_ < 2 || request.device_comm.creates) return;
  const DeviceComm use = request.device_comm;
  peek_([&](const Request& queued) {
    if (ahead->next.size() == kMaxAhead || queued.placement != Placement::kDevice) return false;
    const auto* ticket = dynamic_cast<const StreamTicket*>(queued.device_ticket.get());
    if (ticket == nullptr || ticket->device != use.device) return false;
    // As Execute will describe it: the next seqs (device collectives take one each) and this
    // GPU's communicator, which exists.
    Signature s = SignatureOf(queued, seq + 1 + ahead->next.size());
    s.comm = use.ordinal;
    s.comm_new = 0;
    s.gpu = use.device;
    ahead->next.push_back(s);
    return true;
  });
}

Status NcclBackend::AgreeAhead(const Request& request, uint64_t seq,
                               std::vector<Signature>* sigs) {
  if (!pre_agreed_.empty()) {
    const Signature mine = SignatureOf(request, seq);
    const Signature agreed = pre_agreed_.front();
    pre_agreed_.pop_front();
    committed_.store(pre_agreed_.size());
    if (agreed.seq == seq && SameSignature(agreed, mine, size_)) {
      sigs->assign(static_cast<size_t>(size_), mine);
      return Status::OK();
    }
    // Cannot happen while the queue keeps its order; if it did, the peers run what was
    // agreed and this rank must not run anything else: fatal, so they learn it at once.
    pre_agreed_.clear();
    committed_.store(0);
    return Status(Code::kInternal, "the lookahead agreed " + agreed.Label() +
                                       " for this place in the order, but this rank runs " +
                                       mine.Label());
  }
  agreement_rounds_.fetch_add(1);
  FastLookahead ahead;
  PeekAhead(request, seq, &ahead);
  bool inlined = false;  // never: device data does not ride
  KR_RETURN_IF_ERROR(host_.Agree(request, seq, sigs, &inlined, &ahead));
  for (size_t i = 0; i < ahead.agreed; ++i) pre_agreed_.push_back(ahead.next[i]);
  committed_.store(pre_agreed_.size());
  return Status::OK();
}

}  // namespace nccl
}  // namespace keras_ring
