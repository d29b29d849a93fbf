// The real DeviceApi: the CUDA runtime and NCCL opened with dlopen at the first GPU
// collective, so a machine without them builds and loads the same library and only a GPU
// collective there fails, with a message that says what to install.
#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include "device_api.h"

namespace keras_ring {
namespace nccl {

std::string NcclVersionString(int code) {
  // NCCL_VERSION_CODE is major*10000 + minor*100 + patch since 2.9, major*1000 + ... before.
  const bool wide = code >= 10000;
  const int major = wide ? code / 10000 : code / 1000;
  const int minor = wide ? (code % 10000) / 100 : (code % 1000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

namespace {

// C signatures, written from the CUDA runtime and NCCL API documentation.
using GetDeviceFn = int (*)(int*);
using SetDeviceFn = int (*)(int);
using StreamCreateFn = int (*)(Stream*, unsigned);
using StreamDestroyFn = int (*)(Stream);
using EventCreateFn = int (*)(Event*, unsigned);
using EventDestroyFn = int (*)(Event);
using EventRecordFn = int (*)(Event, Stream);
using StreamWaitEventFn = int (*)(Stream, Event, unsigned);
using EventQueryFn = int (*)(Event);
using ErrorStringFn = const char* (*)(int);
using VersionFn = int (*)(int*);
using UniqueIdFn = int (*)(UniqueId*);
using CommInitRankFn = int (*)(Comm*, int, UniqueId, int);
using CommInitRankConfigFn = int (*)(Comm*, int, UniqueId, int, NcclConfig*);
using CtxGetCurrentFn = int (*)(void**);
using AsyncErrorFn = int (*)(Comm, int*);
using CommFn = int (*)(Comm);
using GroupFn = int (*)();
using AllReduceFn = int (*)(const void*, void*, size_t, int, int, Comm, Stream);
using BroadcastFn = int (*)(const void*, void*, size_t, int, int, Comm, Stream);
using AllGatherFn = int (*)(const void*, void*, size_t, int, Comm, Stream);
using ReduceFn = int (*)(const void*, void*, size_t, int, int, int, Comm, Stream);
using ReduceScatterFn = int (*)(const void*, void*, size_t, int, int, Comm, Stream);
using SendFn = int (*)(const void*, size_t, int, int, Comm, Stream);
using RecvFn = int (*)(void*, size_t, int, int, Comm, Stream);
using PreMulSumFn = int (*)(int*, void*, int, int, Comm);
using RedOpDestroyFn = int (*)(int, Comm);

struct CudaFns {
  GetDeviceFn get_device = nullptr;
  SetDeviceFn set_device = nullptr;
  StreamCreateFn stream_create = nullptr;
  StreamDestroyFn stream_destroy = nullptr;
  EventCreateFn event_create = nullptr;
  EventDestroyFn event_destroy = nullptr;
  EventRecordFn event_record = nullptr;
  StreamWaitEventFn stream_wait_event = nullptr;
  EventQueryFn event_query = nullptr;
  ErrorStringFn error_string = nullptr;
  CtxGetCurrentFn ctx_get_current = nullptr;  // the driver's; optional
};

struct NcclFns {
  VersionFn version = nullptr;
  UniqueIdFn unique_id = nullptr;
  CommInitRankFn init_rank = nullptr;
  CommInitRankConfigFn init_rank_config = nullptr;  // NCCL >= 2.14, else null
  CommFn finalize = nullptr;                        // NCCL >= 2.14, else null
  AsyncErrorFn async_error = nullptr;
  CommFn abort = nullptr;
  CommFn destroy = nullptr;
  GroupFn group_start = nullptr;
  GroupFn group_end = nullptr;
  AllReduceFn all_reduce = nullptr;
  BroadcastFn broadcast = nullptr;
  AllGatherFn all_gather = nullptr;
  ReduceFn reduce = nullptr;
  ReduceScatterFn reduce_scatter = nullptr;
  SendFn send = nullptr;  // NCCL >= 2.7, like ncclRecv
  RecvFn recv = nullptr;
  PreMulSumFn pre_mul_sum = nullptr;
  RedOpDestroyFn red_op_destroy = nullptr;
  ErrorStringFn error_string = nullptr;
};

// Process-wide: libraries are opened once and never closed (communicators may be torn down
// late in the process's life, and unloading NCCL under its own threads is unsafe).
struct Libraries {
  std::mutex mu;
  std::string search_path;
  bool cuda_loaded = false;
  bool nccl_loaded = false;
  CudaFns cuda;
  NcclFns nccl;
};

Libraries& Libs() {
  static Libraries* libs = new Libraries;  // deliberately leaked, see above
  return *libs;
}

std::vector<std::string> SplitDirs(const std::string& dirs) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    if (end > start) out.push_back(dirs.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// Opens the first of `names` found: a copy the process already has (TensorFlow's or
// PyTorch's, so one process never holds two), then each directory, then the system's path.
void* Open(const std::vector<std::string>& names, const std::vector<std::string>& dirs,
           std::string* last_error) {
  for (const std::string& name : names) {
    if (void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)) return h;
  }
  std::vector<std::string> candidates;
  for (const std::string& dir : dirs) {
    for (const std::string& name : names) candidates.push_back(dir + "/" + name);
  }
  candidates.insert(candidates.end(), names.begin(), names.end());
  for (const std::string& path : candidates) {
    if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) return h;
    const char* e = dlerror();
    // The system's answer for the main name says most ("cannot open shared object file",
    // or a missing dependency); otherwise the first error seen.
    if (e != nullptr && (last_error->empty() || path == names.front())) *last_error = e;
  }
  return nullptr;
}

// Where a loaded library lives, for messages.
std::string PathOf(void* symbol) {
  Dl_info info{};
  if (symbol != nullptr && dladdr(symbol, &info) != 0 && info.dli_fname != nullptr) {
    return info.dli_fname;
  }
  return "?";
}

template <typename F>
void Resolve(void* handle, const char* name, F* fn, std::string* missing) {
  *fn = reinterpret_cast<F>(dlsym(handle, name));
  if (*fn == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
}

std::string Searched(const std::vector<std::string>& dirs) {
  std::string s;
  for (const std::string& d : dirs) s += d + ", ";
  return "searched " + s + "the already loaded libraries and the system's library path";
}

// The driver's cuCtxGetCurrent, which the runtime API has no equivalent of. The driver is
// loaded by the CUDA runtime anyway; without it the answer is "unknown" (see HasCurrentContext).
CtxGetCurrentFn LoadCtxGetCurrent() {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
  if (h == nullptr) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  return h != nullptr ? reinterpret_cast<CtxGetCurrentFn>(dlsym(h, "cuCtxGetCurrent")) : nullptr;
}

Status LoadCudaLocked(Libraries& l) {
  if (l.cuda_loaded) return Status::OK();
  const std::vector<std::string> dirs = SplitDirs(l.search_path);
  std::string error;
  // CUDA 12 first (TensorFlow's own); CUDA 13 wheels put libcudart.so.13 in nvidia/cu13/lib.
  void* h = Open({"libcudart.so.12", "libcudart.so.13", "libcudart.so"}, dirs, &error);
  if (h == nullptr) {
    return Status(Code::kFailedPrecondition,
                  "keras_ring: GPU collective needs the CUDA runtime: no libcudart.so.12 or "
                  "libcudart.so.13 found (install the CUDA runtime wheel of your CUDA version, "
                  "e.g. nvidia-cuda-runtime-cu12, which tensorflow[and-cuda] brings, or put the "
                  "CUDA libraries on LD_LIBRARY_PATH); " + Searched(dirs) +
                      (error.empty() ? "" : "; last error: " + error));
  }
  CudaFns f;
  std::string missing;
  Resolve(h, "cudaGetDevice", &f.get_device, &missing);
  Resolve(h, "cudaSetDevice", &f.set_device, &missing);
  Resolve(h, "cudaStreamCreateWithFlags", &f.stream_create, &missing);
  Resolve(h, "cudaStreamDestroy", &f.stream_destroy, &missing);
  Resolve(h, "cudaEventCreateWithFlags", &f.event_create, &missing);
  Resolve(h, "cudaEventDestroy", &f.event_destroy, &missing);
  Resolve(h, "cudaEventRecord", &f.event_record, &missing);
  Resolve(h, "cudaStreamWaitEvent", &f.stream_wait_event, &missing);
  Resolve(h, "cudaEventQuery", &f.event_query, &missing);
  Resolve(h, "cudaGetErrorString", &f.error_string, &missing);
  if (!missing.empty()) {
    return Status(Code::kFailedPrecondition, "keras_ring: the CUDA runtime " +
                                                 PathOf(dlsym(h, "cudaGetDevice")) +
                                                 " lacks " + missing);
  }
  f.ctx_get_current = LoadCtxGetCurrent();
  l.cuda = f;
  l.cuda_loaded = true;
  return Status::OK();
}

Status ResolveNccl(void* h, NcclFns* f) {
  std::string missing;
  Resolve(h, "ncclGetVersion", &f->version, &missing);
  Resolve(h, "ncclGetUniqueId", &f->unique_id, &missing);
  Resolve(h, "ncclCommInitRank", &f->init_rank, &missing);
  Resolve(h, "ncclCommGetAsyncError", &f->async_error, &missing);
  Resolve(h, "ncclCommAbort", &f->abort, &missing);
  Resolve(h, "ncclCommDestroy", &f->destroy, &missing);
  Resolve(h, "ncclGroupStart", &f->group_start, &missing);
  Resolve(h, "ncclGroupEnd", &f->group_end, &missing);
  Resolve(h, "ncclAllReduce", &f->all_reduce, &missing);
  Resolve(h, "ncclBroadcast", &f->broadcast, &missing);
  Resolve(h, "ncclAllGather", &f->all_gather, &missing);
  Resolve(h, "ncclReduce", &f->reduce, &missing);
  Resolve(h, "ncclReduceScatter", &f->reduce_scatter, &missing);
  Resolve(h, "ncclSend", &f->send, &missing);
  Resolve(h, "ncclRecv", &f->recv, &missing);
  Resolve(h, "ncclRedOpCreatePreMulSum", &f->pre_mul_sum, &missing);
  Resolve(h, "ncclRedOpDestroy", &f->red_op_destroy, &missing);
  Resolve(h, "ncclGetErrorString", &f->error_string, &missing);
  // Optional: without them communicators are blocking (NCCL < 2.14).
  f->init_rank_config = reinterpret_cast<CommInitRankConfigFn>(dlsym(h, "ncclCommInitRankConfig"));
  f->finalize = reinterpret_cast<CommFn>(dlsym(h, "ncclCommFinalize"));
  if (missing.empty()) return Status::OK();
  return Status(Code::kFailedPrecondition,
                "keras_ring: " + PathOf(dlsym(h, "ncclGetVersion")) + " lacks " + missing +
                    "; keras_ring needs NCCL >= " + NcclVersionString(kMinNcclVersion) +
                    " (pip install -U nvidia-nccl-cu12, or nvidia-nccl-cu13 with CUDA 13)");
}

Status LoadNcclLocked(Libraries& l, const std::vector<std::string>& dirs) {
  if (l.nccl_loaded) return Status::OK();
  std::string error;
  void* h = Open({"libnccl.so.2", "libnccl.so"}, dirs, &error);
  if (h == nullptr) {
    return Status(Code::kFailedPrecondition,
                  "keras_ring: GPU collective needs NCCL: libnccl.so.2 not found (install "
                  "keras-ring[cuda] or nvidia-nccl-cu12, or nvidia-nccl-cu13 with CUDA 13, or "
                  "put libnccl.so.2 on LD_LIBRARY_PATH); " + Searched(dirs) +
                      (error.empty() ? "" : "; last error: " + error));
  }
  NcclFns f;
  KR_RETURN_IF_ERROR(ResolveNccl(h, &f));
  int version = 0;
  if (f.version(&version) != kNcclSuccess || version < kMinNcclVersion) {
    return Status(Code::kFailedPrecondition,
                  "keras_ring: NCCL " + NcclVersionString(version) + " (" +
                      PathOf(reinterpret_cast<void*>(f.version)) + ") is too old: keras_ring "
                      "needs NCCL >= " + NcclVersionString(kMinNcclVersion) +
                      " (pip install -U nvidia-nccl-cu12, or nvidia-nccl-cu13 with CUDA 13)");
  }
  l.nccl = f;
  l.nccl_loaded = true;
  return Status::OK();
}

constexpr int kCudaErrorNotLoaded = 3;  // cudaErrorInitializationError
constexpr int kNcclNotLoaded = kNcclInternalError;

// Calls `fn` if its library is loaded. The backend loads before it calls, but teardown may
// run on a machine where loading failed, and must not jump through a null pointer.
template <typename F, typename... Args>
int Call(F fn, int unloaded, Args... args) {
  return fn != nullptr ? fn(args...) : unloaded;
}

class DynamicApi : public DeviceApi {
 public:
  Status LoadCuda() override {
    std::lock_guard<std::mutex> lock(Libs().mu);
    return LoadCudaLocked(Libs());
  }
  Status LoadNccl() override {
    std::lock_guard<std::mutex> lock(Libs().mu);
    return LoadNcclLocked(Libs(), SplitDirs(Libs().search_path));
  }
  int HasCurrentContext(bool* has) override {
    void* ctx = nullptr;
    const int r = Call(cuda().ctx_get_current, kCudaErrorNotLoaded, &ctx);
    *has = r == kCudaSuccess && ctx != nullptr;
    return r;
  }
  int GetDevice(int* d) override { return Call(cuda().get_device, kCudaErrorNotLoaded, d); }
  int SetDevice(int d) override { return Call(cuda().set_device, kCudaErrorNotLoaded, d); }
  int StreamCreate(Stream* s) override {
    return Call(cuda().stream_create, kCudaErrorNotLoaded, s, kCudaStreamNonBlocking);
  }
  int StreamDestroy(Stream s) override {
    return Call(cuda().stream_destroy, kCudaErrorNotLoaded, s);
  }
  int EventCreate(Event* e) override {
    return Call(cuda().event_create, kCudaErrorNotLoaded, e, kCudaEventDisableTiming);
  }
  int EventDestroy(Event e) override { return Call(cuda().event_destroy, kCudaErrorNotLoaded, e); }
  int EventRecord(Event e, Stream s) override {
    return Call(cuda().event_record, kCudaErrorNotLoaded, e, s);
  }
  int StreamWaitEvent(Stream s, Event e) override {
    return Call(cuda().stream_wait_event, kCudaErrorNotLoaded, s, e, 0u);
  }
  int EventQuery(Event e) override { return Call(cuda().event_query, kCudaErrorNotLoaded, e); }
  std::string CudaErrorString(int error) override {
    const char* s = cuda().error_string ? cuda().error_string(error) : nullptr;
    return s != nullptr ? s : "CUDA error " + std::to_string(error);
  }

  int NcclVersion(int* v) override { return Call(nccl().version, kNcclNotLoaded, v); }
  int GetUniqueId(UniqueId* id) override { return Call(nccl().unique_id, kNcclNotLoaded, id); }
  int CommInitRank(Comm* comm, int nranks, const UniqueId& id, int rank) override {
    return Call(nccl().init_rank, kNcclNotLoaded, comm, nranks, id, rank);
  }
  bool HasNonblockingComms() override {
    return nccl().init_rank_config != nullptr && nccl().finalize != nullptr;
  }
  int CommInitRankConfig(Comm* comm, int nranks, const UniqueId& id, int rank,
                         NcclConfig* config) override {
    return Call(nccl().init_rank_config, kNcclInvalidUsage, comm, nranks, id, rank, config);
  }
  int CommFinalize(Comm c) override { return Call(nccl().finalize, kNcclInvalidUsage, c); }
  int CommGetAsyncError(Comm c, int* e) override {
    return Call(nccl().async_error, kNcclNotLoaded, c, e);
  }
  int CommAbort(Comm c) override { return Call(nccl().abort, kNcclNotLoaded, c); }
  int CommDestroy(Comm c) override { return Call(nccl().destroy, kNcclNotLoaded, c); }
  int GroupStart() override { return Call(nccl().group_start, kNcclNotLoaded); }
  int GroupEnd() override { return Call(nccl().group_end, kNcclNotLoaded); }
  int AllReduce(const void* send, void* recv, size_t count, int dtype, int op, Comm c,
                Stream s) override {
    return Call(nccl().all_reduce, kNcclNotLoaded, send, recv, count, dtype, op, c, s);
  }
  int Broadcast(const void* send, void* recv, size_t count, int dtype, int root, Comm c,
                Stream s) override {
    return Call(nccl().broadcast, kNcclNotLoaded, send, recv, count, dtype, root, c, s);
  }
  int AllGather(const void* send, void* recv, size_t count, int dtype, Comm c,
                Stream s) override {
    return Call(nccl().all_gather, kNcclNotLoaded, send, recv, count, dtype, c, s);
  }
  int Reduce(const void* send, void* recv, size_t count, int dtype, int op, int root, Comm c,
             Stream s) override {
    return Call(nccl().reduce, kNcclNotLoaded, send, recv, count, dtype, op, root, c, s);
  }
  int ReduceScatter(const void* send, void* recv, size_t count, int dtype, int op, Comm c,
                    Stream s) override {
    return Call(nccl().reduce_scatter, kNcclNotLoaded, send, recv, count, dtype, op, c, s);
  }
  int Send(const void* send, size_t count, int dtype, int peer, Comm c, Stream s) override {
    return Call(nccl().send, kNcclNotLoaded, send, count, dtype, peer, c, s);
  }
  int Recv(void* recv, size_t count, int dtype, int peer, Comm c, Stream s) override {
    return Call(nccl().recv, kNcclNotLoaded, recv, count, dtype, peer, c, s);
  }
  int RedOpCreatePreMulSum(int* op, void* scalar, int dtype, int residence, Comm c) override {
    return Call(nccl().pre_mul_sum, kNcclNotLoaded, op, scalar, dtype, residence, c);
  }
  int RedOpDestroy(int op, Comm c) override {
    return Call(nccl().red_op_destroy, kNcclNotLoaded, op, c);
  }
  std::string NcclErrorString(int result) override {
    const char* s = nccl().error_string ? nccl().error_string(result) : nullptr;
    return s != nullptr ? s : "NCCL error " + std::to_string(result);
  }

 private:
  // Written once under the mutex before any call that uses them; read-only afterwards.
  static const CudaFns& cuda() { return Libs().cuda; }
  static const NcclFns& nccl() { return Libs().nccl; }
};

}  // namespace

std::shared_ptr<DeviceApi> SystemDeviceApi() {
  static std::shared_ptr<DeviceApi> api = std::make_shared<DynamicApi>();
  return api;
}

void SetLibrarySearchPath(const std::string& dirs) {
  std::lock_guard<std::mutex> lock(Libs().mu);
  Libs().search_path = dirs;
}

Status ProbeNccl(const std::string& dirs, int* version) {
  std::lock_guard<std::mutex> lock(Libs().mu);
  std::vector<std::string> search = SplitDirs(dirs);
  for (const std::string& d : SplitDirs(Libs().search_path)) {
    if (std::find(search.begin(), search.end(), d) == search.end()) search.push_back(d);
  }
  KR_RETURN_IF_ERROR(LoadNcclLocked(Libs(), search));
  return Libs().nccl.version(version) == kNcclSuccess
             ? Status::OK()
             : Status(Code::kInternal, "keras_ring: ncclGetVersion failed");
}

}  // namespace nccl
}  // namespace keras_ring
