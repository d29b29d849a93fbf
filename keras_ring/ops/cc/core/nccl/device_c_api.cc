#include "device_c_api.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <memory>
#include <string>
#include <utility>

#include "../runtime.h"
#include "backend.h"
#include "device_api.h"

using keras_ring::Code;
using keras_ring::DataType;
using keras_ring::Kind;
using keras_ring::Request;
using keras_ring::Runtime;
using keras_ring::Status;
using keras_ring::TensorRef;

namespace {

int Report(const Status& s, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    std::strncpy(err, s.message().c_str(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return static_cast<int>(s.code());
}

TensorRef Tensor(int dtype, std::vector<int64_t> shape, const void* input, void* output) {
  TensorRef t;
  t.dtype = static_cast<DataType>(dtype);
  t.shape = std::move(shape);
  t.input = input;
  t.output = output;
  return t;
}

// Validates, attaches the NCCL backend and waits for the result.
int RunOnDevice(Request request, int device, void* stream, char* err, size_t err_len) {
  std::shared_ptr<Runtime> runtime = Runtime::Get();
  if (runtime == nullptr) {
    return Report(Status(Code::kFailedPrecondition,
                         "keras_ring has not been initialized; call keras_ring_init() first"),
                  err, err_len);
  }
  for (const TensorRef& t : request.tensors) {
    if (!keras_ring::IsValidDataType(static_cast<int32_t>(t.dtype))) {
      return Report(Status(Code::kInvalidArgument, "unknown dtype " +
                                                       std::to_string(static_cast<int>(t.dtype))),
                    err, err_len);
    }
  }
  keras_ring::nccl::AttachNccl(*runtime, device, stream, &request);
  return Report(runtime->Run(std::move(request)), err, err_len);
}

// The runtime's GPU backend if it made one (asking does not make one), else null.
keras_ring::nccl::NcclBackend* ExistingBackend(Runtime* runtime) {
  if (runtime == nullptr) return nullptr;
  keras_ring::Executor* executor = runtime->device_executor(
      [](keras_ring::HostExecutor&) { return std::unique_ptr<keras_ring::Executor>(); });
  return dynamic_cast<keras_ring::nccl::NcclBackend*>(executor);
}

}  // namespace

extern "C" {

void keras_ring_nccl_set_search_path(const char* dirs) {
  keras_ring::nccl::SetLibrarySearchPath(dirs != nullptr ? dirs : "");
}

int keras_ring_nccl_probe(const char* dirs, int* version, char* err, size_t err_len) {
  int v = 0;
  Status s = keras_ring::nccl::ProbeNccl(dirs != nullptr ? dirs : "", &v);
  if (version != nullptr) *version = s.ok() ? v : 0;
  return Report(s, err, err_len);
}

int keras_ring_device_allreduce(const void* input, void* output, int64_t count, int dtype,
                                int reduce_op, double prescale, double postscale, int device,
                                void* stream, const char* name, char* err, size_t err_len) {
  return keras_ring_device_grouped_allreduce(&input, &output, &count, &dtype, 1, reduce_op,
                                             prescale, postscale, device, stream, name, err,
                                             err_len);
}

// Places a gathered or exchanged output of `total_rows` rows into the caller's buffer.
std::function<Status(int64_t, void**)> IntoBuffer(void* output, int64_t output_rows,
                                                  const char* what) {
  return [output, output_rows, what](int64_t total_rows, void** out) -> Status {
    if (total_rows > output_rows) {
      return Status(Code::kInvalidArgument, "the output holds " + std::to_string(output_rows) +
                                                " rows, the " + what + " needs " +
                                                std::to_string(total_rows));
    }
    *out = output;
    return Status::OK();
  };
}

int keras_ring_device_allgather(const void* input, void* output, int64_t rows,
                                int64_t row_elems, int64_t output_rows, int dtype, int device,
                                void* stream, const char* name, char* err, size_t err_len) {
  Request r;
  r.kind = Kind::kAllgather;
  r.name = name != nullptr ? name : "";
  r.tensors.push_back(Tensor(dtype, {rows, row_elems}, input, nullptr));
  r.allocate_output = IntoBuffer(output, output_rows, "allgather");
  return RunOnDevice(std::move(r), device, stream, err, err_len);
}

int keras_ring_device_reducescatter(const void* input, void* output, int64_t rows,
                                    int64_t row_elems, int dtype, int reduce_op,
                                    double prescale, double postscale, int device, void* stream,
                                    const char* name, char* err, size_t err_len) {
  if (!keras_ring::IsValidReduceOp(reduce_op)) {
    return Report(Status(Code::kInvalidArgument, "unknown reduce_op " + std::to_string(reduce_op)),
                  err, err_len);
  }
  Request r;
  r.kind = Kind::kReducescatter;
  r.name = name != nullptr ? name : "";
  r.op = static_cast<keras_ring::ReduceOp>(reduce_op);
  r.prescale = prescale;
  r.postscale = postscale;
  r.tensors.push_back(Tensor(dtype, {rows, row_elems}, input, output));
  return RunOnDevice(std::move(r), device, stream, err, err_len);
}

int keras_ring_device_alltoall(const void* input, void* output, int64_t rows,
                               int64_t row_elems, int64_t output_rows, const int64_t* splits,
                               int n_splits, int32_t* received_splits, int dtype, int device,
                               void* stream, const char* name, char* err, size_t err_len) {
  Request r;
  r.kind = Kind::kAlltoall;
  r.name = name != nullptr ? name : "";
  r.tensors.push_back(Tensor(dtype, {rows, row_elems}, input, nullptr));
  if (splits != nullptr && n_splits > 0) r.splits.assign(splits, splits + n_splits);
  r.received_splits = received_splits;
  r.allocate_output = IntoBuffer(output, output_rows, "alltoall");
  return RunOnDevice(std::move(r), device, stream, err, err_len);
}

int keras_ring_device_broadcast(const void* input, void* output, int64_t count, int dtype,
                                int root, int device, void* stream, const char* name,
                                char* err, size_t err_len) {
  Request r;
  r.kind = Kind::kBroadcast;
  r.name = name != nullptr ? name : "";
  r.root = root;
  r.tensors.push_back(Tensor(dtype, {count}, input, output));
  return RunOnDevice(std::move(r), device, stream, err, err_len);
}

int keras_ring_device_grouped_allreduce(const void* const* inputs, void* const* outputs,
                                        const int64_t* counts, const int* dtypes, int n,
                                        int reduce_op, double prescale, double postscale,
                                        int device, void* stream, const char* name, char* err,
                                        size_t err_len) {
  if (!keras_ring::IsValidReduceOp(reduce_op)) {
    return Report(Status(Code::kInvalidArgument, "unknown reduce_op " + std::to_string(reduce_op)),
                  err, err_len);
  }
  if (n < 0) {
    return Report(Status(Code::kInvalidArgument, "negative tensor count " + std::to_string(n)),
                  err, err_len);
  }
  Request r;
  r.kind = n == 1 ? Kind::kAllreduce : Kind::kGroupedAllreduce;  // one tensor: a plain one
  r.name = name != nullptr ? name : "";
  r.op = static_cast<keras_ring::ReduceOp>(reduce_op);
  r.prescale = prescale;
  r.postscale = postscale;
  for (int i = 0; i < n; ++i) {
    r.tensors.push_back(Tensor(dtypes[i], {counts[i]}, inputs[i], outputs[i]));
  }
  return RunOnDevice(std::move(r), device, stream, err, err_len);
}

int keras_ring_device_allreduce_window(void* const* buffers, int k, int64_t count, int dtype,
                                       int reduce_op, int n, int window, int device,
                                       void* stream, double* seconds, char* err,
                                       size_t err_len) {
  std::shared_ptr<Runtime> runtime = Runtime::Get();
  if (runtime == nullptr || k < 1 || window < 1 || n < 0 ||
      !keras_ring::IsValidDataType(dtype) || !keras_ring::IsValidReduceOp(reduce_op)) {
    return Report(Status(runtime == nullptr ? Code::kFailedPrecondition : Code::kInvalidArgument,
                         runtime == nullptr ? "keras_ring has not been initialized"
                                            : "bad arguments to allreduce_window"),
                  err, err_len);
  }
  struct Outstanding {
    std::mutex mu;
    std::condition_variable cv;
    int completed = 0;
    Status first;
  } out;
  const auto start = keras_ring::Clock::now();
  for (int i = 0; i < n; ++i) {
    {
      // Bounded: the runtime completes every request by its deadline.
      std::unique_lock<std::mutex> lock(out.mu);
      out.cv.wait(lock, [&] { return i - out.completed < window; });
    }
    void* buffer = buffers[i % k];
    Request r;
    r.kind = Kind::kAllreduce;
    // One name per collective (the same on every rank): one name pending twice is refused.
    r.name = "window." + std::to_string(i);
    r.op = static_cast<keras_ring::ReduceOp>(reduce_op);
    r.tensors.push_back(Tensor(dtype, {count}, buffer, buffer));
    keras_ring::nccl::AttachNccl(*runtime, device, stream, &r);
    r.done = [&out](const Status& s) {
      std::lock_guard<std::mutex> lock(out.mu);
      if (out.first.ok() && !s.ok()) out.first = s;
      out.completed++;
      out.cv.notify_all();
    };
    runtime->Submit(std::move(r));
  }
  std::unique_lock<std::mutex> lock(out.mu);
  out.cv.wait(lock, [&] { return out.completed == n; });
  if (seconds != nullptr) {
    *seconds = std::chrono::duration<double>(keras_ring::Clock::now() - start).count();
  }
  return Report(out.first, err, err_len);
}

int keras_ring_device_objects(int64_t* events, int64_t* communicators) {
  *events = 0;
  *communicators = 0;
  std::shared_ptr<Runtime> runtime = Runtime::Get();
  if (keras_ring::nccl::NcclBackend* backend = ExistingBackend(runtime.get())) {
    *events = backend->events_made();
    *communicators = backend->communicator_count();
  }
  return 0;
}

int keras_ring_device_agreement_rounds(int64_t* rounds) {
  *rounds = 0;
  std::shared_ptr<Runtime> runtime = Runtime::Get();
  if (keras_ring::nccl::NcclBackend* backend = ExistingBackend(runtime.get())) {
    *rounds = backend->agreement_rounds();
  }
  return 0;
}

}  // extern "C"
