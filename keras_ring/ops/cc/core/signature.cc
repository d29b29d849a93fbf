#include "signature.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iomanip>
#include <sstream>

#include "algorithms.h"

namespace keras_ring {

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kAllreduce: return "allreduce";
    case Kind::kGroupedAllreduce: return "grouped_allreduce";
    case Kind::kAllgather: return "allgather";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kBarrier: return "barrier";
    case Kind::kReducescatter: return "reducescatter";
    case Kind::kAlltoall: return "alltoall";
    case Kind::kJoin: return "join";
  }
  return "collective";
}

void Signature::SetName(const std::string& n) {
  std::memset(name, 0, sizeof name);
  if (n.size() < sizeof name && n.find('\0') == std::string::npos) {
    std::memcpy(name, n.data(), n.size());
    return;
  }
  // Too long for the fixed field, or holding a NUL (which would end it early): its start and
  // a hash of the whole, so that names which differ only past that point still differ.
  uint64_t h = 14695981039346656037ull;
  for (const char c : n) h = HashMix(h, static_cast<unsigned char>(c));
  char tail[24];
  std::snprintf(tail, sizeof tail, "...#%016llx", static_cast<unsigned long long>(h));
  size_t keep = std::min(std::min(n.size(), n.find('\0')), sizeof name - 1 - std::strlen(tail));
  // Never inside a UTF-8 character: the name reaches error messages, which Python decodes
  // (a cut one turned a mismatch error into a UnicodeDecodeError).
  while (keep > 0 && keep < n.size() && (static_cast<unsigned char>(n[keep]) & 0xC0) == 0x80) {
    --keep;
  }
  std::memcpy(name, n.data(), keep);
  std::memcpy(name + keep, tail, std::strlen(tail));
}

std::string Signature::Label() const {
  std::string label = KindName(static_cast<Kind>(kind));
  if (name[0] != '\0') return label + " '" + name + "'";
  return label + " #" + std::to_string(seq);
}

uint64_t HashMix(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xffu;
    h *= 1099511628211ull;
  }
  return h;
}

std::pair<int, int> GroupRun(int n, int run) {
  const int runs = std::min(n, kMaxSignatureDims);
  if (run >= runs) return {n, n};
  const int base = n / runs, longer = n % runs;  // the first `longer` runs hold one more
  const int first = run * base + std::min(run, longer);
  return {first, first + base + (run < longer ? 1 : 0)};
}

namespace {
constexpr int kDigestCountBits = 40;
constexpr int64_t kDigestCountMask = (int64_t{1} << kDigestCountBits) - 1;
}  // namespace

int64_t GroupDigest(DataType dtype, uint64_t shape_hash, int64_t elements) {
  return (static_cast<int64_t>(dtype) & 0x7f) << 56 |
         static_cast<int64_t>(shape_hash & 0x7fff) << kDigestCountBits |
         std::min(elements, kDigestCountMask);
}

Status ExchangeSignatures(Transport& t, double timeout_seconds, const Signature& mine,
                          std::vector<Signature>* all) {
  all->assign(static_cast<size_t>(t.size()), Signature());
  (*all)[static_cast<size_t>(t.rank())] = mine;
  AlgoConfig cfg;
  cfg.timeout_seconds = timeout_seconds;
  cfg.segment_bytes = sizeof(Signature);
  std::vector<size_t> sizes(static_cast<size_t>(t.size()), sizeof(Signature));
  return RingAllgatherv(t, cfg, all->data(), sizes);
}

Status ExchangeSlots(Transport& t, const AlgoConfig& base, std::vector<Slot>* slots,
                     std::atomic<int>* steps_done) {
  AlgoConfig cfg = base;
  cfg.segment_bytes = sizeof(Slot);
  if (t.BufferedSendBytes() >= sizeof(Slot)) {
    // One round instead of n-1 chained steps: what makes small collectives fast when ranks
    // outnumber cores (every forwarding step waits for a rank to be scheduled).
    return DirectAllgather(t, cfg, slots->data(), sizeof(Slot), steps_done);
  }
  std::vector<size_t> sizes(static_cast<size_t>(t.size()), sizeof(Slot));
  return RingAllgatherv(t, cfg, slots->data(), sizes, steps_done);
}

namespace {

std::string ShapeString(const Signature& s) {
  if (static_cast<Kind>(s.kind) == Kind::kGroupedAllreduce) {
    return std::to_string(s.ndims) + " tensors, " + std::to_string(s.count) + " elements";
  }
  std::ostringstream out;
  out << "shape [";
  for (int i = 0; i < s.ndims && i < kMaxSignatureDims; ++i) out << (i ? ", " : "") << s.dims[i];
  if (s.ndims > kMaxSignatureDims) out << ", ...";
  out << "] (" << s.count << (s.count == 1 ? " element)" : " elements)");
  return out.str();
}

std::string RowShapeString(const Signature& s) {
  std::ostringstream out;
  out << "[";
  for (int i = 1; i < s.ndims && i < kMaxSignatureDims; ++i) out << (i > 1 ? ", " : "") << s.dims[i];
  out << "]";
  return out.str();
}

bool SameCommunicator(const Signature& a, const Signature& b) {
  return !a.device || !b.device || (a.comm == b.comm && a.comm_new == b.comm_new);
}

std::string CommunicatorString(const Signature& s) {
  const std::string gpu = "GPU " + std::to_string(s.gpu);
  const std::string number = "NCCL communicator #" + std::to_string(s.comm);
  if (s.comm_new) return "a new " + number + " to make for " + gpu;
  return number + " (" + gpu + ")";
}

// Where two grouped allreduces of as many tensors differ (the first run of GroupRun whose
// digests differ): "tensor 3 is float32 on rank 0 and float64 on rank 1"; "" if not found.
std::string GroupDifference(const Signature& a, int rank_a, const Signature& b, int rank_b) {
  if (a.ndims != b.ndims) return "";
  for (int run = 0; run < kMaxSignatureDims; ++run) {
    if (a.dims[run] == b.dims[run]) continue;
    const auto [first, end] = GroupRun(a.ndims, run);
    const std::string on_a = " on rank " + std::to_string(rank_a);
    const std::string on_b = " on rank " + std::to_string(rank_b);
    if (end - first > 1) {
      return "tensors " + std::to_string(first) + " to " + std::to_string(end - 1) +
             " differ in dtype or shape";
    }
    const std::string tensor = "tensor " + std::to_string(first);
    const auto dtype = [](const Signature& s, int r) {
      return std::string(DataTypeName(static_cast<DataType>(s.dims[r] >> 56)));
    };
    if (dtype(a, run) != dtype(b, run)) {
      return tensor + " is " + dtype(a, run) + on_a + " and " + dtype(b, run) + on_b;
    }
    const int64_t count_a = a.dims[run] & kDigestCountMask, count_b = b.dims[run] & kDigestCountMask;
    if (count_a != count_b) {
      return tensor + " has " + std::to_string(count_a) + " elements" + on_a + " and " +
             std::to_string(count_b) + on_b;
    }
    return tensor + " has the same dtype and element count in another shape";
  }
  return "";
}

struct Field {
  const char* what;
  std::function<bool(const Signature&, const Signature&)> same;
  std::function<std::string(const Signature&)> show;
};

// As many digits as tell two doubles apart: factors that differ past the sixth digit
// must not read as equal in the message.
std::string ExactString(double value) {
  std::ostringstream out;
  out << std::setprecision(17) << value;
  return out.str();
}

bool SameShape(const Signature& a, const Signature& b) {
  if (a.count != b.count || a.ndims != b.ndims || a.layout_hash != b.layout_hash) return false;
  for (int i = 0; i < kMaxSignatureDims; ++i) {
    if (a.dims[i] != b.dims[i]) return false;
  }
  return true;
}

bool SameRowShape(const Signature& a, const Signature& b) {
  if (a.row_elems != b.row_elems || a.ndims != b.ndims || a.layout_hash != b.layout_hash) {
    return false;
  }
  for (int i = 1; i < kMaxSignatureDims; ++i) {
    if (a.dims[i] != b.dims[i]) return false;
  }
  return true;
}

std::vector<Field> FieldsFor(Kind kind) {
  std::vector<Field> f;
  f.push_back({"operation", [](auto& a, auto& b) { return a.kind == b.kind; },
               [](auto& s) { return std::string(KindName(static_cast<Kind>(s.kind))); }});
  // A name given on one rank and not on another is a difference too: the ranks disagree
  // about which collective this is.
  f.push_back({"name", [](auto& a, auto& b) { return std::strcmp(a.name, b.name) == 0; },
               [](auto& s) {
                 return s.name[0] != '\0' ? "'" + std::string(s.name) + "'" : std::string("no name");
               }});
  // After the name: two ranks that ran different numbers of collectives may still line up
  // a collective of the same kind, name and shape, from different steps.
  f.push_back({"sequence number", [](auto& a, auto& b) { return a.seq == b.seq; },
               [](auto& s) {
                 return "#" + std::to_string(s.seq) +
                        " (the ranks ran different numbers of collectives before it)";
               }});
  if (kind == Kind::kBarrier) return f;
  // Before anything else about the data: a host rank would run the ring while a GPU rank
  // runs NCCL, and their byte streams would not match.
  f.push_back({"placement", [](auto& a, auto& b) { return a.device == b.device; },
               [](auto& s) {
                 return std::string(s.device ? "a tensor in GPU memory" : "a tensor in host memory");
               }});
  // Then the communicator, which a device rank picks by itself: ranks on different NCCL
  // communicators (or one making a new one) would each wait for peers that never come.
  f.push_back({"NCCL communicator", SameCommunicator, CommunicatorString});
  f.push_back({"dtype", [](auto& a, auto& b) { return a.dtype == b.dtype; },
               [](auto& s) { return std::string(DataTypeName(static_cast<DataType>(s.dtype))); }});
  if (kind == Kind::kAllreduce || kind == Kind::kGroupedAllreduce ||
      kind == Kind::kReducescatter) {
    f.push_back({"reduce op", [](auto& a, auto& b) { return a.reduce_op == b.reduce_op; },
                 [](auto& s) { return std::string(ReduceOpName(static_cast<ReduceOp>(s.reduce_op))); }});
    f.push_back({"prescale factor", [](auto& a, auto& b) { return a.prescale == b.prescale; },
                 [](auto& s) { return ExactString(s.prescale); }});
    f.push_back({"postscale factor", [](auto& a, auto& b) { return a.postscale == b.postscale; },
                 [](auto& s) { return ExactString(s.postscale); }});
  }
  if (kind == Kind::kBroadcast) {
    f.push_back({"root rank", [](auto& a, auto& b) { return a.root == b.root; },
                 [](auto& s) { return "root " + std::to_string(s.root); }});
  }
  if (kind == Kind::kAllgather || kind == Kind::kAlltoall) {
    f.push_back({"shape", SameRowShape,
                 [](auto& s) { return "rows of shape " + RowShapeString(s); }});
  } else if (kind == Kind::kGroupedAllreduce) {
    f.push_back({"dtype/shape", SameShape, ShapeString});  // of some tensor: GroupDifference
  } else {
    f.push_back({"shape", SameShape, ShapeString});
  }
  return f;
}

}  // namespace

namespace {

// Ranks that called join() take part in the others' allreduces with zeros; nothing else can
// take them (Horovod's rule), and NCCL collectives cannot (the joined rank runs no device
// work). `active` holds the ranks that did not join.
Status CheckJoined(const std::vector<Signature>& all, const std::vector<int>& active) {
  const Signature& ref = all[static_cast<size_t>(active[0])];
  const Kind kind = static_cast<Kind>(ref.kind);
  const ReduceOp op = static_cast<ReduceOp>(ref.reduce_op);
  std::string why;
  if (kind != Kind::kAllreduce && kind != Kind::kGroupedAllreduce) {
    why = "only allreduce and grouped_allreduce can run while ranks have joined";
  } else if (op != ReduceOp::kSum && op != ReduceOp::kAverage) {
    why = "only Sum and Average can take a joined rank's zeros";
  } else if (ref.device != 0) {
    why = "collectives on GPU tensors cannot take joined ranks";
  } else {
    return Status::OK();
  }
  std::ostringstream joined;
  for (size_t r = 0; r < all.size(); ++r) {
    if (static_cast<Kind>(all[r].kind) == Kind::kJoin) joined << (joined.tellp() ? ", " : "") << r;
  }
  return Status(Code::kInvalidArgument,
                ref.Label() + " cannot run while rank(s) " + joined.str() +
                    " have called keras_ring.join(): " + why,
                active[0]);
}

// What one rank's signature alone shows to be invalid (a root outside the set or the world,
// a scalar to split): an error that names rank r, the same on every rank.
Status CheckArguments(const Signature& s, int r, int size) {
  const Kind kind = static_cast<Kind>(s.kind);
  if (s.concurrent) {
    // Its name pairs it with whichever same-named call another rank submitted at this
    // position: with concurrent callers that need not be the same call (tf.data's parallel
    // map gave each element another rank's neighbour's sum, silently, before this check).
    return Status(Code::kFailedPrecondition,
                  s.Label() + ": rank " + std::to_string(r) + " submitted it while another "
                      "collective of that name was still pending there. Calls running at once "
                      "(from several threads, a tf.data map with num_parallel_calls, one "
                      "tf.function run by several threads) have no order the ranks share, so "
                      "they would pair wrongly: run them one at a time, or give each "
                      "concurrent call its own name",
                  r);
  }
  if (kind == Kind::kBroadcast && s.root <= kRootNotInSet) {
    return Status(Code::kInvalidArgument,
                  s.Label() + ": root_rank " + std::to_string(kRootNotInSet - s.root) +
                      " is not in the process set (root_rank is a global rank, as in "
                      "Horovod); rank " + std::to_string(r) + " of the set (numbered "
                      "within the set from 0) passed it",
                  r);
  }
  if ((kind == Kind::kReducescatter || kind == Kind::kAlltoall) && s.ndims == 0) {
    return Status(Code::kInvalidArgument,
                  s.Label() + ": rank " + std::to_string(r) + " passed a scalar; " +
                      KindName(kind) + " splits the first dimension, so it needs a tensor "
                      "of rank >= 1 on every rank",
                  r);
  }
  if (kind == Kind::kBroadcast && (s.root < 0 || s.root >= size)) {
    return Status(Code::kInvalidArgument,
                  s.Label() + ": root_rank " + std::to_string(s.root) + " on rank " +
                      std::to_string(r) + " is out of range for " + std::to_string(size) +
                      " ranks (valid: 0.." + std::to_string(size - 1) + ")",
                  r);
  }
  return Status::OK();
}

}  // namespace

Status CheckSignatures(const std::vector<Signature>& all) {
  std::vector<int> active;
  for (size_t r = 0; r < all.size(); ++r) {
    if (static_cast<Kind>(all[r].kind) != Kind::kJoin) active.push_back(static_cast<int>(r));
  }
  if (active.empty()) return Status::OK();  // every rank joined
  if (active.size() < all.size()) KR_RETURN_IF_ERROR(CheckJoined(all, active));
  const int ref_rank = active[0];
  const Signature& ref = all[static_cast<size_t>(ref_rank)];
  const int size = static_cast<int>(all.size());
  for (int r : active) KR_RETURN_IF_ERROR(CheckArguments(all[static_cast<size_t>(r)], r, size));
  // Kind first: other fields only make sense when the operations agree.
  for (const Field& field : FieldsFor(static_cast<Kind>(ref.kind))) {
    std::vector<int> differ;
    for (int r : active) {
      if (r != ref_rank && !field.same(ref, all[static_cast<size_t>(r)])) differ.push_back(r);
    }
    if (differ.empty()) continue;
    const Signature& other = all[static_cast<size_t>(differ[0])];
    std::ostringstream msg;
    // A grouped allreduce's tensors that differ at equal counts: the tensor, not two equal
    // summaries.
    const std::string group = field.what == std::string("dtype/shape")
                                  ? GroupDifference(ref, ref_rank, other, differ[0])
                                  : std::string();
    msg << ref.Label() << " " << field.what << " mismatch: ";
    if (group.empty()) {
      msg << "rank " << ref_rank << " has " << field.show(ref) << ", rank " << differ[0]
          << " has " << field.show(other);
    } else {
      msg << group;
    }
    if (field.what == std::string("operation")) {
      msg << " " << other.Label().substr(other.Label().find(' ') + 1);
    }
    if (differ.size() > 1) {
      msg << " (ranks differing from rank " << ref_rank << ":";
      for (int d : differ) msg << " " << d;
      msg << ")";
    }
    msg << "; every rank must submit the same collectives in the same order (uneven data "
           "shards part them: a rank with fewer steps moves on to its epoch's end; see 'When "
           "ranks run different collectives' in keras_ring's README)";
    return Status(Code::kFailedPrecondition, msg.str(), differ[0]);
  }
  return Status::OK();
}

}  // namespace keras_ring
