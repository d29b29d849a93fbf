// The collective kernels, shared by the CPU registrations (kernels.cc) and the GPU ones
// (gpu_kernels.cc). Each validates and hands the request to the runtime. On the CPU, when
// the runtime is idle, the collective runs on the calling thread and done() is called before
// ComputeAsync returns (no thread hand-offs; TensorFlow then finishes the op inline); else it
// is queued and done() comes from the runtime's worker. On a GPU the
// request additionally becomes a device collective that NCCL runs on the runtime's stream.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "tensorflow/core/framework/op_kernel.h"

#include "../core/runtime.h"

namespace keras_ring_tf {

// Makes `request` a device collective ordered after the work TensorFlow queued so far on
// the op's GPU stream. Defined in gpu_kernels.cc.
absl::Status AttachToGpuStream(::tensorflow::OpKernelContext* ctx, ::keras_ring::Runtime& runtime,
                               ::keras_ring::Request* request);

// The TensorFlow status for a core status (its structure is remembered for Python).
absl::Status ToTf(const ::keras_ring::Status& s);

// Base for every collective kernel: the common attributes, the runtime lookup and the
// hand-over to the runtime. A kernel only says what its request is (Build).
class CollectiveKernel : public ::tensorflow::AsyncOpKernel {
 public:
  explicit CollectiveKernel(::tensorflow::OpKernelConstruction* c);
  void ComputeAsync(::tensorflow::OpKernelContext* ctx, DoneCallback done) final;
  // A synchronous kernel: TensorFlow's executor then calls Compute (ComputeAsync, waiting
  // for done) and runs the op's successor on this thread, instead of scheduling every
  // successor of an async op on its pool (a thread hand-off per collective in a chain).
  ::tensorflow::AsyncOpKernel* AsAsync() override { return sync_ ? nullptr : this; }

 protected:
  // Fills `request` (kind, tensors, ...) from the op's inputs, allocating what it must.
  virtual absl::Status Build(::tensorflow::OpKernelContext* ctx,
                             ::keras_ring::Request* request) = 0;

  // Output `index` in place of input `index` where TensorFlow allows it, else fresh memory.
  absl::Status ForwardOrAllocate(::tensorflow::OpKernelContext* ctx, int index,
                                 ::tensorflow::Tensor** out) const;
  // Output `index` of `shape` in fresh memory (huge pages advised from HugePageBytes()).
  absl::Status Allocate(::tensorflow::OpKernelContext* ctx, int index,
                        const ::tensorflow::TensorShape& shape, ::tensorflow::Tensor** out) const;
  // RuntimeOptions::huge_page_output_bytes of this op's runtime; 0 on a GPU or without one.
  size_t HugePageBytes() const;
  // Allocates output 0 with `rows` rows of `row_shape` once the runtime knows how many: on
  // the worker, after every rank's signature arrived.
  std::function<::keras_ring::Status(int64_t, void**)> AllocateRows(
      ::tensorflow::OpKernelContext* ctx, const ::tensorflow::TensorShape& row_shape) const;
  // How many of the op's inputs are data: all but the last, the collective's name.
  static int DataInputs(const ::tensorflow::OpKernelContext* ctx) {
    return ctx->num_inputs() - 1;
  }

 private:
  bool eager_ = false;
  bool on_gpu_ = false;
  bool sync_ = false;

 protected:
  int process_set_id_ = 0;  // the runtime (process set) this op's collectives run on
};

class ReduceKernel : public CollectiveKernel {
 public:
  explicit ReduceKernel(::tensorflow::OpKernelConstruction* c);

 protected:
  void SetReduction(::keras_ring::Request* request) const;

 private:
  ::keras_ring::ReduceOp op_ = ::keras_ring::ReduceOp::kSum;
  double prescale_ = 1.0;
  double postscale_ = 1.0;
};

class AllreduceKernel : public ReduceKernel {
 public:
  using ReduceKernel::ReduceKernel;

 protected:
  absl::Status Build(::tensorflow::OpKernelContext* ctx, ::keras_ring::Request* r) override;
};

class GroupedAllreduceKernel : public ReduceKernel {
 public:
  using ReduceKernel::ReduceKernel;

 protected:
  absl::Status Build(::tensorflow::OpKernelContext* ctx, ::keras_ring::Request* r) override;
};

class AllgatherKernel : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;

 protected:
  absl::Status Build(::tensorflow::OpKernelContext* ctx, ::keras_ring::Request* r) override;
};

class ReducescatterKernel : public ReduceKernel {
 public:
  using ReduceKernel::ReduceKernel;

 protected:
  absl::Status Build(::tensorflow::OpKernelContext* ctx, ::keras_ring::Request* r) override;
};

class AlltoallKernel : public CollectiveKernel {
 public:
  using CollectiveKernel::CollectiveKernel;

 protected:
  absl::Status Build(::tensorflow::OpKernelContext* ctx, ::keras_ring::Request* r) override;
};

class BroadcastKernel : public CollectiveKernel {
 public:
  explicit BroadcastKernel(::tensorflow::OpKernelConstruction* c);

 protected:
  absl::Status Build(::tensorflow::OpKernelContext* ctx, ::keras_ring::Request* r) override;

 private:
  int root_ = 0;
};

}  // namespace keras_ring_tf
