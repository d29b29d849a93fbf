#include "request.h"

namespace keras_ring {

int64_t TensorRef::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> ReducescatterRows(int64_t rows, int size) {
  std::vector<int64_t> out(static_cast<size_t>(size), rows / size);
  for (int64_t i = 0; i < rows % size; ++i) ++out[static_cast<size_t>(i)];
  return out;
}

namespace {

uint64_t ShapeHash(const TensorRef& t) {
  uint64_t h = HashMix(1469598103934665603ull, static_cast<uint64_t>(t.shape.size()));
  for (int64_t d : t.shape) h = HashMix(h, static_cast<uint64_t>(d));
  return h;
}

// Grouped: the tensors' dtypes and shapes, hashed (equal counts can hide another layout, and
// a shape may differ at the same size: [2, 3] against [3, 2], or two empty tensors), as a
// single allreduce compares its whole shape. `dims` holds a digest of each of up to
// kMaxSignatureDims runs of tensors (GroupDigest), so that a mismatch can say where.
void DescribeGroup(const Request& r, Signature* s) {
  uint64_t h = 1469598103934665603ull;
  int64_t total = 0;
  for (const TensorRef& t : r.tensors) {
    h = HashMix(HashMix(h, static_cast<uint64_t>(t.dtype)), ShapeHash(t));
    total += t.num_elements();
  }
  s->dtype = r.tensors.empty() ? 0 : static_cast<int32_t>(r.tensors[0].dtype);
  s->ndims = static_cast<int32_t>(r.tensors.size());
  s->count = total;
  s->layout_hash = h;
  for (int run = 0; run < kMaxSignatureDims; ++run) {
    const auto [first, end] = GroupRun(s->ndims, run);
    if (first >= end) break;
    if (end - first == 1) {
      const TensorRef& t = r.tensors[static_cast<size_t>(first)];
      s->dims[run] = GroupDigest(t.dtype, ShapeHash(t), t.num_elements());
    } else {
      uint64_t run_hash = 1469598103934665603ull;
      for (int i = first; i < end; ++i) {
        const TensorRef& t = r.tensors[static_cast<size_t>(i)];
        run_hash = HashMix(HashMix(run_hash, static_cast<uint64_t>(t.dtype)), ShapeHash(t));
      }
      s->dims[run] = static_cast<int64_t>(run_hash >> 1);
    }
  }
}

// One tensor: its shape (dims beyond the signature's room hashed); allgather counts rows.
void DescribeTensor(const Request& r, Signature* s) {
  const TensorRef& t = r.tensors[0];
  s->dtype = static_cast<int32_t>(t.dtype);
  s->ndims = static_cast<int32_t>(t.shape.size());
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (i < kMaxSignatureDims) {
      s->dims[i] = t.shape[i];
    } else {
      h = HashMix(h, static_cast<uint64_t>(t.shape[i]));
    }
  }
  s->layout_hash = t.shape.size() > kMaxSignatureDims ? h : 0;
  if (r.kind == Kind::kAllgather || r.kind == Kind::kAlltoall) {
    s->count = t.shape.empty() ? 1 : t.shape[0];
    s->row_elems = 1;
    for (size_t i = 1; i < t.shape.size(); ++i) s->row_elems *= t.shape[i];
  } else {
    s->count = t.num_elements();
  }
}

}  // namespace

Signature SignatureOf(const Request& r, uint64_t seq) {
  Signature s;
  s.seq = seq;
  s.kind = static_cast<int32_t>(r.kind);
  s.reduce_op = static_cast<int32_t>(r.op);
  s.root = r.root;
  s.prescale = r.prescale;
  s.postscale = r.postscale;
  s.device = static_cast<int32_t>(r.placement);
  s.comm = r.device_comm.ordinal;
  s.comm_new = r.device_comm.creates ? 1 : 0;
  s.gpu = r.device_comm.device;
  s.concurrent = r.concurrent ? 1 : 0;
  s.SetName(r.name);
  if (r.kind == Kind::kJoin) {
    s.count = static_cast<int64_t>(r.joined_at);
  } else if (r.kind == Kind::kGroupedAllreduce) {
    DescribeGroup(r, &s);
  } else if (!r.tensors.empty()) {  // a barrier has none
    DescribeTensor(r, &s);
  }
  return s;
}

}  // namespace keras_ring
