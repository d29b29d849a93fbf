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

bool AbortState::Set(const Status& cause) {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.load(std::memory_order_relaxed)) return false;
  cause_ = cause;
  aborted_.store(true, std::memory_order_release);
  return true;
}

Status AbortState::WaitError() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (cause_.ok() || cause_.code() == Code::kCancelled) {
    return Status(Code::kAborted, "keras_ring runtime was aborted");
  }
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

}  // namespace keras_ring
