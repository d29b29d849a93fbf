// The state the fake ranks share (nccl_fake.h): launches that meet across ranks and compute
// everybody's results, point-to-point pairing, knobs and logs.
#include <algorithm>
#include <cstring>

#include "../core/nccl/plan.h"
#include "../core/reduce.h"
#include "nccl_fake.h"

namespace kr_test {

namespace kn = keras_ring::nccl;
using keras_ring::DataType;
using keras_ring::ReduceOp;

DataType FromNccl(int t) {
  switch (t) {
    case kn::kNcclFloat16: return DataType::kFloat16;
    case kn::kNcclBfloat16: return DataType::kBFloat16;
    case kn::kNcclFloat32: return DataType::kFloat32;
    case kn::kNcclFloat64: return DataType::kFloat64;
    case kn::kNcclUint8: return DataType::kUInt8;
    case kn::kNcclInt32: return DataType::kInt32;
    case kn::kNcclInt64: return DataType::kInt64;
    default: return DataType::kInt8;
  }
}

void FakeNcclWorld::SetLoadNcclError(int rank, const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  ranks_[static_cast<size_t>(rank)].nccl_error = message;
}

void FakeNcclWorld::SetInitResult(int rank, int result) {
  std::lock_guard<std::mutex> lock(mu_);
  ranks_[static_cast<size_t>(rank)].init_result = result;
}

void FakeNcclWorld::ReleaseHeld() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& comm : comms_) {
    for (auto& entry : comm.second.launches) {
      Launch& launch = entry.second;
      if (launch.arrived < size_) break;  // stream order: nothing after it either
      if (!*launch.done) Execute(comm.second, launch);
    }
  }
}

int FakeNcclWorld::MaxPending(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  return ranks_[static_cast<size_t>(rank)].max_pending;
}

std::vector<std::string> FakeNcclWorld::Log(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  return ranks_[static_cast<size_t>(rank)].log;
}

int FakeNcclWorld::Count(int rank, const std::string& entry) {
  int n = 0;
  for (const std::string& e : Log(rank)) n += e.compare(0, entry.size(), entry) == 0 ? 1 : 0;
  return n;
}

int FakeNcclWorld::LiveObjects(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  return ranks_[static_cast<size_t>(rank)].live;
}

void FakeNcclWorld::Note(int rank, const std::string& entry) {
  ranks_[static_cast<size_t>(rank)].log.push_back(entry);
}

namespace {

ReduceOp OpOf(int nccl_op) {
  return nccl_op == kn::kNcclProd  ? ReduceOp::kProduct
         : nccl_op == kn::kNcclMax ? ReduceOp::kMax
         : nccl_op == kn::kNcclMin ? ReduceOp::kMin
                                   : ReduceOp::kSum;  // Sum, Avg and PreMulSum ops add
}

}  // namespace

std::vector<char> FakeNcclWorld::Combine(CommState& comm, const std::vector<const void*>& sends,
                                         int dtype, int op, size_t count) {
  const DataType t = FromNccl(dtype);
  const size_t bytes = count * keras_ring::DataTypeSize(t);
  auto premul = comm.premul_scalars.find(op);
  std::vector<char> acc(bytes), peer(bytes);
  for (size_t r = 0; r < sends.size() && bytes > 0; ++r) {
    char* dst = r == 0 ? acc.data() : peer.data();
    std::memcpy(dst, sends[r], bytes);
    if (premul != comm.premul_scalars.end()) keras_ring::Scale(t, dst, count, premul->second);
    if (r > 0) keras_ring::Reduce(t, OpOf(op), acc.data(), peer.data(), count);
  }
  if (op == kn::kNcclAvg) {
    keras_ring::AverageScale(t, acc.data(), count, static_cast<int64_t>(sends.size()), 1.0);
  }
  // NCCL 2.28's one-rank kernel for scaled reductions leaves a tail unwritten (plan.h): so
  // does the fake, so a launch that trusts it with a whole tensor fails the tests here.
  const bool scaled = premul != comm.premul_scalars.end() ||
                      (op == kn::kNcclAvg && (t == DataType::kFloat16 || t == DataType::kBFloat16 ||
                                              t == DataType::kFloat32 || t == DataType::kFloat64));
  if (sends.size() == 1 && scaled) {
    acc.resize(kn::OneRankKernelWrites(count, keras_ring::DataTypeSize(t)) *
               keras_ring::DataTypeSize(t));
  }
  return acc;
}

namespace {

bool SameCall(const FakeCall& a, const FakeCall& b) {
  return a.type == b.type && a.count == b.count && a.dtype == b.dtype && a.op == b.op &&
         a.root == b.root;
}

void Put(void* dst, const std::vector<char>& data) {
  if (!data.empty()) std::memcpy(dst, data.data(), data.size());
}

}  // namespace

// Runs one launch for every rank: call j of every rank together. NCCL needs every rank to
// make the same collective calls in a launch; where they differ nothing is computed.
void FakeNcclWorld::Execute(CommState& comm, Launch& launch) {
  const size_t n = launch.calls.size();
  for (size_t r = 1; r < n; ++r) {
    bool same = launch.calls[r].size() == launch.calls[0].size();
    for (size_t j = 0; same && j < launch.calls[0].size(); ++j) {
      same = SameCall(launch.calls[r][j], launch.calls[0][j]);
    }
    if (!same) {
      Note(static_cast<int>(r), "violation: calls differ from rank 0's in one launch");
      *launch.done = true;
      return;
    }
  }
  auto sends = [&](size_t j, size_t offset) {
    std::vector<const void*> v;
    for (size_t r = 0; r < n; ++r) v.push_back(static_cast<const char*>(launch.calls[r][j].send) + offset);
    return v;
  };
  for (size_t j = 0; j < launch.calls[0].size(); ++j) {
    const FakeCall& c = launch.calls[0][j];
    const size_t esize = keras_ring::DataTypeSize(FromNccl(c.dtype));
    switch (c.type) {
      case FakeCall::kAllReduce: {
        const std::vector<char> acc = Combine(comm, sends(j, 0), c.dtype, c.op, c.count);
        for (size_t r = 0; r < n; ++r) Put(launch.calls[r][j].recv, acc);
        break;
      }
      case FakeCall::kReduce:  // the root's receive buffer only
        Put(launch.calls[static_cast<size_t>(c.root)][j].recv,
            Combine(comm, sends(j, 0), c.dtype, c.op, c.count));
        break;
      case FakeCall::kReduceScatter:  // block r of every rank's input, reduced, to rank r
        for (size_t r = 0; r < n; ++r) {
          Put(launch.calls[r][j].recv, Combine(comm, sends(j, r * c.count * esize), c.dtype, c.op, c.count));
        }
        break;
      case FakeCall::kBroadcast: {
        const char* p = static_cast<const char*>(launch.calls[static_cast<size_t>(c.root)][j].send);
        const std::vector<char> data(p, p + c.count);
        for (size_t r = 0; r < n; ++r) Put(launch.calls[r][j].recv, data);
        break;
      }
      case FakeCall::kAllGather: {
        std::vector<char> data;
        for (size_t r = 0; r < n; ++r) {
          const char* p = static_cast<const char*>(launch.calls[r][j].send);
          data.insert(data.end(), p, p + c.count);
        }
        for (size_t r = 0; r < n; ++r) Put(launch.calls[r][j].recv, data);
        break;
      }
      case FakeCall::kSend:
      case FakeCall::kRecv:  // never here: PostP2p pairs them
        break;
    }
  }
  *launch.done = true;
  if (device_us.load() > 0) {  // the results are in place; the event waits for the GPU time
    const auto now = std::chrono::steady_clock::now();
    comm.busy_until = std::max(comm.busy_until, now) + std::chrono::microseconds(device_us.load());
    finish_at_[launch.done.get()] = comm.busy_until;
  }
}

bool FakeNcclWorld::Reached(const std::shared_ptr<bool>& done) {
  if (!*done) return false;
  auto it = finish_at_.find(done.get());
  if (it == finish_at_.end()) return true;
  if (std::chrono::steady_clock::now() < it->second) return false;
  finish_at_.erase(it);
  return true;
}

std::shared_ptr<bool> FakeNcclWorld::PostP2p(CommState& comm, int rank,
                                             const std::vector<FakeCall>& calls) {
  auto launch = std::make_shared<P2pLaunch>();
  launch->remaining = static_cast<int>(calls.size());
  for (const FakeCall& c : calls) {
    P2pCall mine{c, launch};
    const bool send = c.type == FakeCall::kSend;
    const std::pair<int, int> key = send ? std::make_pair(rank, c.root) : std::make_pair(c.root, rank);
    std::vector<P2pCall>& waiting = send ? comm.recvs[key] : comm.sends[key];
    if (waiting.empty() || hang.load()) {
      (send ? comm.sends[key] : comm.recvs[key]).push_back(mine);
      continue;
    }
    P2pCall other = waiting.front();
    waiting.erase(waiting.begin());
    if (send) {
      Match(mine, other, key.first, key.second);
    } else {
      Match(other, mine, key.first, key.second);
    }
  }
  if (launch->remaining == 0) *launch->done = true;
  return launch->done;
}

void FakeNcclWorld::Match(P2pCall& send, P2pCall& recv, int from, int to) {
  if (send.call.count != recv.call.count) {
    Note(to, "violation: a receive of " + std::to_string(recv.call.count) + " bytes from rank " +
                 std::to_string(from) + ", which sent " + std::to_string(send.call.count));
  }
  const size_t bytes = std::min(send.call.count, recv.call.count);
  if (bytes > 0) std::memcpy(recv.call.recv, send.call.send, bytes);
  for (P2pCall* c : {&send, &recv}) {
    if (--c->launch->remaining == 0) *c->launch->done = true;
  }
}

}  // namespace kr_test
