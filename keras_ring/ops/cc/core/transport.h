// The only thing the algorithms know about moving bytes between host buffers.
// Implementations: tcp (any hosts), shm (one host), routed (shm within a host, tcp between),
// local (threads in one process, for tests). The NCCL backend does not use it.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <mutex>
#include <vector>

#include "common.h"

namespace keras_ring {

// Combines a received segment with local data: dst = local (op) peer, `bytes` long.
// dst may equal local.
using ReduceFn =
    std::function<void(void* dst, const void* local, const void* peer, size_t bytes)>;

// A run of bytes to send.
struct SendPiece {
  const void* data;
  size_t bytes;
};

// Where a run of received bytes goes: combined with `local` into `dst` by a ReduceFn, or
// copied to `dst` when there is none.
struct RecvPiece {
  void* dst;
  const void* local;
  size_t bytes;
};

// The total length of a framed message, read from its first head bytes (see
// Transport::SendRecvFramed).
using FrameLength = std::function<size_t(const void* head)>;

// *total = length(head), checked to lie in [head_bytes, capacity]: kInternal naming `peer`
// if not.
Status FrameTotal(int peer, const void* head, size_t head_bytes, size_t capacity,
                  const FrameLength& length, size_t* total);

// A transport's aborted state. Once aborted, every wait ends with WaitError(): the cause
// when it was a failure (so a collective that the watchdog aborted because a peer failed
// names that peer, not "aborted"), else a plain "aborted".
class AbortState {
 public:
  // Records the cause; true for the first call only.
  bool Set(const Status& cause);
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  Status WaitError() const;

 private:
  std::atomic<bool> aborted_{false};
  mutable std::mutex mu_;
  Status cause_;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;

  // Point-to-point transfers between this rank and `peer`. Each call sends at most one
  // message to a peer (all of its send pieces, however many) and receives at most one, and
  // messages between a pair arrive in the order sent. A message must be received by exactly
  // one call that expects exactly its bytes, though the pieces may be cut differently on the
  // two ends: shm starts every message on a cache line, so two sends read as one receive
  // (or the reverse) would shift the data. There is no header; both sides know the sizes.
  // Every call returns by the deadline: kDeadlineExceeded names the peer waited for,
  // kUnavailable a peer that is gone.
  virtual Status Send(int peer, const void* data, size_t bytes, Deadline deadline) = 0;
  virtual Status Recv(int peer, void* data, size_t bytes, Deadline deadline) = 0;

  // Sends to `to` while receiving from `from` (one ring step). Must not deadlock when every
  // rank of a ring calls it at once, whatever the sizes.
  virtual Status SendRecv(int to, const void* send_data, size_t send_bytes, int from,
                          void* recv_data, size_t recv_bytes, Deadline deadline) = 0;

  // SendRecv over lists of pieces: the pieces of each side form one message, so the two
  // ends of a link may cut it differently (a fused collective's tensors, without packing).
  // Received bytes are combined with each piece's `local` by `reduce`, in whole elements of
  // `element_bytes`, or copied when `reduce` is null. The default gathers and scatters
  // through scratch memory; a transport that can read the peer's data in place (shm)
  // overrides it to save those copies.
  virtual Status SendRecvPieces(int to, const std::vector<SendPiece>& send, int from,
                                const std::vector<RecvPiece>& recv, size_t element_bytes,
                                const ReduceFn* reduce, Deadline deadline);

  // A framed message is a head of fixed size that says the message's total length, and a body
  // of the rest: two messages on the wire (the body only if not empty; shm sends one that reads
  // as the two), so the receiver needs no length in advance. These send one to, receive one
  // from, or trade one with `peer` (as SendRecv): `length` reads the total from the received
  // head; a total under `head` or over `capacity` fails (kInternal). The default trade takes
  // one hop when the link buffers the whole message, two (heads, then bodies) otherwise; a
  // stream (tcp) overrides it to take one hop always. Lets small collectives carry data of any
  // size up to `capacity` in the exchange that agrees on them, and agreements without data send
  // only the head.
  virtual Status SendFramed(int peer, const void* data, size_t bytes, size_t head,
                            Deadline deadline);
  Status RecvFramed(int peer, void* data, size_t head, size_t capacity,
                    const FrameLength& length, size_t* received, Deadline deadline);
  virtual Status SendRecvFramed(int peer, const void* send_data, size_t send_bytes,
                                void* recv_data, size_t head, size_t capacity,
                                const FrameLength& length, size_t* received,
                                Deadline deadline);

  // The most bytes a Send to any peer completes with, before that peer receives them (the
  // buffering of every link). An algorithm may post sends of this size to several peers
  // before receiving without risking a rank blocked in a send waiting for another one.
  virtual size_t BufferedSendBytes() const { return 0; }

  // Whether SendRecvPieces hands `reduce` the peer's data in place (no scratch copy), so a
  // custom way of storing received bytes costs nothing extra.
  virtual bool ReadsInPlace(int /*peer*/) const { return false; }

  // Whether a peer has failed or died, checked without blocking and without consuming any
  // bytes, from a thread other than the one moving data (the runtime's watchdog): the error
  // naming that peer, or OK. A peer that shut down cleanly is no failure. A transport that
  // cannot tell returns OK.
  virtual Status PollPeerFailure() { return Status::OK(); }

  // The same for one peer, also after this rank's own abort: how `peer` gave up (its notice,
  // whose peer() is the rank it blames) or that it died; OK while it has done neither. A rank
  // that gave up on a peer asks this to learn whether that peer was itself waiting.
  virtual Status PeerNotice(int /*peer*/) { return Status::OK(); }

  // Unblocks every wait and makes peers notice. `cause` travels to the peers where the
  // transport can carry it (its peer() is the rank to blame; code kCancelled means a clean
  // shutdown), so a rank far from the failure can still name it. After an abort only the
  // destructor may be called.
  virtual void AbortWith(const Status& cause) = 0;
  void Abort() { AbortWith(Status(Code::kAborted, "the keras_ring runtime was aborted")); }

 private:
  std::vector<char> send_scratch_;  // the default SendRecvPieces's gather and scatter buffers
  std::vector<char> recv_scratch_;
};

}  // namespace keras_ring
