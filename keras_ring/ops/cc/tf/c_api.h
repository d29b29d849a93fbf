// The C face of the runtime, called from Python through ctypes (bootstrap, shutdown,
// barrier). Functions return 0 or a status code and write a message into `err`.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Everything keras_ring_init needs; arrays have `size` entries in rank order.
typedef struct {
  int rank;
  int size;
  int listen_fd;              // bound, listening TCP socket (used while connecting)
  const char* const* hosts;   // every rank's address
  const int* ports;
  const int* host_index;      // every rank's host: equal index = same host (shared memory)
  uint64_t job_token;         // equal on all ranks; refuses strangers
  double timeout_seconds;
  double stall_warning_seconds;
  size_t segment_bytes;       // 0 = default
  int use_shm;                // must be equal on all ranks
  size_t shm_channel_bytes;   // 0 = default
  int timeline;               // record per-collective phase times
  double failure_exit_seconds;  // end the process this long after a fatal failure; 0 never
  int process_set_id;         // 0: the global runtime; else a process set's (ranks: its own)
  int fast_agree;             // open collectives with the fast agreement; equal on all ranks
  size_t doubling_max_bytes;  // allreduces up to this size by recursive doubling
  int device_max_in_flight;   // NCCL collectives launched and not yet complete; 0 = default
  int sync_graph_kernels;     // CPU collectives in graphs run as synchronous kernels
  size_t huge_page_output_bytes;  // fresh CPU outputs from this size use huge pages; 0 never
} keras_ring_config;

// Starts the runtime of config->process_set_id (a no-op when it is running).
int keras_ring_init(const keras_ring_config* config, char* err, size_t err_len);
// Copies up to `cap` bytes of recorded timeline lines (tab-separated) into buf; returns
// the count, 0 once everything recorded so far has been read.
size_t keras_ring_timeline_read(char* buf, size_t cap);
// Starts (on != 0) or stops recording the global runtime's timeline, marks included.
void keras_ring_timeline_record(int on);
// From max_events events held, the global runtime's timeline appends them to fd (the lines
// keras_ring_timeline_read gives); fd -1 stops that. Returns the errno of a write that failed
// since the last call (0 if none), or -1 without a runtime.
int keras_ring_timeline_spill(int fd, long long max_events);
// Chains a handler for `sig` (SIGINT or SIGTERM; else -1) in front of the existing one: the
// signal makes pending and later collectives fail at once (instead of after the timeout),
// until the next init, then the previous handler runs (Python's raises KeyboardInterrupt).
// Idempotent.
int keras_ring_install_signal_handler(int sig);
// Stops every runtime of this process (process sets first).
int keras_ring_shutdown(void);
// Stops one process set's runtime; 1 if it ran.
int keras_ring_shutdown_process_set(int process_set_id);
// Shutdown of a program that leaves with an error (`reason`): peers treat it as this rank's
// failure and end too, and this process ends after the failure grace if its exit hangs.
int keras_ring_shutdown_with_error(const char* reason);
// Fails the running job of process set `process_set_id` with `reason` (Runtime::FailJob),
// keeping it installed; any thread. Returns 0, or -1 where it does not run.
int keras_ring_fail_job(int process_set_id, const char* reason);
int keras_ring_is_initialized(void);
// 1 where a runtime of this process failed on a peer that did not take part in time (a
// timeout, caught by the program or not), since the last init; else 0.
int keras_ring_peer_stalled(void);
// For the exit of an MPI rank whose peer stalled: exit() ends the process with the program's
// status after the failure grace, without MPICH's PMI finalize, asking MPICH's launcher to
// end the job where ask_launcher is nonzero (core/failure_exit.h).
void keras_ring_leave_unfinalized_at_exit(double grace_seconds, int ask_launcher);
// For the exit of a process whose job failed (else nothing): its teardown gets a grace of its
// own from now, and the program's status where it outlasts it (core/failure_exit.h).
void keras_ring_bound_exit_after_failure(double grace_seconds);
// The structure of a recent error reported with this exact message (by a kernel or this API):
// "code\nrank\ncollective\nreason", rank -1 when no rank is at fault; empty when unknown.
// Writes up to cap-1 bytes and a NUL; returns the count.
size_t keras_ring_error_info(const char* message, char* buf, size_t cap);
int keras_ring_barrier(int process_set_id, const char* name, char* err, size_t err_len);
// Joins (this rank ran out of data): takes part in the other ranks' allreduces with zeros
// until every rank joined, then writes the rank (within the process set) that joined last.
int keras_ring_join(int process_set_id, int* last_joined, char* err, size_t err_len);
// The version string of this build, to detect a stale library.
const char* keras_ring_build_info(void);

#ifdef __cplusplus
}
#endif
