#include "local_transport.h"

#include <string>

namespace keras_ring {

LocalFabric::LocalFabric(int size)
    : size_(size), channels_(static_cast<size_t>(size) * static_cast<size_t>(size)) {}

LocalTransport::LocalTransport(std::shared_ptr<LocalFabric> fabric, int rank)
    : fabric_(std::move(fabric)), rank_(rank) {}

Status LocalTransport::Send(int peer, const void* data, size_t bytes, Deadline) {
  const char* p = static_cast<const char*>(data);
  {
    std::lock_guard<std::mutex> lock(fabric_->mu_);
    if (fabric_->aborted_) {
      return Status(Code::kUnavailable,
                    "rank " + std::to_string(fabric_->aborted_by_) + " aborted", fabric_->aborted_by_);
    }
    auto& q = fabric_->channel(rank_, peer).bytes;
    q.insert(q.end(), p, p + bytes);
  }
  fabric_->cv_.notify_all();
  return Status::OK();
}

Status LocalTransport::Recv(int peer, void* data, size_t bytes, Deadline deadline) {
  char* p = static_cast<char*>(data);
  std::unique_lock<std::mutex> lock(fabric_->mu_);
  auto& q = fabric_->channel(peer, rank_).bytes;
  while (bytes > 0) {
    if (fabric_->aborted_) {
      return Status(Code::kUnavailable,
                    "rank " + std::to_string(fabric_->aborted_by_) + " aborted", fabric_->aborted_by_);
    }
    if (!q.empty()) {
      const size_t n = q.size() < bytes ? q.size() : bytes;
      std::copy(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(n), p);
      q.erase(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(n));
      p += n;
      bytes -= n;
      continue;
    }
    if (fabric_->cv_.wait_until(lock, deadline.time()) == std::cv_status::timeout &&
        q.empty()) {
      return Status(Code::kDeadlineExceeded,
                    "timed out waiting for data from rank " + std::to_string(peer), peer);
    }
  }
  return Status::OK();
}

Status LocalTransport::SendRecv(int to, const void* send_data, size_t send_bytes, int from,
                                void* recv_data, size_t recv_bytes, Deadline deadline) {
  // Sends never block here (queues are unbounded), so send-then-receive cannot deadlock.
  KR_RETURN_IF_ERROR(Send(to, send_data, send_bytes, deadline));
  return Recv(from, recv_data, recv_bytes, deadline);
}

void LocalTransport::AbortWith(const Status&) {
  {
    std::lock_guard<std::mutex> lock(fabric_->mu_);
    fabric_->aborted_ = true;
    fabric_->aborted_by_ = rank_;
  }
  fabric_->cv_.notify_all();
}

}  // namespace keras_ring
