// Ranks on one host exchange data through POSIX shared memory: each rank owns a region
// with one single-producer/single-consumer byte ring per sender. Waiting spins briefly, then
// sleeps on a futex "doorbell" in the waiter's own region, so oversubscribed ranks do not
// steal each other's cores. Regions are unlinked as soon as every peer has mapped them, so
// nothing is left in /dev/shm even when a rank is killed.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport.h"

namespace keras_ring {

struct ShmOptions {
  uint64_t job_token = 0;
  size_t channel_bytes = 1 << 20;  // per sender; a power of two
  int spin_iterations = 2000;      // before yielding; 0 when ranks outnumber cores
  double yield_seconds = 0.0002;   // then (eager calls) yield up to this long before sleeping
  // Whether collectives in graphs yield too (as eager calls do) instead of sleeping at once;
  // off when this host's ranks outnumber its cores (see Create).
  bool yield_in_graphs = true;
};

class ShmTransport : public Transport {
 public:
  // Collective over `control` (all ranks must call it): creates this rank's region, maps
  // the regions of the ranks in `local` (same host), then unlinks its own. `liveness_fds`
  // (per rank, -1 if none) are sockets whose EOF means the peer is gone.
  static Status Create(Transport& control, const std::vector<int>& local,
                       const std::vector<int>& liveness_fds, const ShmOptions& options,
                       double timeout_seconds, std::unique_ptr<ShmTransport>* out);
  ~ShmTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "shm"; }
  bool Reaches(int peer) const { return peers_[static_cast<size_t>(peer)].region != nullptr; }

  Status Send(int peer, const void* data, size_t bytes, Deadline deadline) override;
  Status Recv(int peer, void* data, size_t bytes, Deadline deadline) override;
  Status SendRecv(int to, const void* send_data, size_t send_bytes, int from, void* recv_data,
                  size_t recv_bytes, Deadline deadline) override;
  Status SendRecvPieces(int to, const std::vector<SendPiece>& send, int from,
                        const std::vector<RecvPiece>& recv, size_t element_bytes,
                        const ReduceFn* reduce, Deadline deadline) override;
  // Head and body leave as one message (one doorbell for the peer) where the head fills
  // whole cache lines: the body then lies where a message of its own would start.
  Status SendFramed(int peer, const void* data, size_t bytes, size_t head,
                    Deadline deadline) override;
  bool ReadsInPlace(int peer) const override { return Reaches(peer); }
  // A message may start up to one cache line into the ring.
  size_t BufferedSendBytes() const override { return options_.channel_bytes - 64; }
  void AbortWith(const Status& cause) override;

  // Removes regions of earlier jobs whose creating process is gone (a crash during init).
  static void RemoveStaleRegions();

  struct Region;  // layout in shm_transport.cc

 private:
  struct Peer {
    Region* region = nullptr;  // the peer's region (its inbound channel from us)
    int liveness_fd = -1;
  };
  ShmTransport(int rank, int size, const ShmOptions& options);
  struct Job;  // one Send/Recv/SendRecv(Reduce) call in progress
  Status Transfer(Job& job, Deadline deadline);
  Status Sleep(const Job& job, Deadline deadline);
  // Setup steps; each returns an error message, empty on success.
  // `local`: the peers that write into it (their channels are reserved up front).
  std::string CreateOwnRegion(size_t header_bytes, const std::vector<int>& local);
  std::string MapPeer(int peer, int pid, int liveness_fd);
  // Errors for the peers `job` waits on: gone, failed, or (unless `starting`) shut down.
  Status CheckPeers(const Job& job, bool starting) const;

  int rank_;
  int size_;
  ShmOptions options_;
  Region* own_ = nullptr;
  size_t region_bytes_ = 0;
  std::string own_name_;
  std::vector<Peer> peers_;
  AbortState abort_;
};

}  // namespace keras_ring
