#include "c_api.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../core/failure_exit.h"
#include "error_registry.h"
#include "../core/local_transport.h"
#include "../core/runtime.h"
#include "../core/routed_transport.h"

#ifndef KERAS_RING_BUILD_INFO
#define KERAS_RING_BUILD_INFO "unknown"
#endif

using keras_ring::Code;
using keras_ring::Runtime;
using keras_ring::Status;

namespace {

struct sigaction g_previous[2];
std::atomic<bool> g_handlers_installed[2] = {false, false};

void OnSignal(int sig, siginfo_t* info, void* context) {
  keras_ring::RequestInterrupt(sig);
  const struct sigaction& prev = g_previous[sig == SIGINT ? 0 : 1];
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction != nullptr) prev.sa_sigaction(sig, info, context);
  } else if (prev.sa_handler == SIG_DFL) {
    // Default action (terminate): restore it and deliver the signal again.
    signal(sig, SIG_DFL);
    raise(sig);
  } else if (prev.sa_handler != SIG_IGN && prev.sa_handler != nullptr) {
    prev.sa_handler(sig);
  }
}

int Report(const Status& s, char* err, size_t err_len) {
  keras_ring_tf::RememberError(s);
  if (err != nullptr && err_len > 0) {
    std::strncpy(err, s.message().c_str(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return static_cast<int>(s.code());
}

}  // namespace

extern "C" {

int keras_ring_init(const keras_ring_config* cfg, char* err, size_t err_len) {
  const int set = cfg->process_set_id;
  if (keras_ring::InForkedChild()) return Report(keras_ring::ForkedChildError(), err, err_len);
  if (Runtime::Get(set) != nullptr) return 0;  // init() twice is harmless
  if (set == 0) keras_ring::ClearInterrupt();  // a signal the program survived is history
  const int rank = cfg->rank;
  const int size = cfg->size;
  if (size < 1 || rank < 0 || rank >= size) {
    return Report(Status(Code::kInvalidArgument, "rank " + std::to_string(rank) +
                                                     " out of range for size " +
                                                     std::to_string(size)),
                  err, err_len);
  }
  keras_ring::RuntimeOptions options;
  options.rank = rank;
  options.size = size;
  options.timeout_seconds = cfg->timeout_seconds;
  options.stall_warning_seconds = cfg->stall_warning_seconds;
  if (cfg->segment_bytes > 0) options.segment_bytes = cfg->segment_bytes;
  options.timeline = cfg->timeline != 0;
  options.fast_agree = cfg->fast_agree != 0;
  options.doubling_max_bytes = cfg->doubling_max_bytes;
  if (cfg->device_max_in_flight > 0) options.device_max_in_flight = cfg->device_max_in_flight;
  options.sync_graph_kernels = cfg->sync_graph_kernels != 0;
  options.huge_page_output_bytes = cfg->huge_page_output_bytes;
  options.failure_exit_seconds = size > 1 ? cfg->failure_exit_seconds : 0.0;
  if (set == 0) keras_ring::DisarmFailureExit();  // a program that starts again has recovered
  std::unique_ptr<keras_ring::Transport> transport;
  if (size == 1) {
    // A world of one never communicates; the local transport keeps the runtime uniform.
    transport = std::make_unique<keras_ring::LocalTransport>(
        std::make_shared<keras_ring::LocalFabric>(1), 0);
  } else {
    keras_ring::HostTransportConfig config;
    config.rank = rank;
    config.size = size;
    config.listen_fd = cfg->listen_fd;
    for (int i = 0; i < size; ++i) {
      config.peers.push_back({cfg->hosts[i], cfg->ports[i]});
      config.host_index.push_back(cfg->host_index[i]);
    }
    config.job_token = cfg->job_token;
    config.timeout_seconds = cfg->timeout_seconds;
    config.use_shm = cfg->use_shm != 0;
    if (cfg->shm_channel_bytes > 0) config.shm.channel_bytes = cfg->shm_channel_bytes;
    Status s = keras_ring::ConnectHostTransport(config, &transport);
    if (!s.ok()) {
      return Report(Status(s.code(), "keras_ring.init() could not connect the ranks: " +
                                         s.message(), s.peer()),
                    err, err_len);
    }
  }
  Runtime::Install(std::make_shared<Runtime>(options, std::move(transport)), set);
  return 0;
}

size_t keras_ring_timeline_read(char* buf, size_t cap) {
  static std::mutex mu;
  static std::string pending;  // drained but not yet read, from `offset` on
  static size_t offset = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (offset == pending.size()) {
    std::shared_ptr<Runtime> runtime = Runtime::Get();
    pending = runtime != nullptr ? runtime->DrainTimeline() : std::string();
    offset = 0;
  }
  // An offset, not erasing what was read: that moved the rest on every call, quadratic in
  // the trace's size.
  const size_t n = std::min(cap, pending.size() - offset);
  std::memcpy(buf, pending.data() + offset, n);
  offset += n;
  return n;
}

void keras_ring_timeline_record(int on) {
  if (std::shared_ptr<Runtime> runtime = Runtime::Get()) runtime->timeline().SetRecording(on != 0);
}

int keras_ring_timeline_spill(int fd, long long max_events) {
  std::shared_ptr<Runtime> runtime = Runtime::Get();
  if (runtime == nullptr) return -1;
  return runtime->timeline().SpillTo(fd, static_cast<size_t>(std::max(max_events, 1LL)));
}

int keras_ring_shutdown(void) {
  // A collective running on another thread holds its own reference: stop it now, the last
  // reference destroys the runtime.
  for (std::shared_ptr<Runtime>& runtime : Runtime::UninstallAll()) {
    runtime->Stop();
    runtime.reset();
  }
  return 0;
}

int keras_ring_shutdown_process_set(int process_set_id) {
  std::shared_ptr<Runtime> runtime = Runtime::Uninstall(process_set_id);
  if (runtime != nullptr) runtime->Stop();
  return runtime != nullptr ? 1 : 0;
}

int keras_ring_shutdown_with_error(const char* reason) {
  for (std::shared_ptr<Runtime>& runtime : Runtime::UninstallAll()) {
    runtime->Abandon(reason != nullptr ? reason : "unknown");
    runtime.reset();
  }
  return 0;
}

int keras_ring_fail_job(int process_set_id, const char* reason) {
  std::shared_ptr<Runtime> runtime = Runtime::Get(process_set_id);
  if (runtime == nullptr) return -1;
  runtime->FailJob(reason != nullptr ? reason : "unknown");
  return 0;
}

size_t keras_ring_error_info(const char* message, char* buf, size_t cap) {
  const std::string info = keras_ring_tf::DescribeError(message != nullptr ? message : "");
  const size_t n = cap > 0 ? std::min(cap - 1, info.size()) : 0;
  if (cap > 0) {
    std::memcpy(buf, info.data(), n);
    buf[n] = '\0';
  }
  return n;
}

int keras_ring_is_initialized(void) { return Runtime::Get() != nullptr ? 1 : 0; }

int keras_ring_peer_stalled(void) { return keras_ring::PeerStalled() ? 1 : 0; }

void keras_ring_leave_unfinalized_at_exit(double grace_seconds, int ask_launcher) {
  keras_ring::LeaveUnfinalizedAtExit(grace_seconds, ask_launcher != 0);
}

void keras_ring_bound_exit_after_failure(double grace_seconds) {
  keras_ring::BoundExitAfterFailure(grace_seconds);
}

int keras_ring_barrier(int process_set_id, const char* name, char* err, size_t err_len) {
  std::shared_ptr<Runtime> runtime = Runtime::Get(process_set_id);
  if (runtime == nullptr) {
    return Report(keras_ring::NoRuntimeError(process_set_id), err, err_len);
  }
  keras_ring::Request request;
  request.kind = keras_ring::Kind::kBarrier;
  request.name = name != nullptr ? name : "";
  return Report(runtime->Run(std::move(request)), err, err_len);
}

int keras_ring_join(int process_set_id, int* last_joined, char* err, size_t err_len) {
  std::shared_ptr<Runtime> runtime = Runtime::Get(process_set_id);
  if (runtime == nullptr) return Report(keras_ring::NoRuntimeError(process_set_id), err, err_len);
  int32_t last = -1;
  keras_ring::Request request;
  request.kind = keras_ring::Kind::kJoin;
  request.name = "join";
  request.may_yield = true;  // the caller's own thread waits
  request.last_joined = &last;
  const int rc = Report(runtime->Run(std::move(request)), err, err_len);
  if (last_joined != nullptr) *last_joined = last;
  return rc;
}

const char* keras_ring_build_info(void) { return KERAS_RING_BUILD_INFO; }

int keras_ring_install_signal_handler(int sig) {
  if (sig != SIGINT && sig != SIGTERM) return -1;
  const int i = sig == SIGINT ? 0 : 1;
  if (g_handlers_installed[i].exchange(true)) return 0;
  struct sigaction action {};
  action.sa_sigaction = OnSignal;
  action.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(sig, &action, &g_previous[i]);
  return 0;
}

}  // extern "C"
