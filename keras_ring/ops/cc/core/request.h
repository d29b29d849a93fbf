// One collective as submitted by a kernel (or the C API): what it is, on which buffers, and
// where its data lives, which decides the executor that runs it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "signature.h"

namespace keras_ring {

struct TensorRef {
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  const void* input = nullptr;
  void* output = nullptr;  // may equal input (in place); null for allgather until allocated
  int64_t num_elements() const;
  size_t num_bytes() const { return static_cast<size_t>(num_elements()) * DataTypeSize(dtype); }
};

// Where a collective's data lives: host memory (the ring over the transport) or device
// memory (NCCL). Part of the signature, so ranks cannot disagree about it silently.
enum class Placement : int32_t { kHost = 0, kDevice = 1 };

// What a device executor attaches to a request when it is submitted (for NCCL: the point
// on the caller's stream where the inputs are ready). Opaque to the runtime.
struct DeviceTicket {
  virtual ~DeviceTicket() = default;
};

// The device communicator a collective runs on, set by the device executor just before it
// agrees. Communicators are made collectively, in the same order on every rank, so equal
// ordinals name the same communicator; a rank that would use another one (or make a new one
// while its peers reuse theirs) must be a mismatch, not two ranks waiting on different
// communicators until both time out.
struct DeviceComm {
  int32_t ordinal = -1;  // -1: none (host data)
  bool creates = false;  // this collective makes communicator `ordinal`
  int32_t device = -1;   // the GPU, for messages (ranks use different ones)
};

struct Request {
  Kind kind = Kind::kAllreduce;
  std::string name;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<TensorRef> tensors;
  // Allgather and alltoall: allocates the output for `total_rows` rows; sets tensors[0].output.
  std::function<Status(int64_t total_rows, void** output)> allocate_output;
  // Alltoall: rows of tensors[0] for each rank in rank order (empty: equal parts), and where
  // the rows received from each rank are written (size() entries).
  std::vector<int64_t> splits;
  int32_t* received_splits = nullptr;
  // Join: where the rank that joined last is written once every rank joined.
  int32_t* last_joined = nullptr;
  uint64_t joined_at = 0;  // join: the sequence number at which this rank joined
  Placement placement = Placement::kHost;
  std::shared_ptr<DeviceTicket> device_ticket;  // with kDevice: the device executor's
  DeviceComm device_comm;                       // with kDevice: set by the device executor
  bool may_yield = false;  // waits may yield the core (an eager call; a chain: Runtime)
  // Submitted while another request of this name was pending on this rank (set by Runtime):
  // concurrent callers, whose order no rank shares. Its signature fails it on every rank.
  bool concurrent = false;
  // Called exactly once: from the runtime's worker, from the submitting thread when the
  // runtime ran the request there (SubmitOrRun), or from Submit when it cannot take it.
  std::function<void(const Status&)> done;
  Clock::time_point submitted{};  // set by Submit, for the timeline
};

// Reducescatter: how many of `rows` rows each of `size` ranks gets, in rank order (the first
// rows % size ranks one more, as Horovod splits them).
std::vector<int64_t> ReducescatterRows(int64_t rows, int size);

// `request`'s signature as the `seq`-th collective: what every rank must agree on.
Signature SignatureOf(const Request& request, uint64_t seq);

}  // namespace keras_ring
