// The collective kernels, shared by the CPU registrations (kernels.cc) and the GPU ones
// (gpu_kernels.cc). Each validates and hands the request to the runtime. On the CPU, when
// the runtime is idle, the collective runs on the calling thread and done() is called before
// ComputeAsync returns (no thread hand-offs; TensorFlow then finishes the op inline); else it
// is queued and done() comes from the runtime's worker. On a GPU the
// request additionally becomes a device collective that NCCL runs on the runtime's stream.
#pragma once

#include <memory>
#include <string>

#include "tensorflow/core/framework/op_kernel.h"

#include "../core/runtime.h"

namespace keras_ring_tf {

// Makes `request` a device collective ordered after the work TensorFlow queued so far on
// the op's GPU stream. Defined in gpu_kernels.cc.
absl::Status AttachToGpuStream(::tensorflow::OpKernelContext* ctx, ::keras_ring::Runtime& runtime,
                               ::keras_ring::Request* request);

// Base for every collective kernel: the common attributes, the runtime lookup and the
// hand-over to the runtime.
class CollectiveKernel : public ::tensorflow::AsyncOpKernel {
 public:
  explicit CollectiveKernel(::tensorflow::OpKernelConstruction* c);

 protected:
  // Null (with the context's status set) when init() has not run.
  std::shared_ptr<::keras_ring::Runtime> GetRuntime(::tensorflow::OpKernelContext* ctx);
  void Submit(::keras_ring::Runtime& runtime, ::keras_ring::Request request,
              ::tensorflow::OpKernelContext* ctx, DoneCallback done);

  std::string tensor_name_;
  bool on_gpu_ = false;
};

class ReduceKernel : public CollectiveKernel {
 public:
  explicit ReduceKernel(::tensorflow::OpKernelConstruction* c);

 protected:
  ::keras_ring::Request MakeRequest(::keras_ring::Kind kind) const;

 private:
  ::keras_ring::ReduceOp op_ = ::keras_ring::ReduceOp::kSum;
  double prescale_ = 1.0;
  double postscale_ = 1.0;
};

class AllreduceKernel : public ReduceKernel {
 public:
  using ReduceKernel::ReduceKernel;
  void ComputeAsync(::tensorflow::OpKernelContext* ctx, DoneCallback done) override;
};

class GroupedAllreduceKernel : public ReduceKernel {
 public:
  using ReduceKernel::ReduceKernel;
  void ComputeAsync(::tensorflow::OpKernelContext* ctx, DoneCallback done) override;
};

class AllgatherKernel : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;
  void ComputeAsync(::tensorflow::OpKernelContext* ctx, DoneCallback done) override;
};

class BroadcastKernel : public CollectiveKernel {
 public:
  explicit BroadcastKernel(::tensorflow::OpKernelConstruction* c);
  void ComputeAsync(::tensorflow::OpKernelContext* ctx, DoneCallback done) override;

 private:
  int root_ = 0;
};

}  // namespace keras_ring_tf
