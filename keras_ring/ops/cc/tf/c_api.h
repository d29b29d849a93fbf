// The C face of the runtime, called from Python through ctypes (bootstrap, shutdown,
// barrier). Functions return 0 or a status code and write a message into `err`.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Starts the runtime. `listen_fd` is a bound, listening TCP socket of this process (used
// while connecting); hosts/ports are every rank's address in rank order and host_index
// every rank's host (equal = same host, which enables shared memory when use_shm is set,
// identically on all ranks). Zero sizes mean the defaults.
int keras_ring_init(int rank, int size, int listen_fd, const char* const* hosts,
                    const int* ports, const int* host_index, uint64_t job_token,
                    double timeout_seconds, double stall_warning_seconds,
                    size_t segment_bytes, int use_shm, size_t shm_channel_bytes, char* err,
                    size_t err_len);
// Chains handlers for SIGINT and SIGTERM in front of the existing ones: a signal makes
// pending and later collectives fail at once (instead of after the timeout), then the
// previous handler runs (Python's raises KeyboardInterrupt). Idempotent.
void keras_ring_install_signal_handlers(void);
int keras_ring_shutdown(void);
int keras_ring_is_initialized(void);
int keras_ring_barrier(const char* name, char* err, size_t err_len);
// The version string of this build, to detect a stale library.
const char* keras_ring_build_info(void);

#ifdef __cplusplus
}
#endif
