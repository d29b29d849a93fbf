// Op registrations and shape functions. Collectives are stateful so that TensorFlow keeps
// them in program order inside tf.function (automatic control dependencies). Scale factors
// are strings holding a double: TensorFlow's float attrs are 32-bit, and a factor rounded to
// float (0.7 -> 0.69999999) truncates integers wrongly and scales float64 imprecisely.
// A collective's name is its last input, not an attr: TensorFlow's eager runtime keeps one
// kernel per set of attrs for ever (about 38 KB each), so a name that changed with every
// eager call (`name=f"loss{step}"`) grew the process without bound.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace keras_ring_tf {

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("KerasRingAllreduce")
    .Input("tensor: T")
    .Input("tensor_name: string")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int16, uint16, int32, int64}")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: string = '1.0'")  // a double, written exactly (repr)
    .Attr("postscale_factor: string = '1.0'")
    .Attr("eager: bool = false")  // called eagerly: its waits may yield the core (Deadline)
    .Attr("process_set_id: int = 0")  // which runtime: 0 all ranks, else a process set
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Reduces `tensor` across all ranks; every rank gets the same result.");

REGISTER_OP("KerasRingGroupedAllreduce")
    .Input("tensors: T")
    .Input("tensor_name: string")
    .Output("outputs: T")
    .Attr("T: list({half, bfloat16, float, double, int8, uint8, int16, uint16, int32, int64})")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: string = '1.0'")  // a double, written exactly (repr)
    .Attr("postscale_factor: string = '1.0'")
    .Attr("eager: bool = false")  // called eagerly: its waits may yield the core (Deadline)
    .Attr("process_set_id: int = 0")  // which runtime: 0 all ranks, else a process set
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    })
    .Doc("Allreduces a list of tensors as one collective: one fused pass per dtype.");

REGISTER_OP("KerasRingAllgather")
    .Input("tensor: T")
    .Input("tensor_name: string")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int16, uint16, int32, int64, bool}")
    .Attr("eager: bool = false")  // called eagerly: its waits may yield the core (Deadline)
    .Attr("process_set_id: int = 0")  // which runtime: 0 all ranks, else a process set
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle in = c->input(0);
      if (!c->RankKnown(in)) {
        c->set_output(0, c->UnknownShape());
        return absl::OkStatus();
      }
      if (c->Rank(in) == 0) {  // scalars gather into a vector of one entry per rank
        c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
        return absl::OkStatus();
      }
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc("Concatenates every rank's tensor along the first dimension, in rank order.");

REGISTER_OP("KerasRingBroadcast")
    .Input("tensor: T")
    .Input("tensor_name: string")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int16, uint16, int32, int64, bool}")
    .Attr("root_rank: int")
    .Attr("eager: bool = false")  // called eagerly: its waits may yield the core (Deadline)
    .Attr("process_set_id: int = 0")  // which runtime: 0 all ranks, else a process set
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Every rank receives the root rank's tensor.");

// The output's first dimension depends on the rank; the Python wrappers set it. A
// scalar is refused with the signatures (on every rank), not here (on its own rank only).
absl::Status RowsUnknown(InferenceContext* c) {
  ShapeHandle in = c->input(0);
  if (!c->RankKnown(in) || c->Rank(in) == 0) {
    c->set_output(0, c->UnknownShape());
    return absl::OkStatus();
  }
  ShapeHandle out;
  TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

REGISTER_OP("KerasRingReducescatter")
    .Input("tensor: T")
    .Input("tensor_name: string")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int16, uint16, int32, int64}")
    .Attr("reduce_op: int")
    .Attr("prescale_factor: string = '1.0'")  // a double, written exactly (repr)
    .Attr("postscale_factor: string = '1.0'")
    .Attr("eager: bool = false")  // called eagerly: its waits may yield the core (Deadline)
    .Attr("process_set_id: int = 0")  // which runtime: 0 all ranks, else a process set
    .SetIsStateful()
    .SetShapeFn(RowsUnknown)
    .Doc("Reduces `tensor` across all ranks; rank r gets its share of the first dimension "
         "(the first rows % size ranks one row more).");

REGISTER_OP("KerasRingAlltoall")
    .Input("tensor: T")
    .Input("splits: int32")  // rows for each rank; empty: equal parts
    .Input("tensor_name: string")
    .Output("output: T")
    .Output("received_splits: int32")
    .Attr("T: {half, bfloat16, float, double, int8, uint8, int16, uint16, int32, int64, bool}")
    .Attr("eager: bool = false")  // called eagerly: its waits may yield the core (Deadline)
    .Attr("process_set_id: int = 0")  // which runtime: 0 all ranks, else a process set
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle splits;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &splits));
      TF_RETURN_IF_ERROR(RowsUnknown(c));
      c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc("Sends splits[p] rows of `tensor` to rank p (in order) and concatenates the rows "
         "received from every rank in rank order; received_splits[p] counts rank p's.");

// Not stateful, on purpose: a stateful op would be chained with the collectives in program
// order (automatic control dependencies) and so delay the very collectives it is meant to
// place in time. It runs when its input exists and is kept because its output is used.
REGISTER_OP("KerasRingTimelineMark")
    .Input("tensor: T")
    .Output("output: T")
    .Attr("T: type")
    .Attr("label: string")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Returns `tensor`, recording in the timeline (if it records) when it was computed.");

}  // namespace keras_ring_tf
