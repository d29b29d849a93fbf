// Threads in one process exchanging messages through in-memory queues. For the C++ tests of
// the algorithms only: it lets them run N "ranks" without processes or sockets. It keeps
// every message whole and refuses a receive of another size, so an algorithm that would
// shift data on shm (which starts each message on a cache line) fails here too.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "transport.h"

namespace keras_ring {

// The shared medium: one message queue per ordered pair of ranks.
class LocalFabric {
 public:
  explicit LocalFabric(int size);
  int size() const { return size_; }

 private:
  friend class LocalTransport;
  struct Channel {
    std::deque<std::vector<char>> messages;
  };
  Channel& channel(int from, int to) { return channels_[static_cast<size_t>(from * size_ + to)]; }

  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool aborted_ = false;
  int aborted_by_ = -1;
  std::vector<Channel> channels_;
};

class LocalTransport : public Transport {
 public:
  LocalTransport(std::shared_ptr<LocalFabric> fabric, int rank);

  int rank() const override { return rank_; }
  int size() const override { return fabric_->size(); }
  const char* name() const override { return "local"; }

  Status Send(int peer, const void* data, size_t bytes, Deadline deadline) override;
  Status Recv(int peer, void* data, size_t bytes, Deadline deadline) override;
  Status SendRecv(int to, const void* send_data, size_t send_bytes, int from, void* recv_data,
                  size_t recv_bytes, Deadline deadline) override;
  size_t BufferedSendBytes() const override { return SIZE_MAX; }  // queues never fill
  void AbortWith(const Status& cause) override;

 private:
  std::shared_ptr<LocalFabric> fabric_;
  int rank_;
};

}  // namespace keras_ring
