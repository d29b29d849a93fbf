// GPU registrations of the collective kernels, in the same library as the CPU ones. The
// kernels are the shared ones of kernels.h; on a GPU their requests run through NCCL
// (core/nccl), which is loaded at run time, so this file needs no CUDA headers: TensorFlow's
// stream is reached through the public StreamExecutor interface that the pip package ships
// (xla/stream_executor/stream.h): Stream::platform_specific_handle() gives the CUstream,
// which is the cudaStream_t the backend orders its work against, and
// Stream::parent()->device_ordinal() gives the CUDA device. Both are virtual calls, so no
// private TensorFlow symbol is linked. On a machine without GPUs these registrations are
// inert: TensorFlow never places an op on a GPU it does not have.
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"

#include "../core/nccl/backend.h"
#include "kernels.h"

namespace keras_ring_tf {

namespace {

using ::tensorflow::DataType;

// int32 is left out on purpose: TensorFlow keeps int32 tensors of GPU ops in host memory,
// so an int32 collective placed on a GPU runs on the CPU kernel instead (soft placement).
constexpr DataType kReduceTypes[] = {
    ::tensorflow::DT_HALF,  ::tensorflow::DT_BFLOAT16, ::tensorflow::DT_FLOAT,
    ::tensorflow::DT_DOUBLE, ::tensorflow::DT_INT8,    ::tensorflow::DT_UINT8,
    ::tensorflow::DT_INT64};
constexpr DataType kMoveTypes[] = {
    ::tensorflow::DT_HALF,  ::tensorflow::DT_BFLOAT16, ::tensorflow::DT_FLOAT,
    ::tensorflow::DT_DOUBLE, ::tensorflow::DT_INT8,    ::tensorflow::DT_UINT8,
    ::tensorflow::DT_INT64, ::tensorflow::DT_BOOL};

}  // namespace

absl::Status AttachToGpuStream(::tensorflow::OpKernelContext* ctx, ::keras_ring::Runtime& runtime,
                               ::keras_ring::Request* request) {
  // The data inputs come first (alltoall's splits follow, in host memory by registration).
  const int data_inputs = static_cast<int>(request->tensors.size());
  for (int i = 0; i < data_inputs; ++i) {
    if (ctx->input_memory_type(i) != ::tensorflow::DEVICE_MEMORY) {
      return absl::InternalError("keras_ring: GPU kernel " + ctx->op_kernel().name() +
                                 " got input " + std::to_string(i) + " in host memory");
    }
  }
  ::tensorflow::DeviceContext* device_context = ctx->op_device_context();
  ::stream_executor::Stream* stream =
      device_context != nullptr ? device_context->stream() : nullptr;
  if (stream == nullptr) {
    return absl::FailedPreconditionError("keras_ring: no GPU stream for " +
                                         ctx->op_kernel().name());
  }
  void* handle = stream->platform_specific_handle().stream;
  if (handle == nullptr) {
    return absl::UnimplementedError(
        "keras_ring: this TensorFlow's GPU stream has no CUDA stream handle; keras_ring's GPU "
        "collectives need a CUDA build of TensorFlow");
  }
  ::keras_ring::nccl::AttachNccl(runtime, stream->parent()->device_ordinal(), handle, request);
  return absl::OkStatus();
}

REGISTER_KERNEL_BUILDER(Name("KerasRingAllreduce")
                            .Device(::tensorflow::DEVICE_GPU)
                            .TypeConstraint("T", kReduceTypes)
                            .HostMemory("tensor_name"),
                        AllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingGroupedAllreduce")
                            .Device(::tensorflow::DEVICE_GPU)
                            .TypeConstraint("T", kReduceTypes)
                            .HostMemory("tensor_name"),
                        GroupedAllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingAllgather")
                            .Device(::tensorflow::DEVICE_GPU)
                            .TypeConstraint("T", kMoveTypes)
                            .HostMemory("tensor_name"),
                        AllgatherKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingBroadcast")
                            .Device(::tensorflow::DEVICE_GPU)
                            .TypeConstraint("T", kMoveTypes)
                            .HostMemory("tensor_name"),
                        BroadcastKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingReducescatter")
                            .Device(::tensorflow::DEVICE_GPU)
                            .TypeConstraint("T", kReduceTypes)
                            .HostMemory("tensor_name"),
                        ReducescatterKernel);
// The splits are read when the request is built and the received splits written by the
// worker, both on the host. TensorFlow would place these int32 tensors in host memory anyway
// (as for every int32 tensor of a GPU kernel); HostMemory says so where it is relied on.
REGISTER_KERNEL_BUILDER(Name("KerasRingAlltoall")
                            .Device(::tensorflow::DEVICE_GPU)
                            .TypeConstraint("T", kMoveTypes)
                            .HostMemory("tensor_name")
                            .HostMemory("splits")
                            .HostMemory("received_splits"),
                        AlltoallKernel);

}  // namespace keras_ring_tf
