// The collective kernels (declared in kernels.h) and their CPU registrations.
#include "kernels.h"

#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>

#include "tensorflow/core/framework/tensor.h"

namespace keras_ring_tf {

namespace kr = ::keras_ring;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

namespace {

kr::DataType ToCore(::tensorflow::DataType t) {
  switch (t) {
    case ::tensorflow::DT_HALF: return kr::DataType::kFloat16;
    case ::tensorflow::DT_BFLOAT16: return kr::DataType::kBFloat16;
    case ::tensorflow::DT_FLOAT: return kr::DataType::kFloat32;
    case ::tensorflow::DT_DOUBLE: return kr::DataType::kFloat64;
    case ::tensorflow::DT_INT8: return kr::DataType::kInt8;
    case ::tensorflow::DT_UINT8: return kr::DataType::kUInt8;
    case ::tensorflow::DT_INT32: return kr::DataType::kInt32;
    case ::tensorflow::DT_INT64: return kr::DataType::kInt64;
    default: return kr::DataType::kBool;  // the op registrations admit nothing else
  }
}

absl::Status ToTf(const kr::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(s.code())), s.message());
}

kr::TensorRef Ref(const Tensor& in, Tensor* out) {
  kr::TensorRef ref;
  ref.dtype = ToCore(in.dtype());
  for (int i = 0; i < in.dims(); ++i) ref.shape.push_back(in.dim_size(i));
  ref.input = in.tensor_data().data();
  ref.output = out != nullptr ? const_cast<char*>(out->tensor_data().data()) : nullptr;
  return ref;
}

}  // namespace

CollectiveKernel::CollectiveKernel(OpKernelConstruction* c)
    : AsyncOpKernel(c),
      on_gpu_(c->device_type() == ::tensorflow::DeviceType(::tensorflow::DEVICE_GPU)) {
  OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &tensor_name_));
}

std::shared_ptr<kr::Runtime> CollectiveKernel::GetRuntime(OpKernelContext* ctx) {
  auto runtime = kr::Runtime::Get();
  if (runtime == nullptr) {
    ctx->SetStatus(absl::FailedPreconditionError(
        "keras_ring has not been initialized; call keras_ring.init() first"));
  }
  return runtime;
}

void CollectiveKernel::Submit(kr::Runtime& runtime, kr::Request request, OpKernelContext* ctx,
                              DoneCallback done) {
  request.name = tensor_name_;
  if (on_gpu_) {
    const absl::Status s = AttachToGpuStream(ctx, runtime, &request);
    if (!s.ok()) {
      ctx->SetStatus(s);
      done();
      return;
    }
  }
  request.done = [ctx, done = std::move(done)](const kr::Status& s) {
    if (!s.ok()) ctx->SetStatus(ToTf(s));
    done();
  };
  if (on_gpu_) {
    runtime.Submit(std::move(request));  // NCCL runs on the worker, ordered with the stream
  } else {
    runtime.SubmitOrRun(std::move(request));
  }
}

namespace {

// A scale factor attr: a string holding a finite double (see ops.cc).
absl::Status GetFactor(OpKernelConstruction* c, const char* attr, double* out) {
  std::string text;
  TF_RETURN_IF_ERROR(c->GetAttr(attr, &text));
  char* end = nullptr;
  *out = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(*out)) {
    return absl::InvalidArgumentError(std::string(attr) + " must be a finite number, got '" +
                                      text + "'");
  }
  return absl::OkStatus();
}

}  // namespace

ReduceKernel::ReduceKernel(OpKernelConstruction* c) : CollectiveKernel(c) {
  int op = 0;
  OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op));
  OP_REQUIRES(c, kr::IsValidReduceOp(op),
              absl::InvalidArgumentError("unknown reduce_op " + std::to_string(op)));
  op_ = static_cast<kr::ReduceOp>(op);
  OP_REQUIRES_OK(c, GetFactor(c, "prescale_factor", &prescale_));
  OP_REQUIRES_OK(c, GetFactor(c, "postscale_factor", &postscale_));
}

kr::Request ReduceKernel::MakeRequest(kr::Kind kind) const {
  kr::Request r;
  r.kind = kind;
  r.op = op_;
  r.prescale = prescale_;
  r.postscale = postscale_;
  return r;
}

void AllreduceKernel::ComputeAsync(OpKernelContext* ctx, DoneCallback done) {
  auto runtime = GetRuntime(ctx);
  if (runtime == nullptr) return done();
  const Tensor& in = ctx->input(0);
  Tensor* out = nullptr;
  OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({0}, 0, in.shape(), &out),
                       done);
  kr::Request r = MakeRequest(kr::Kind::kAllreduce);
  r.tensors.push_back(Ref(in, out));
  Submit(*runtime, std::move(r), ctx, std::move(done));
}

void GroupedAllreduceKernel::ComputeAsync(OpKernelContext* ctx, DoneCallback done) {
  auto runtime = GetRuntime(ctx);
  if (runtime == nullptr) return done();
  kr::Request r = MakeRequest(kr::Kind::kGroupedAllreduce);
  for (int i = 0; i < ctx->num_inputs(); ++i) {
    const Tensor& in = ctx->input(i);
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({i}, i, in.shape(), &out),
                         done);
    r.tensors.push_back(Ref(in, out));
  }
  Submit(*runtime, std::move(r), ctx, std::move(done));
}

void AllgatherKernel::ComputeAsync(OpKernelContext* ctx, DoneCallback done) {
  auto runtime = GetRuntime(ctx);
  if (runtime == nullptr) return done();
  const Tensor& in = ctx->input(0);
  kr::Request r;
  r.kind = kr::Kind::kAllgather;
  r.tensors.push_back(Ref(in, nullptr));
  if (in.dims() == 0) r.tensors[0].shape = {1};  // a scalar is one row
  const TensorShape row_shape = [&] {
    TensorShape s = in.shape();
    if (s.dims() > 0) s.RemoveDim(0);
    return s;
  }();
  // Runs on the worker once every rank's row count is known.
  r.allocate_output = [ctx, row_shape](int64_t rows, void** output) -> kr::Status {
    TensorShape shape({rows});
    shape.AppendShape(row_shape);
    Tensor* out = nullptr;
    absl::Status s = ctx->allocate_output(0, shape, &out);
    if (!s.ok()) return kr::Status(kr::Code::kResourceExhausted, std::string(s.message()));
    *output = const_cast<char*>(out->tensor_data().data());
    return kr::Status::OK();
  };
  Submit(*runtime, std::move(r), ctx, std::move(done));
}

BroadcastKernel::BroadcastKernel(OpKernelConstruction* c) : CollectiveKernel(c) {
  OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_));
}

void BroadcastKernel::ComputeAsync(OpKernelContext* ctx, DoneCallback done) {
  auto runtime = GetRuntime(ctx);
  if (runtime == nullptr) return done();
  // The root's range is checked with the signatures, so every rank fails alike even
  // when only one of them names a bad root.
  const Tensor& in = ctx->input(0);
  Tensor* out = nullptr;
  OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({0}, 0, in.shape(), &out),
                       done);
  kr::Request r;
  r.kind = kr::Kind::kBroadcast;
  r.root = root_;
  r.tensors.push_back(Ref(in, out));
  Submit(*runtime, std::move(r), ctx, std::move(done));
}

REGISTER_KERNEL_BUILDER(Name("KerasRingAllreduce").Device(::tensorflow::DEVICE_CPU),
                        AllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingGroupedAllreduce").Device(::tensorflow::DEVICE_CPU),
                        GroupedAllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingAllgather").Device(::tensorflow::DEVICE_CPU),
                        AllgatherKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingBroadcast").Device(::tensorflow::DEVICE_CPU),
                        BroadcastKernel);

}  // namespace keras_ring_tf
