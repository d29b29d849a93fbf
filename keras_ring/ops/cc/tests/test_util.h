// Helpers shared by the tests: N ranks as threads over one LocalFabric, and typed access to
// buffers of any DataType.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "../core/common.h"
#include "../core/local_transport.h"
#include "../core/request.h"
#include "../core/tcp_transport.h"
#include "test_harness.h"

namespace kr_test {

// `n` ranks in one process: one LocalTransport each over a shared LocalFabric.
class LocalWorld {
 public:
  explicit LocalWorld(int n);
  int size() const { return static_cast<int>(transports_.size()); }
  keras_ring::LocalTransport& transport(int r) { return *transports_[static_cast<size_t>(r)]; }

  // Runs fn(rank, transport) on one thread per rank and joins them all.
  void Run(const std::function<void(int rank, keras_ring::Transport& t)>& fn);

  // Records a failure if any channel still holds bytes: every collective must consume
  // exactly what its peers sent. Call after Run, with no thread using the transports.
  void CheckDrained(const char* file, int line);

 private:
  std::shared_ptr<keras_ring::LocalFabric> fabric_;
  std::vector<std::unique_ptr<keras_ring::LocalTransport>> transports_;
};

// Element i of a buffer of `dtype`, as a double (16-bit floats via the core's conversions).
double GetAsDouble(keras_ring::DataType dtype, const void* buf, size_t i);
// Stores v (which the caller makes exactly representable) as element i.
void SetFromDouble(keras_ring::DataType dtype, void* buf, size_t i, double v);

bool IsFloat(keras_ring::DataType dtype);

// The dtypes and ops every collective supports.
const std::vector<keras_ring::DataType>& AllDataTypes();
const std::vector<keras_ring::ReduceOp>& AllReduceOps();

// A tensor of `dtype` and `shape` read from `in` and written to `out` (may be equal).
keras_ring::TensorRef Tensor(keras_ring::DataType dtype, std::vector<int64_t> shape,
                             const void* in, void* out);

// A deterministic hash of a few integers, for test inputs.
uint64_t Mix(uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0);

// v[i] for an int index (the tests count ranks in int, containers in size_t).
template <typename V>
auto& At(V& v, int i) {
  return v[static_cast<size_t>(i)];
}

// A socket listening on an ephemeral loopback port; returns the fd and sets *port.
int ListenOnLoopback(int* port);

// One host transport per rank (TCP mesh over loopback, shared memory between ranks with the
// same hosts[r], tiny shm rings), connected like a job whose rank r lives on host hosts[r].
std::vector<std::unique_ptr<keras_ring::Transport>> ConnectHostWorld(const std::vector<int>& hosts,
                                                                     uint64_t token);

// ConnectHostWorld's job, each rank's status returned instead of checked, with the start
// timeout given; where `moved` >= 0, every rank's table gives rank `moved` as `moved_to`
// (the address its peers connect to) instead of its real listener.
std::vector<keras_ring::Status> TryConnectHostWorld(
    const std::vector<int>& hosts, uint64_t token, double timeout_seconds,
    std::vector<std::unique_ptr<keras_ring::Transport>>* out, int moved = -1,
    const keras_ring::PeerAddress& moved_to = {});

// Runs fn(rank, transport) on one thread per rank of `world` (null entries skipped) and
// joins them all.
void RunAll(std::vector<std::unique_ptr<keras_ring::Transport>>& world,
            const std::function<void(int, keras_ring::Transport&)>& fn);

inline double SecondsSince(keras_ring::Clock::time_point start) {
  return std::chrono::duration<double>(keras_ring::Clock::now() - start).count();
}

}  // namespace kr_test
