#include "routed_transport.h"

#include <unistd.h>

#include <algorithm>

namespace keras_ring {

Status ConnectHostTransport(const HostTransportConfig& config, std::unique_ptr<Transport>* out) {
  std::unique_ptr<TcpTransport> tcp;
  KR_RETURN_IF_ERROR(TcpTransport::Create(config.rank, config.size, config.listen_fd,
                                          config.peers, config.job_token,
                                          Deadline::After(config.timeout_seconds), &tcp));
  const int mine = config.host_index.empty() ? 0 : config.host_index[static_cast<size_t>(config.rank)];
  // Graphs' waits yield where this host's ranks each have a core (see ShmTransport::Create).
  const long here = config.host_index.empty()
                        ? config.size
                        : std::count(config.host_index.begin(), config.host_index.end(), mine);
  tcp->set_yield_in_graphs(here <= sysconf(_SC_NPROCESSORS_ONLN));
  if (!config.use_shm) {
    *out = std::move(tcp);
    return Status::OK();
  }
  std::vector<int> local;
  std::vector<int> liveness(static_cast<size_t>(config.size), -1);
  for (int r = 0; r < config.size; ++r) {
    liveness[static_cast<size_t>(r)] = tcp->fd(r);
    if (r != config.rank && config.host_index[static_cast<size_t>(r)] == mine) local.push_back(r);
  }
  ShmOptions shm_options = config.shm;
  shm_options.job_token = config.job_token;
  std::unique_ptr<ShmTransport> shm;
  // Collective: every rank takes part, also one without local peers.
  const Status s =
      ShmTransport::Create(*tcp, local, liveness, shm_options, config.timeout_seconds, &shm);
  if (!s.ok()) {
    tcp->AbortWith(s);  // peers still forming the job learn why (see TcpTransport::Create)
    return s;
  }
  *out = std::make_unique<RoutedTransport>(std::move(tcp), std::move(shm));
  return Status::OK();
}

RoutedTransport::RoutedTransport(std::unique_ptr<TcpTransport> tcp,
                                 std::unique_ptr<ShmTransport> shm)
    : tcp_(std::move(tcp)), shm_(std::move(shm)) {
  sender_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || (has_pending_ && pending_); });
      if (stop_) return;
      auto job = std::move(pending_);
      pending_ = nullptr;
      lock.unlock();
      Status s = job();
      lock.lock();
      pending_result_ = s;
      has_pending_ = false;
      cv_.notify_all();
    }
  });
}

RoutedTransport::~RoutedTransport() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  sender_.join();
}

Status RoutedTransport::WithConcurrentSend(const std::function<Status()>& send,
                                           const std::function<Status()>& recv) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = send;
    has_pending_ = true;
  }
  cv_.notify_all();
  Status r = recv();
  if (!r.ok()) AbortWith(r);  // unblocks the send half too; the error is fatal anyway
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !has_pending_; });
  return r.ok() ? pending_result_ : r;
}

Status RoutedTransport::Send(int peer, const void* data, size_t bytes, Deadline deadline) {
  return Route(peer).Send(peer, data, bytes, deadline);
}

Status RoutedTransport::Recv(int peer, void* data, size_t bytes, Deadline deadline) {
  return Route(peer).Recv(peer, data, bytes, deadline);
}

Status RoutedTransport::SendRecv(int to, const void* send_data, size_t send_bytes, int from,
                                 void* recv_data, size_t recv_bytes, Deadline deadline) {
  Transport& out = Route(to);
  Transport& in = Route(from);
  if (&out == &in || send_bytes == 0 || recv_bytes == 0) {
    if (&out == &in) {
      return out.SendRecv(to, send_data, send_bytes, from, recv_data, recv_bytes, deadline);
    }
    if (send_bytes > 0) KR_RETURN_IF_ERROR(out.Send(to, send_data, send_bytes, deadline));
    return recv_bytes > 0 ? in.Recv(from, recv_data, recv_bytes, deadline) : Status::OK();
  }
  return WithConcurrentSend([&] { return out.Send(to, send_data, send_bytes, deadline); },
                            [&] { return in.Recv(from, recv_data, recv_bytes, deadline); });
}

Status RoutedTransport::SendRecvPieces(int to, const std::vector<SendPiece>& send, int from,
                                       const std::vector<RecvPiece>& recv, size_t element_bytes,
                                       const ReduceFn* reduce, Deadline deadline) {
  Transport& out = Route(to);
  Transport& in = Route(from);
  if (&out == &in) {
    return out.SendRecvPieces(to, send, from, recv, element_bytes, reduce, deadline);
  }
  // The pieces leave as one message: the peer receives them in one call, and shm aligns
  // the start of every message, so piece-by-piece sends would shift all but the first.
  auto send_all = [&] { return out.SendRecvPieces(to, send, -1, {}, element_bytes, nullptr, deadline); };
  auto receive = [&] {
    return recv.empty() ? Status::OK()
                        : in.SendRecvPieces(-1, {}, from, recv, element_bytes, reduce, deadline);
  };
  if (send.empty()) return receive();
  if (recv.empty()) return send_all();
  return WithConcurrentSend(send_all, receive);
}

size_t RoutedTransport::BufferedSendBytes() const {
  if (shm_ == nullptr) return 0;
  for (int peer = 0; peer < size(); ++peer) {
    if (peer != rank() && !shm_->Reaches(peer)) return 0;
  }
  return shm_->BufferedSendBytes();
}

void RoutedTransport::AbortWith(const Status& cause) {
  // The first cause goes to both halves: a second caller (a wait that the first abort of
  // the shm half ended, reporting it) must not reach the TCP half first with its own,
  // or peers would hear two different reasons, one per half.
  Status first;
  {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (abort_cause_.ok()) abort_cause_ = cause;
    first = abort_cause_;
  }
  // shm first: its segment records the cause before the TCP sockets (its liveness
  // signal) close.
  if (shm_ != nullptr) shm_->AbortWith(first);
  tcp_->AbortWith(first);
}

}  // namespace keras_ring
