#include "local_transport.h"

#include <string>

namespace keras_ring {

LocalFabric::LocalFabric(int size)
    : size_(size), channels_(static_cast<size_t>(size) * static_cast<size_t>(size)) {}

LocalTransport::LocalTransport(std::shared_ptr<LocalFabric> fabric, int rank)
    : fabric_(std::move(fabric)), rank_(rank) {}

Status LocalTransport::Send(int peer, const void* data, size_t bytes, Deadline) {
  if (bytes == 0) return Status::OK();  // no message, as on every transport
  const char* p = static_cast<const char*>(data);
  {
    std::lock_guard<std::mutex> lock(fabric_->mu_);
    if (fabric_->aborted_) {
      return Status(Code::kUnavailable,
                    "rank " + std::to_string(fabric_->aborted_by_) + " aborted", fabric_->aborted_by_);
    }
    fabric_->channel(rank_, peer).messages.emplace_back(p, p + bytes);
  }
  fabric_->cv_.notify_all();
  return Status::OK();
}

Status LocalTransport::Recv(int peer, void* data, size_t bytes, Deadline deadline) {
  if (bytes == 0) return Status::OK();
  std::unique_lock<std::mutex> lock(fabric_->mu_);
  auto& q = fabric_->channel(peer, rank_).messages;
  while (true) {
    if (fabric_->aborted_) {
      return Status(Code::kUnavailable,
                    "rank " + std::to_string(fabric_->aborted_by_) + " aborted", fabric_->aborted_by_);
    }
    if (!q.empty()) break;
    if (fabric_->cv_.wait_until(lock, deadline.time()) == std::cv_status::timeout &&
        q.empty()) {
      return Status(Code::kDeadlineExceeded,
                    "timed out waiting for data from rank " + std::to_string(peer), peer);
    }
  }
  if (q.front().size() != bytes) {
    return Status(Code::kInternal,
                  "message framing broken: rank " + std::to_string(peer) + " sent " +
                      std::to_string(q.front().size()) + " bytes in one message, rank " +
                      std::to_string(rank_) + " received " + std::to_string(bytes),
                  peer);
  }
  std::copy(q.front().begin(), q.front().end(), static_cast<char*>(data));
  q.pop_front();
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
