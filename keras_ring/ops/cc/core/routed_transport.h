// Sends each peer's traffic over the transport that reaches it best: shared memory for
// ranks on this host, TCP for the others. A mixed job (several hosts) uses both at once.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "shm_transport.h"
#include "tcp_transport.h"

namespace keras_ring {

struct HostTransportConfig {
  int rank = 0;
  int size = 1;
  int listen_fd = -1;
  std::vector<PeerAddress> peers;  // every rank's address
  std::vector<int> host_index;     // every rank's host; equal index = same host
  uint64_t job_token = 0;
  double timeout_seconds = 300.0;
  bool use_shm = true;  // must be the same on every rank
  ShmOptions shm;
};

// Connects the TCP mesh, then (with use_shm) upgrades same-host pairs to shared memory.
Status ConnectHostTransport(const HostTransportConfig& config, std::unique_ptr<Transport>* out);

class RoutedTransport : public Transport {
 public:
  RoutedTransport(std::unique_ptr<TcpTransport> tcp, std::unique_ptr<ShmTransport> shm);
  ~RoutedTransport() override;

  int rank() const override { return tcp_->rank(); }
  int size() const override { return tcp_->size(); }
  const char* name() const override { return "routed"; }

  Status Send(int peer, const void* data, size_t bytes, Deadline deadline) override;
  Status Recv(int peer, void* data, size_t bytes, Deadline deadline) override;
  Status SendRecv(int to, const void* send_data, size_t send_bytes, int from, void* recv_data,
                  size_t recv_bytes, Deadline deadline) override;
  Status SendRecvPieces(int to, const std::vector<SendPiece>& send, int from,
                        const std::vector<RecvPiece>& recv, size_t element_bytes,
                        const ReduceFn* reduce, Deadline deadline) override;
  Status SendFramed(int peer, const void* data, size_t bytes, size_t head,
                    Deadline deadline) override {
    return Route(peer).SendFramed(peer, data, bytes, head, deadline);
  }
  Status SendRecvFramed(int peer, const void* send_data, size_t send_bytes, void* recv_data,
                        size_t head, size_t capacity, const FrameLength& length,
                        size_t* received, Deadline deadline) override {
    return Route(peer).SendRecvFramed(peer, send_data, send_bytes, recv_data, head, capacity,
                                      length, received, deadline);
  }
  bool ReadsInPlace(int peer) const override {
    return shm_ != nullptr && peer >= 0 && shm_->Reaches(peer);
  }
  // Only when every peer is reached through shm (sockets give no guarantee).
  size_t BufferedSendBytes() const override;
  // Every peer has a TCP connection (the liveness signal of shm peers too).
  Status PollPeerFailure() override { return tcp_->PollPeerFailure(); }
  Status PeerNotice(int peer) override { return tcp_->PeerNotice(peer); }
  void AbortWith(const Status& cause) override;

 private:
  Transport& Route(int peer) {
    return shm_ != nullptr && peer >= 0 && shm_->Reaches(peer) ? static_cast<Transport&>(*shm_)
                                                               : static_cast<Transport&>(*tcp_);
  }
  // Runs `send` on the helper thread while the caller receives: the two halves of a ring
  // step go over different transports, and neither may wait for the other.
  Status WithConcurrentSend(const std::function<Status()>& send,
                            const std::function<Status()>& recv);

  std::unique_ptr<TcpTransport> tcp_;
  std::unique_ptr<ShmTransport> shm_;
  std::mutex abort_mu_;
  Status abort_cause_;  // the first AbortWith's, passed to both halves

  std::mutex mu_;
  std::condition_variable cv_;
  std::function<Status()> pending_;
  Status pending_result_;
  bool has_pending_ = false;
  bool stop_ = false;
  std::thread sender_;
};

}  // namespace keras_ring
