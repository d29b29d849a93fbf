// A host-memory stand-in for the CUDA runtime and NCCL behind the GPU backend's seam, for the
// C++ tests only (no GPU here). Ranks are threads and "device memory" is host memory. An NCCL
// launch (one call, or every call of a group) completes when every rank of the communicator
// has made its launch with the same sequence number: the last one computes everybody's
// results with the core's reduce kernels. An event is reached once every launch queued on its
// stream before it completed. Knobs inject the failures the backend must survive.
//
// Like NCCL >= 2.14's nonblocking communicators, setup, launches and finalize may answer
// ncclInProgress, and ncclCommGetAsyncError says when that is over (setup: once every rank
// joined; finalize: once every rank finalized). A call on a communicator still in progress,
// or an event recorded on its stream meanwhile, is logged as a "violation" (NCCL forbids
// both). Each thread has its own current device, and a thread that never set one has no
// context: cudaGetDevice says 0 there, as CUDA does. The first context a rank makes on a
// device is logged ("context 1"), so a test sees a context made on a GPU it never meant.
//
// What runs the real thing: benchmarks/gpu_check.sh on a GPU machine drives the same backend
// through the real seam (dynamic_api.cc: libcudart and libnccl loaded at run time) with CuPy
// buffers; test_gpu_path_without_gpu.py runs the real seam on a machine without GPUs.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../core/nccl/device_api.h"

namespace kr_test {

struct FakeCall {
  enum Type { kAllReduce, kBroadcast, kAllGather, kReduce, kReduceScatter, kSend, kRecv };
  Type type = kAllReduce;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  // elements (bytes for broadcast, allgather, send and receive)
  int dtype = 0;
  int op = 0;
  int root = 0;  // reduce and broadcast; send and receive: the peer
  bool p2p() const { return type == kSend || type == kRecv; }
};

// State shared by the ranks: communicators by unique id, pending launches, knobs, counters.
class FakeNcclWorld {
 public:
  explicit FakeNcclWorld(int size) : size_(size), ranks_(static_cast<size_t>(size)) {}
  int size() const { return size_; }

  // Knobs (set before the ranks run, or while they wait).
  std::atomic<bool> hang{false};           // launches never complete
  std::atomic<int> async_error{0};         // reported by ncclCommGetAsyncError of...
  std::atomic<int> async_error_rank{-1};   // ...this rank (-1: none)
  std::atomic<bool> block_init{false};     // setup does not finish until this is cleared
  std::atomic<bool> nonblocking{true};     // NCCL >= 2.14: ncclCommInitRankConfig exists
  std::atomic<int> launch_polls{0};        // a launch stays in progress for this many polls
  std::atomic<bool> launch_stuck{false};   // launches stay in progress (a lazy connect hangs)
  std::atomic<int> hang_from_launch{-1};   // collective launches from this one on (counted
                                           // per communicator from 0) never complete
  std::atomic<int> event_polls{0};         // an event is reached only after this many more
                                           // queries (a GPU slower than the host)
  std::atomic<bool> hold{false};           // collective launches wait for ReleaseHeld()
  std::atomic<int> device_us{0};           // each collective launch then runs this long on
                                           // the "GPU", after the one before it
  std::function<void(int rank)> on_launch;  // called at each launch (set before the ranks run)
  void SetLoadNcclError(int rank, const std::string& message);
  void SetInitResult(int rank, int result);
  // Completes the held launches that every rank made, in order (held ones stay held after).
  void ReleaseHeld();
  // The most collective launches of `rank` not yet completed at once (its device's depth).
  int MaxPending(int rank);

  // What happened on `rank`, in order ("init", "record ready@caller", ...).
  std::vector<std::string> Log(int rank);
  int Count(int rank, const std::string& entry);  // log entries starting with `entry`
  int LiveObjects(int rank);  // streams + events created and not destroyed

 private:
  friend class FakeDeviceApi;
  struct Launch {
    std::vector<std::vector<FakeCall>> calls;  // by rank
    int arrived = 0;
    std::shared_ptr<bool> done = std::make_shared<bool>(false);
  };
  // Point to point: a launch of sends and receives completes when each of its calls met its
  // counterpart (the k-th send from p to q pairs with the k-th receive on q from p), in
  // whatever launches the peers made them, as NCCL pairs them.
  struct P2pLaunch {
    int remaining = 0;
    std::shared_ptr<bool> done = std::make_shared<bool>(false);
  };
  struct P2pCall {
    FakeCall call;
    std::shared_ptr<P2pLaunch> launch;
  };
  struct CommState {
    std::map<std::pair<int, int>, std::vector<P2pCall>> sends, recvs;  // by (from, to)
    int joined = 0;     // ranks that called init
    int finalized = 0;  // ranks that called finalize
    int next_seq[64] = {};
    std::map<int, Launch> launches;
    std::map<int, double> premul_scalars;  // op id -> scalar
    int next_op = 5;                       // after the built-in ops
    std::chrono::steady_clock::time_point busy_until{};  // its launches' GPU time (device_us)
  };
  struct RankState {
    std::vector<std::string> log;
    std::string nccl_error;
    int init_result = 0;
    int live = 0;
    int max_pending = 0;
  };

  void Execute(CommState& comm, Launch& launch);
  // The reduction of count elements at each rank's `sends` (op and premul scalars applied).
  std::vector<char> Combine(CommState& comm, const std::vector<const void*>& sends, int dtype,
                            int op, size_t count);
  // Posts rank's point-to-point calls; returns the flag set once all of them were matched.
  std::shared_ptr<bool> PostP2p(CommState& comm, int rank, const std::vector<FakeCall>& calls);
  void Match(P2pCall& send, P2pCall& recv, int from, int to);
  void Note(int rank, const std::string& entry);  // needs mu_
  bool Reached(const std::shared_ptr<bool>& done);  // done, and its GPU time over (needs mu_)

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<RankState> ranks_;
  std::map<std::string, CommState> comms_;  // by unique id
  std::map<const bool*, std::chrono::steady_clock::time_point> finish_at_;  // see device_us
  int next_id_ = 1;
};

// One rank's view; handles are small integers cast to pointers, named in the log.
class FakeDeviceApi : public keras_ring::nccl::DeviceApi {
 public:
  FakeDeviceApi(std::shared_ptr<FakeNcclWorld> world, int rank)
      : world_(std::move(world)), rank_(rank) {}

  keras_ring::Status LoadCuda() override { return keras_ring::Status::OK(); }
  keras_ring::Status LoadNccl() override;
  int HasCurrentContext(bool* has) override;
  int GetDevice(int* device) override;
  int SetDevice(int device) override;
  int StreamCreate(keras_ring::nccl::Stream* stream) override;
  int StreamDestroy(keras_ring::nccl::Stream stream) override;
  int EventCreate(keras_ring::nccl::Event* event) override;
  int EventDestroy(keras_ring::nccl::Event event) override;
  int EventRecord(keras_ring::nccl::Event event, keras_ring::nccl::Stream stream) override;
  int StreamWaitEvent(keras_ring::nccl::Stream stream, keras_ring::nccl::Event event) override;
  int EventQuery(keras_ring::nccl::Event event) override;
  std::string CudaErrorString(int error) override { return "fake cuda error " + std::to_string(error); }

  int NcclVersion(int* version) override { *version = 22304; return 0; }
  int GetUniqueId(keras_ring::nccl::UniqueId* id) override;
  int CommInitRank(keras_ring::nccl::Comm* comm, int nranks, const keras_ring::nccl::UniqueId& id,
                   int rank) override;
  bool HasNonblockingComms() override { return world_->nonblocking.load(); }
  int CommInitRankConfig(keras_ring::nccl::Comm* comm, int nranks,
                         const keras_ring::nccl::UniqueId& id, int rank,
                         keras_ring::nccl::NcclConfig* config) override;
  int CommFinalize(keras_ring::nccl::Comm comm) override;
  int CommGetAsyncError(keras_ring::nccl::Comm comm, int* async_error) override;
  int CommAbort(keras_ring::nccl::Comm comm) override;
  int CommDestroy(keras_ring::nccl::Comm comm) override;
  int GroupStart() override;
  int GroupEnd() override;
  int AllReduce(const void* send, void* recv, size_t count, int dtype, int op,
                keras_ring::nccl::Comm comm, keras_ring::nccl::Stream stream) override;
  int Broadcast(const void* send, void* recv, size_t count, int dtype, int root,
                keras_ring::nccl::Comm comm, keras_ring::nccl::Stream stream) override;
  int AllGather(const void* send, void* recv, size_t count, int dtype,
                keras_ring::nccl::Comm comm, keras_ring::nccl::Stream stream) override;
  int Reduce(const void* send, void* recv, size_t count, int dtype, int op, int root,
             keras_ring::nccl::Comm comm, keras_ring::nccl::Stream stream) override;
  int ReduceScatter(const void* send, void* recv, size_t recv_count, int dtype, int op,
                    keras_ring::nccl::Comm comm, keras_ring::nccl::Stream stream) override;
  int Send(const void* send, size_t count, int dtype, int peer, keras_ring::nccl::Comm comm,
           keras_ring::nccl::Stream stream) override;
  int Recv(void* recv, size_t count, int dtype, int peer, keras_ring::nccl::Comm comm,
           keras_ring::nccl::Stream stream) override;
  int RedOpCreatePreMulSum(int* op, void* scalar, int dtype, int residence,
                           keras_ring::nccl::Comm comm) override;
  int RedOpDestroy(int op, keras_ring::nccl::Comm comm) override;
  std::string NcclErrorString(int result) override {
    return "fake nccl error " + std::to_string(result);
  }

 private:
  // What a nonblocking communicator is busy with (answered by ncclCommGetAsyncError).
  enum class Busy { kNone, kInit, kLaunch, kFinalize };
  struct CommInfo {
    std::string id;
    bool nonblocking = false;
    bool aborted = false;
    Busy busy = Busy::kNone;
    int polls_left = 0;
    const void* stream = nullptr;  // of its last launch
  };
  int Enqueue(const FakeCall& call, keras_ring::nccl::Comm comm, keras_ring::nccl::Stream stream);
  // `note`, if not empty, is logged under the same lock that puts the launch on the stream, so
  // a test that sees the log entry also sees the launch (ReleaseHeld included).
  int Submit(std::vector<FakeCall> calls, keras_ring::nccl::Comm comm, keras_ring::nccl::Stream stream,
             const std::string& note = "");
  int MakeComm(keras_ring::nccl::Comm* comm, const keras_ring::nccl::UniqueId& id,
               bool nonblocking);
  int AsyncState(const void* comm);  // the async state: kNcclInProgress while busy (needs mu_)
  void CheckIdle(const void* comm, const std::string& call);  // logs a violation (needs mu_)
  std::string Name(const void* handle);

  std::shared_ptr<FakeNcclWorld> world_;
  const int rank_;
  std::map<std::thread::id, int> current_;  // each thread's current device, if it has one
  std::set<int> contexts_;                  // devices this rank made a context on
  int next_handle_ = 1;
  std::map<const void*, std::string> names_;  // handle -> "stream1", "event3"
  std::map<const void*, std::vector<std::shared_ptr<bool>>> streams_;  // pending launches
  std::map<const void*, std::vector<std::shared_ptr<bool>>> events_;   // recorded snapshot
  std::map<const void*, int> event_polls_left_;                        // see event_polls
  std::map<const void*, CommInfo> comms_;
  bool in_group_ = false;
  std::vector<FakeCall> group_;
  const void* group_comm_ = nullptr;
  const void* group_stream_ = nullptr;
  std::mutex mu_;  // the backend calls from the worker, its init helper and submitters
};

// The keras_ring type of an NCCL data type (int8 for the ones without).
keras_ring::DataType FromNccl(int nccl_type);

// A caller stream for rank r (TensorFlow's compute stream in production).
inline keras_ring::nccl::Stream CallerStream(int rank) {
  return reinterpret_cast<keras_ring::nccl::Stream>(static_cast<uintptr_t>(0x7000 + rank));
}

}  // namespace kr_test
