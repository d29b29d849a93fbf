// The collective kernels (declared in kernels.h) and their CPU registrations.
#include "kernels.h"

#include <sys/mman.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "tensorflow/core/framework/tensor.h"

#include "error_registry.h"

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
    case ::tensorflow::DT_INT16: return kr::DataType::kInt16;
    case ::tensorflow::DT_UINT16: return kr::DataType::kUInt16;
    case ::tensorflow::DT_INT32: return kr::DataType::kInt32;
    case ::tensorflow::DT_INT64: return kr::DataType::kInt64;
    default: return kr::DataType::kBool;  // the op registrations admit nothing else
  }
}

kr::TensorRef Ref(const Tensor& in, Tensor* out) {
  kr::TensorRef ref;
  ref.dtype = ToCore(in.dtype());
  for (int i = 0; i < in.dims(); ++i) ref.shape.push_back(in.dim_size(i));
  ref.input = in.tensor_data().data();
  ref.output = out != nullptr ? const_cast<char*>(out->tensor_data().data()) : nullptr;
  return ref;
}

// Fresh memory from the allocator is faulted in a 4 KiB page at a time as the collective
// first writes it, and glibc hands out every allocation from 32 MiB up as a new mapping, so a
// large output pays that each call (64 MiB: ~50 ms of faults on a VM, more than the transfer).
// Huge pages cut the faults 512-fold. Advice only: the memory is TensorFlow's and stays so,
// and where THP is off the call changes nothing.
constexpr uintptr_t kHugePage = 2u << 20;

void AdviseHugePages(const Tensor& t, size_t min_bytes) {
  if (min_bytes == 0 || t.TotalBytes() < min_bytes) return;
  const auto start = reinterpret_cast<uintptr_t>(t.tensor_data().data());
  const uintptr_t first = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (start + t.TotalBytes()) & ~(kHugePage - 1);
  if (end > first) madvise(reinterpret_cast<void*>(first), end - first, MADV_HUGEPAGE);
}

}  // namespace

absl::Status ToTf(const kr::Status& s) {
  if (s.ok()) return absl::OkStatus();
  RememberError(s);  // its structure, for Python (error_registry.h)
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(s.code())), s.message());
}

CollectiveKernel::CollectiveKernel(OpKernelConstruction* c)
    : AsyncOpKernel(c),
      on_gpu_(c->device_type() == ::tensorflow::DeviceType(::tensorflow::DEVICE_GPU)) {
  OP_REQUIRES_OK(c, c->GetAttr("eager", &eager_));
  OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &process_set_id_));
  // Graphs' CPU collectives only: the runtime's idle path runs them on the calling thread
  // anyway, and the ops of one graph are chained, so one waits at a time. Eager ops stay
  // async (TensorFlow runs them on the caller either way); GPU ones complete on the stream.
  std::shared_ptr<kr::Runtime> runtime = kr::Runtime::Get(process_set_id_);
  sync_ = !on_gpu_ && !eager_ && (runtime == nullptr || runtime->options().sync_graph_kernels);
}

absl::Status CollectiveKernel::ForwardOrAllocate(OpKernelContext* ctx, int index,
                                                 Tensor** out) const {
  const TensorShape& shape = ctx->input(index).shape();
  if (ctx->forward_input_to_output_with_shape(index, index, shape, out)) {
    return absl::OkStatus();  // the input's memory, already written by its producer
  }
  return Allocate(ctx, index, shape, out);
}

absl::Status CollectiveKernel::Allocate(OpKernelContext* ctx, int index, const TensorShape& shape,
                                        Tensor** out) const {
  TF_RETURN_IF_ERROR(ctx->allocate_output(index, shape, out));
  if ((*out)->TotalBytes() >= kHugePage) AdviseHugePages(**out, HugePageBytes());
  return absl::OkStatus();
}

size_t CollectiveKernel::HugePageBytes() const {
  if (on_gpu_) return 0;
  // Read per call: an eager kernel outlives the runtime it was first made under.
  std::shared_ptr<kr::Runtime> runtime = kr::Runtime::Get(process_set_id_);
  return runtime != nullptr ? runtime->options().huge_page_output_bytes : 0;
}

void CollectiveKernel::ComputeAsync(OpKernelContext* ctx, DoneCallback done) {
  std::shared_ptr<kr::Runtime> runtime = kr::Runtime::Get(process_set_id_);
  if (runtime == nullptr) {
    ctx->SetStatus(ToTf(kr::NoRuntimeError(process_set_id_)));
    return done();
  }
  const Tensor& name = ctx->input(DataInputs(ctx));
  OP_REQUIRES_ASYNC(ctx, ::tensorflow::TensorShapeUtils::IsScalar(name.shape()),
                    absl::InvalidArgumentError(
                        "keras_ring: a collective's tensor_name must be a scalar string, got "
                        "shape " + name.shape().DebugString()),
                    done);
  kr::Request request;
  request.name = std::string(name.scalar<::tensorflow::tstring>()());
  request.may_yield = eager_ && !on_gpu_;
  OP_REQUIRES_OK_ASYNC(ctx, Build(ctx, &request), done);
  if (on_gpu_) OP_REQUIRES_OK_ASYNC(ctx, AttachToGpuStream(ctx, *runtime, &request), done);
  request.done = [ctx, done = std::move(done)](const kr::Status& s) {
    if (!s.ok()) ctx->SetStatus(ToTf(s));
    done();
  };
  if (on_gpu_) {
    runtime->Submit(std::move(request));  // NCCL runs on the worker, ordered with the stream
  } else {
    runtime->SubmitOrRun(std::move(request));
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

void ReduceKernel::SetReduction(kr::Request* r) const {
  r->op = op_;
  r->prescale = prescale_;
  r->postscale = postscale_;
}

absl::Status AllreduceKernel::Build(OpKernelContext* ctx, kr::Request* r) {
  const Tensor& in = ctx->input(0);
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ForwardOrAllocate(ctx, 0, &out));
  r->kind = kr::Kind::kAllreduce;
  SetReduction(r);
  r->tensors.push_back(Ref(in, out));
  return absl::OkStatus();
}

absl::Status GroupedAllreduceKernel::Build(OpKernelContext* ctx, kr::Request* r) {
  r->kind = kr::Kind::kGroupedAllreduce;
  SetReduction(r);
  for (int i = 0; i < DataInputs(ctx); ++i) {
    const Tensor& in = ctx->input(i);
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(ForwardOrAllocate(ctx, i, &out));
    r->tensors.push_back(Ref(in, out));
  }
  return absl::OkStatus();
}

namespace {

TensorShape RowShape(const Tensor& in) {
  TensorShape row_shape = in.shape();
  if (row_shape.dims() > 0) row_shape.RemoveDim(0);
  return row_shape;
}

}  // namespace

std::function<kr::Status(int64_t, void**)> CollectiveKernel::AllocateRows(
    OpKernelContext* ctx, const TensorShape& row_shape) const {
  // Looked up here: the worker must never hold its own runtime (the last reference would
  // then destroy it on the thread its destructor joins).
  const size_t huge_page_bytes = HugePageBytes();
  return [ctx, row_shape, huge_page_bytes](int64_t rows, void** output) -> kr::Status {
    TensorShape shape({rows});
    shape.AppendShape(row_shape);
    Tensor* out = nullptr;
    absl::Status s = ctx->allocate_output(0, shape, &out);
    if (!s.ok()) return kr::Status(kr::Code::kResourceExhausted, std::string(s.message()));
    AdviseHugePages(*out, huge_page_bytes);
    *output = const_cast<char*>(out->tensor_data().data());
    return kr::Status::OK();
  };
}

absl::Status AllgatherKernel::Build(OpKernelContext* ctx, kr::Request* r) {
  const Tensor& in = ctx->input(0);
  r->kind = kr::Kind::kAllgather;
  r->tensors.push_back(Ref(in, nullptr));
  if (in.dims() == 0) r->tensors[0].shape = {1};  // a scalar is one row
  r->allocate_output = AllocateRows(ctx, RowShape(in));
  return absl::OkStatus();
}

absl::Status ReducescatterKernel::Build(OpKernelContext* ctx, kr::Request* r) {
  const Tensor& in = ctx->input(0);
  std::shared_ptr<kr::Runtime> runtime = kr::Runtime::Get(process_set_id_);
  if (runtime == nullptr) return ToTf(kr::NoRuntimeError(process_set_id_));
  // A scalar goes on to the signatures, which refuse it on every rank (CheckSignatures).
  TensorShape shape;
  if (in.dims() > 0) {
    shape.AddDim(kr::ReducescatterRows(in.dim_size(0), runtime->size())
                     [static_cast<size_t>(runtime->rank())]);
    shape.AppendShape(RowShape(in));
  }
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(Allocate(ctx, 0, shape, &out));
  r->kind = kr::Kind::kReducescatter;
  SetReduction(r);
  r->tensors.push_back(Ref(in, out));
  return absl::OkStatus();
}

absl::Status AlltoallKernel::Build(OpKernelContext* ctx, kr::Request* r) {
  const Tensor& in = ctx->input(0);
  const Tensor& splits = ctx->input(1);
  std::shared_ptr<kr::Runtime> runtime = kr::Runtime::Get(process_set_id_);
  if (runtime == nullptr) return ToTf(kr::NoRuntimeError(process_set_id_));
  Tensor* received = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({runtime->size()}), &received));
  r->kind = kr::Kind::kAlltoall;
  r->tensors.push_back(Ref(in, nullptr));
  // Checked against the rows on every rank after the signatures (one verdict everywhere).
  const auto flat = splits.flat<int32_t>();
  r->splits.assign(flat.data(), flat.data() + flat.size());
  r->received_splits = received->flat<int32_t>().data();
  r->allocate_output = AllocateRows(ctx, RowShape(in));
  return absl::OkStatus();
}

BroadcastKernel::BroadcastKernel(OpKernelConstruction* c) : CollectiveKernel(c) {
  OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_));
}

absl::Status BroadcastKernel::Build(OpKernelContext* ctx, kr::Request* r) {
  // The root's range is checked with the signatures, so every rank fails alike even
  // when only one of them names a bad root.
  const Tensor& in = ctx->input(0);
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ForwardOrAllocate(ctx, 0, &out));
  r->kind = kr::Kind::kBroadcast;
  r->root = root_;
  r->tensors.push_back(Ref(in, out));
  return absl::OkStatus();
}

namespace {

// Forwards its input (no copy) and records a timeline mark: when the input was computed.
class TimelineMarkKernel : public ::tensorflow::OpKernel {
 public:
  explicit TimelineMarkKernel(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("label", &label_));
  }
  void Compute(OpKernelContext* ctx) override {
    if (std::shared_ptr<kr::Runtime> runtime = kr::Runtime::Get()) runtime->timeline().Mark(label_);
    ctx->set_output(0, ctx->input(0));
  }

 private:
  std::string label_;
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("KerasRingTimelineMark").Device(::tensorflow::DEVICE_CPU),
                        TimelineMarkKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingAllreduce").Device(::tensorflow::DEVICE_CPU),
                        AllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingGroupedAllreduce").Device(::tensorflow::DEVICE_CPU),
                        GroupedAllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingAllgather").Device(::tensorflow::DEVICE_CPU),
                        AllgatherKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingBroadcast").Device(::tensorflow::DEVICE_CPU),
                        BroadcastKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingReducescatter").Device(::tensorflow::DEVICE_CPU),
                        ReducescatterKernel);
REGISTER_KERNEL_BUILDER(Name("KerasRingAlltoall").Device(::tensorflow::DEVICE_CPU),
                        AlltoallKernel);

}  // namespace keras_ring_tf
