// Sockets between every pair of ranks, non-blocking, every wait bounded by a deadline.
// Works on one host (loopback) and across hosts.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport.h"

namespace keras_ring {

struct PeerAddress {
  std::string host;  // numeric addresses or names, comma-separated, tried in order
  int port = 0;
};

// The build this library was compiled as (KERAS_RING_BUILD_INFO: version, TensorFlow, flags).
const char* BuildInfo();

class TcpTransport : public Transport {
 public:
  // Builds the full mesh: this rank accepts connections from higher ranks on `listen_fd`
  // (already bound and listening; the transport takes a duplicate) and connects to lower
  // ranks. `job_token` must be the same on every rank; connections with another token are
  // refused, so a stray process cannot join the job. A peer greeting with another `build`
  // fails the mesh with an error naming it: builds may differ in slot layout and protocol.
  static Status Create(int rank, int size, int listen_fd, const std::vector<PeerAddress>& peers,
                       uint64_t job_token, Deadline deadline, std::unique_ptr<TcpTransport>* out,
                       const std::string& build = BuildInfo());
  ~TcpTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "tcp"; }

  Status Send(int peer, const void* data, size_t bytes, Deadline deadline) override;
  Status Recv(int peer, void* data, size_t bytes, Deadline deadline) override;
  Status SendRecv(int to, const void* send_data, size_t send_bytes, int from, void* recv_data,
                  size_t recv_bytes, Deadline deadline) override;
  // A stream: the peer's head and body arrive in one pass, one hop for any size.
  Status SendRecvFramed(int peer, const void* send_data, size_t send_bytes, void* recv_data,
                        size_t head, size_t capacity, const FrameLength& length,
                        size_t* received, Deadline deadline) override;
  // Watches the control sockets: an abort notice other than a clean shutdown, or an end of
  // stream with no notice at all (the process died), is a failure.
  Status PollPeerFailure() override;
  Status PeerNotice(int peer) override;
  void AbortWith(const Status& cause) override;

  // Whether a wait in a graph's collective may yield the core before it blocks in poll(), as
  // an eager call's does (Deadline::may_yield); set where this host's ranks each have a core.
  // (Elsewhere a chain's collectives yield all the same: Runtime::FollowsClosely.)
  void set_yield_in_graphs(bool yes) { yield_in_graphs_ = yes; }

  // The socket to `peer` (-1 for self); other transports watch it to notice a dead peer.
  int fd(int peer) const { return fds_[static_cast<size_t>(peer)]; }

 private:
  TcpTransport(int rank, int size, const std::string& build);
  Status FormMesh(int listen_fd, const std::vector<PeerAddress>& peers, uint64_t job_token,
                  Deadline deadline);
  Status ConnectTo(int peer, const PeerAddress& addr, uint64_t job_token, int32_t channel,
                   Deadline deadline);
  Status AcceptFrom(int listen_fd, uint64_t job_token, Deadline deadline);
  // SendRecv's loop; with `frame`, only its head is expected at first, then the total it
  // announces (written to *framed_total).
  struct Frame {
    size_t capacity;
    const FrameLength* length;
    size_t* total;
  };
  Status Pump(int to, const void* send_data, size_t send_bytes, int from, void* recv_data,
              size_t recv_bytes, const Frame* frame, Deadline deadline);
  Status PeerGone(int peer, const char* what, int err) const;
  // The notice or end of stream waiting on `peer`'s control socket (readable), or OK.
  Status ReadableNotice(int peer) const;

  int rank_;
  int size_;
  // Per peer host (its offered address list): the candidate that answered last time.
  std::map<std::string, size_t> reached_;
  std::string build_;
  uint64_t build_hash_;
  std::vector<int> fds_;          // data socket per peer, -1 for self
  std::vector<int> control_fds_;  // abort notices only
  AbortState abort_;
  bool yield_in_graphs_ = false;
};

}  // namespace keras_ring
