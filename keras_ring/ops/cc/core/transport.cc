#include "transport.h"

#include <cstring>

namespace keras_ring {
namespace {

size_t TotalBytes(const std::vector<SendPiece>& pieces) {
  size_t n = 0;
  for (const SendPiece& p : pieces) n += p.bytes;
  return n;
}

size_t TotalBytes(const std::vector<RecvPiece>& pieces) {
  size_t n = 0;
  for (const RecvPiece& p : pieces) n += p.bytes;
  return n;
}

}  // namespace

Status FrameTotal(int peer, const void* head, size_t head_bytes, size_t capacity,
                  const FrameLength& length, size_t* total) {
  *total = length(head);
  if (*total < head_bytes || *total > capacity) {
    return Status(Code::kInternal,
                  "rank " + std::to_string(peer) + " announced a message of " +
                      std::to_string(*total) + " bytes where " + std::to_string(head_bytes) +
                      " to " + std::to_string(capacity) + " were expected (a protocol error)",
                  peer);
  }
  return Status::OK();
}

bool AbortState::Set(const Status& cause) {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.load(std::memory_order_relaxed)) return false;
  cause_ = cause;
  aborted_.store(true, std::memory_order_release);
  return true;
}

Status AbortState::WaitError() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (cause_.code() == Code::kCancelled) {  // this rank's own clean shutdown
    return Status(Code::kAborted,
                  "this rank shut keras_ring down (keras_ring.shutdown(), on another thread "
                  "or at exit) while the collective was running");
  }
  if (cause_.ok()) return Status(Code::kAborted, "keras_ring runtime was aborted");
  return cause_;
}

Status Transport::SendRecvPieces(int to, const std::vector<SendPiece>& send, int from,
                                 const std::vector<RecvPiece>& recv, size_t /*element_bytes*/,
                                 const ReduceFn* reduce, Deadline deadline) {
  const size_t send_bytes = TotalBytes(send);
  const size_t recv_bytes = TotalBytes(recv);
  const void* send_data = send.size() == 1 ? send[0].data : nullptr;
  if (send.size() > 1) {
    if (send_scratch_.size() < send_bytes) send_scratch_.resize(send_bytes);
    size_t off = 0;
    for (const SendPiece& p : send) {
      if (p.bytes > 0) std::memcpy(send_scratch_.data() + off, p.data, p.bytes);
      off += p.bytes;
    }
    send_data = send_scratch_.data();
  }
  if (reduce == nullptr && recv.size() <= 1) {
    return SendRecv(to, send_data, send_bytes, from, recv.empty() ? nullptr : recv[0].dst,
                    recv_bytes, deadline);
  }
  if (recv_scratch_.size() < recv_bytes) recv_scratch_.resize(recv_bytes);
  KR_RETURN_IF_ERROR(
      SendRecv(to, send_data, send_bytes, from, recv_scratch_.data(), recv_bytes, deadline));
  size_t off = 0;
  for (const RecvPiece& p : recv) {
    if (p.bytes == 0) continue;
    if (reduce != nullptr) {
      (*reduce)(p.dst, p.local, recv_scratch_.data() + off, p.bytes);
    } else {
      std::memcpy(p.dst, recv_scratch_.data() + off, p.bytes);
    }
    off += p.bytes;
  }
  return Status::OK();
}

Status Transport::SendFramed(int peer, const void* data, size_t bytes, size_t head,
                             Deadline deadline) {
  KR_RETURN_IF_ERROR(Send(peer, data, head, deadline));
  if (bytes == head) return Status::OK();
  return Send(peer, static_cast<const char*>(data) + head, bytes - head, deadline);
}

Status Transport::RecvFramed(int peer, void* data, size_t head, size_t capacity,
                             const FrameLength& length, size_t* received, Deadline deadline) {
  KR_RETURN_IF_ERROR(Recv(peer, data, head, deadline));
  KR_RETURN_IF_ERROR(FrameTotal(peer, data, head, capacity, length, received));
  if (*received == head) return Status::OK();
  return Recv(peer, static_cast<char*>(data) + head, *received - head, deadline);
}

Status Transport::SendRecvFramed(int peer, const void* send_data, size_t send_bytes,
                                 void* recv_data, size_t head, size_t capacity,
                                 const FrameLength& length, size_t* received,
                                 Deadline deadline) {
  // Both messages buffered (each may start a cache line in): post ours, then take theirs.
  if (BufferedSendBytes() >= send_bytes + 128) {
    KR_RETURN_IF_ERROR(SendFramed(peer, send_data, send_bytes, head, deadline));
    return RecvFramed(peer, recv_data, head, capacity, length, received, deadline);
  }
  KR_RETURN_IF_ERROR(SendRecv(peer, send_data, head, peer, recv_data, head, deadline));
  KR_RETURN_IF_ERROR(FrameTotal(peer, recv_data, head, capacity, length, received));
  const size_t send_body = send_bytes - head;
  const size_t recv_body = *received - head;
  if (send_body == 0 && recv_body == 0) return Status::OK();
  return SendRecv(send_body > 0 ? peer : -1, static_cast<const char*>(send_data) + head,
                  send_body, recv_body > 0 ? peer : -1, static_cast<char*>(recv_data) + head,
                  recv_body, deadline);
}

}  // namespace keras_ring
