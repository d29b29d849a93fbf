// One NCCL communicator, owned like a file handle: made collectively by every rank, used by
// one thread at a time (the runtime's worker launching, or the backend's completion thread
// polling or aborting: the backend serialises them), and ended exactly once, either
// cooperatively (ncclCommFinalize, then ncclCommDestroy) or by ncclCommAbort.
//
// Communicators are nonblocking where NCCL has them (>= 2.14): every call returns at once,
// with ncclInProgress while its work still runs on NCCL's threads (setting up, connecting
// peers lazily at a first collective, finalizing). Until ncclCommGetAsyncError says the
// communicator left that state no other call may be made on it and nothing may be queued on
// its streams. The backend waits for that by polling, bounded by its own stop condition (the
// deadline, shutdown, a failed peer), and aborts when it gives up: NCCL supports aborting
// only nonblocking communicators, so no wait ever has to be abandoned on a helper thread.
// Older NCCL gets blocking communicators, whose setup and teardown cannot be bounded.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "../common.h"
#include "device_api.h"

namespace keras_ring {
namespace nccl {

// Why a wait on `what` must end now, or OK to go on waiting.
using StopCheck = std::function<Status(const std::string& what)>;

// Polls often at first (most operations finish within microseconds to milliseconds), then
// sleeps a little longer each time so a long wait costs no CPU (ranks may share cores).
void PollBackoff(int polls);

class Communicator {
 public:
  // This rank's member of the communicator that `id` names, on the current device: waits
  // until every rank joined or `stop` says to give up (the half-made communicator is
  // aborted then).
  static Status Create(DeviceApi& api, int nranks, const UniqueId& id, int rank,
                       const StopCheck& stop, std::unique_ptr<Communicator>* out);
  ~Communicator();  // aborts unless Close() or Abort() ended it: nothing is leaked
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  Comm get() const { return comm_; }
  bool nonblocking() const { return nonblocking_; }
  bool aborted() const { return aborted_; }
  void Abort();

  // The result of `call` on this communicator as a status, once it is final: ncclInProgress
  // is polled out (until `stop`), so the next call, and work queued behind it on its stream,
  // may follow. The caller aborts on an error.
  Status Settle(int result, const std::string& call, const StopCheck& stop);

  // ncclCommGetAsyncError now: OK while running or done, else the error, labelled `what`.
  Status AsyncError(const std::string& what);

  // A PreMulSum op for (dtype, scalar), made once and kept (scale factors are op attributes,
  // so a program uses few of them).
  Status PreMulSumOp(int nccl_dtype, DataType dtype, double scalar, const StopCheck& stop,
                     int* op);

  // The cooperative end: frees the ops, finalizes (for a nonblocking communicator, waits
  // until the peers finished with it, up to `deadline`) and destroys. When that fails or runs
  // out of time the communicator is aborted instead and false is returned.
  bool Close(const Deadline& deadline);

 private:
  Communicator(DeviceApi& api, Comm comm, bool nonblocking)
      : api_(api), comm_(comm), nonblocking_(nonblocking) {}

  DeviceApi& api_;
  Comm comm_;
  const bool nonblocking_;
  bool aborted_ = false;
  bool closed_ = false;
  std::map<std::pair<int, double>, int> premul_ops_;
};

}  // namespace nccl
}  // namespace keras_ring
