// The backend's seam: every CUDA runtime and NCCL call the GPU backend makes goes through
// this interface. The process uses the real one (the libraries loaded with dlopen); the C++
// unit tests put a host-memory fake behind it, so the backend's own logic (communicator
// cache, unique-id exchange, ordering, error mapping, timeouts) is tested without a GPU.
// Methods mirror the C functions one to one and return their raw result codes; turning
// codes into keras_ring statuses is the backend's job (and is tested).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "../common.h"
#include "abi.h"

namespace keras_ring {
namespace nccl {

class DeviceApi {
 public:
  virtual ~DeviceApi() = default;

  // Load the CUDA runtime / NCCL unless already loaded. The error says what is missing and
  // how to install it. Thread-safe.
  virtual Status LoadCuda() = 0;
  virtual Status LoadNccl() = 0;

  // CUDA runtime; each returns a cudaError_t.
  // Whether the calling thread has a current CUDA context (the driver's cuCtxGetCurrent; a
  // CUresult, 0 on success). cudaGetDevice answers 0 on a thread without one, and switching
  // "back" to that device would create a context on GPU 0.
  virtual int HasCurrentContext(bool* has) = 0;
  virtual int GetDevice(int* device) = 0;
  virtual int SetDevice(int device) = 0;
  virtual int StreamCreate(Stream* stream) = 0;  // a non-blocking stream on the current device
  virtual int StreamDestroy(Stream stream) = 0;
  virtual int EventCreate(Event* event) = 0;  // timing disabled: cheaper to record and wait on
  virtual int EventDestroy(Event event) = 0;
  virtual int EventRecord(Event event, Stream stream) = 0;
  virtual int StreamWaitEvent(Stream stream, Event event) = 0;
  virtual int EventQuery(Event event) = 0;  // kCudaSuccess when reached, kCudaErrorNotReady
  virtual std::string CudaErrorString(int error) = 0;

  // NCCL; each returns an ncclResult_t.
  virtual int NcclVersion(int* version) = 0;
  virtual int GetUniqueId(UniqueId* id) = 0;
  virtual int CommInitRank(Comm* comm, int nranks, const UniqueId& id, int rank) = 0;
  // NCCL >= 2.14 has ncclCommInitRankConfig and ncclCommFinalize (nonblocking communicators);
  // without them the two calls below return ncclInvalidUsage.
  virtual bool HasNonblockingComms() = 0;
  virtual int CommInitRankConfig(Comm* comm, int nranks, const UniqueId& id, int rank,
                                 NcclConfig* config) = 0;
  virtual int CommFinalize(Comm comm) = 0;
  virtual int CommGetAsyncError(Comm comm, int* async_error) = 0;
  virtual int CommAbort(Comm comm) = 0;
  virtual int CommDestroy(Comm comm) = 0;
  virtual int GroupStart() = 0;
  virtual int GroupEnd() = 0;
  virtual int AllReduce(const void* send, void* recv, size_t count, int dtype, int op,
                        Comm comm, Stream stream) = 0;
  virtual int Broadcast(const void* send, void* recv, size_t count, int dtype, int root,
                        Comm comm, Stream stream) = 0;
  virtual int AllGather(const void* send, void* recv, size_t count_per_rank, int dtype,
                        Comm comm, Stream stream) = 0;
  // Only `root` receives (recv is ignored elsewhere); count elements from every rank.
  virtual int Reduce(const void* send, void* recv, size_t count, int dtype, int op, int root,
                     Comm comm, Stream stream) = 0;
  // send holds nranks blocks of recv_count elements; rank r gets block r reduced.
  virtual int ReduceScatter(const void* send, void* recv, size_t recv_count, int dtype, int op,
                            Comm comm, Stream stream) = 0;
  // Point to point; a rank's sends and receives with each other must be in one group.
  virtual int Send(const void* send, size_t count, int dtype, int peer, Comm comm,
                   Stream stream) = 0;
  virtual int Recv(void* recv, size_t count, int dtype, int peer, Comm comm, Stream stream) = 0;
  virtual int RedOpCreatePreMulSum(int* op, void* scalar, int dtype, int residence,
                                   Comm comm) = 0;
  virtual int RedOpDestroy(int op, Comm comm) = 0;
  virtual std::string NcclErrorString(int result) = 0;
};

// The process-wide implementation over the dynamically loaded libraries.
std::shared_ptr<DeviceApi> SystemDeviceApi();

// Directories (colon-separated) searched for libnccl.so.2 and libcudart before the system's
// library path; Python passes the NCCL and CUDA runtime wheels' directories (CUDA 12's
// nvidia/*/lib, CUDA 13's nvidia/cu13/lib) at init. Takes effect for libraries not loaded yet.
void SetLibrarySearchPath(const std::string& dirs);

// Loads NCCL as a GPU collective would, searching `dirs` (colon-separated) first; on
// success sets *version to ncclGetVersion's code. The error is the one users would see.
Status ProbeNccl(const std::string& dirs, int* version);

}  // namespace nccl
}  // namespace keras_ring
