// What the NCCL backend's tests share: `n` runtimes over local transports, each rank with a
// fake GPU (nccl_fake.h) behind the backend's seam, and small request builders.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/local_transport.h"
#include "../core/nccl/backend.h"
#include "../core/runtime.h"
#include "nccl_fake.h"
#include "test_util.h"

namespace kr_test {

// The names every NCCL backend test uses.
namespace kn = keras_ring::nccl;
using keras_ring::Code;
using keras_ring::DataType;
using keras_ring::Kind;
using keras_ring::ReduceOp;
using keras_ring::Request;
using keras_ring::Status;

// A local transport whose liveness signal (PollPeerFailure, the control sockets' EOF on a
// real host transport) can be set by the test: a peer that died.
class WatchedLocalTransport : public keras_ring::LocalTransport {
 public:
  using LocalTransport::LocalTransport;
  keras_ring::Status PollPeerFailure() override {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }
  void SetPeerFailure(const keras_ring::Status& failure) {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = failure;
  }
  // The first cause this rank gave its peers (a clean shutdown is kCancelled).
  void AbortWith(const keras_ring::Status& cause) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!aborted_) abort_cause_ = cause;
      aborted_ = true;
    }
    LocalTransport::AbortWith(cause);
  }
  keras_ring::Status AbortCause() {
    std::lock_guard<std::mutex> lock(mu_);
    return abort_cause_;
  }

 private:
  std::mutex mu_;
  keras_ring::Status failure_;
  bool aborted_ = false;
  keras_ring::Status abort_cause_;
};

class GpuWorld {
 public:
  explicit GpuWorld(int n, double timeout_seconds = 10.0, int max_in_flight = 64)
      : fake(std::make_shared<FakeNcclWorld>(n)) {
    auto fabric = std::make_shared<keras_ring::LocalFabric>(n);
    for (int r = 0; r < n; ++r) {
      keras_ring::RuntimeOptions options;
      options.rank = r;
      options.size = n;
      options.timeout_seconds = timeout_seconds;
      options.stall_warning_seconds = 0;
      options.device_max_in_flight = max_in_flight;
      auto transport = std::make_unique<WatchedLocalTransport>(fabric, r);
      transports.push_back(transport.get());
      runtimes.push_back(std::make_unique<keras_ring::Runtime>(options, std::move(transport)));
      apis.push_back(std::make_shared<FakeDeviceApi>(fake, r));
    }
  }
  ~GpuWorld() { Shutdown(); }
  GpuWorld(const GpuWorld&) = delete;
  GpuWorld& operator=(const GpuWorld&) = delete;
  int size() const { return static_cast<int>(apis.size()); }

  // Makes `request` rank r's collective on GPU `device` (submitted from this thread).
  void Attach(int r, keras_ring::Request* request, int device = 0) {
    keras_ring::nccl::AttachNccl(*At(runtimes, r), device, CallerStream(r), request, At(apis, r));
  }
  // Runs the request on rank r, on the "GPU" unless on_device is false.
  keras_ring::Status Run(int r, keras_ring::Request request, bool on_device = true,
                         int device = 0) {
    if (on_device) Attach(r, &request, device);
    return At(runtimes, r)->Run(std::move(request));
  }
  // Rank r's NCCL backend (null before its first device collective).
  keras_ring::nccl::NcclBackend* Backend(int r) {
    keras_ring::Executor* executor = At(runtimes, r)->device_executor(
        [](keras_ring::HostExecutor&) { return std::unique_ptr<keras_ring::Executor>(); });
    return dynamic_cast<keras_ring::nccl::NcclBackend*>(executor);
  }
  // fn(rank) on one thread per rank.
  void Each(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r) threads.emplace_back(fn, r);
    for (std::thread& t : threads) t.join();
  }
  // Every rank shuts down at once, as separate processes would (a cooperative teardown
  // waits for the peers' own).
  void Shutdown() {
    Each([this](int r) { At(runtimes, r).reset(); });
    runtimes.clear();
  }

  std::shared_ptr<FakeNcclWorld> fake;
  std::vector<std::unique_ptr<keras_ring::Runtime>> runtimes;
  std::vector<WatchedLocalTransport*> transports;  // owned by the runtimes
  std::vector<std::shared_ptr<keras_ring::nccl::DeviceApi>> apis;
};

inline keras_ring::Request Allreduce(keras_ring::TensorRef t, keras_ring::ReduceOp op,
                                     double pre = 1.0, double post = 1.0,
                                     const std::string& name = "grad") {
  keras_ring::Request r;
  r.kind = keras_ring::Kind::kAllreduce;
  r.name = name;
  r.op = op;
  r.prescale = pre;
  r.postscale = post;
  r.tensors.push_back(std::move(t));
  return r;
}

// An in-place float32 allreduce of x (shape [size]).
inline keras_ring::Request InPlace(std::vector<float>& x,
                                   keras_ring::ReduceOp op = keras_ring::ReduceOp::kSum,
                                   double pre = 1.0) {
  return Allreduce(Tensor(keras_ring::DataType::kFloat32, {static_cast<int64_t>(x.size())},
                          x.data(), x.data()),
                   op, pre);
}

// Waits until `done()` holds (a condition, not a sleep); false after `seconds` (a hang guard).
inline bool WaitUntil(const std::function<bool()>& done, double seconds = 10.0) {
  const auto start = keras_ring::Clock::now();
  while (!done()) {
    if (SecondsSince(start) > seconds) return false;
    std::this_thread::yield();
  }
  return true;
}

// Index of the first log entry at or after `from` that starts with `prefix`, or -1.
inline int Find(const std::vector<std::string>& log, const std::string& prefix, int from = 0) {
  for (size_t i = static_cast<size_t>(std::max(from, 0)); i < log.size(); ++i) {
    if (log[i].compare(0, prefix.size(), prefix) == 0) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace kr_test
