// The C face of the GPU backend, for ctypes: locating NCCL (from Python at init), probing it
// (tests and diagnostics), and synchronous collectives on device pointers for programs
// without TensorFlow (benchmarks/gpu_check.py builds the core alone with this and
// tf/c_api.cc, which has no TensorFlow dependency either). Functions return 0 or a status
// code and write a message into `err`.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Directories (colon-separated) searched for libnccl.so.2 and libcudart before the system's.
void keras_ring_nccl_set_search_path(const char* dirs);

// Loads NCCL as a GPU collective would, searching `dirs` first; sets *version to NCCL's
// version code (e.g. 21903 for 2.19.3). The error is the one a GPU collective would raise.
int keras_ring_nccl_probe(const char* dirs, int* version, char* err, size_t err_len);

// Collectives on device memory of CUDA device `device`, ordered after the work queued on
// `stream` (a cudaStream_t; 0 is the legacy default stream). They return once the result is
// in `output` (and `stream` is made to wait for it). dtype and reduce_op take the values of
// keras_ring's DataType and ReduceOp enums (core/common.h). `name` may be null.
int keras_ring_device_allreduce(const void* input, void* output, int64_t count, int dtype,
                                int reduce_op, double prescale, double postscale, int device,
                                void* stream, const char* name, char* err, size_t err_len);
// `rows` of `row_elems` elements from this rank; `output` holds `output_rows` rows, which
// must be at least the sum of every rank's rows.
int keras_ring_device_allgather(const void* input, void* output, int64_t rows,
                                int64_t row_elems, int64_t output_rows, int dtype, int device,
                                void* stream, const char* name, char* err, size_t err_len);
int keras_ring_device_broadcast(const void* input, void* output, int64_t count, int dtype,
                                int root, int device, void* stream, const char* name,
                                char* err, size_t err_len);
// `n` tensors reduced as one collective (one NCCL group): tensor i has counts[i] elements of
// dtypes[i] at inputs[i], its result goes to outputs[i].
int keras_ring_device_grouped_allreduce(const void* const* inputs, void* const* outputs,
                                        const int64_t* counts, const int* dtypes, int n,
                                        int reduce_op, double prescale, double postscale,
                                        int device, void* stream, const char* name, char* err,
                                        size_t err_len);
// Reducescatter of `rows` rows of `row_elems` elements (the same shape on every rank):
// `output` receives this rank's part, rows split as Horovod does (the first rows % size
// ranks one row more).
int keras_ring_device_reducescatter(const void* input, void* output, int64_t rows,
                                    int64_t row_elems, int dtype, int reduce_op,
                                    double prescale, double postscale, int device, void* stream,
                                    const char* name, char* err, size_t err_len);
// Alltoall: splits[p] of this rank's `rows` rows go to rank p (`splits` null and `n_splits`
// 0: equal parts). `output` holds `output_rows` rows, which must be at least the rows
// received; `received_splits` (size() entries, host memory, may be null) gets each rank's.
int keras_ring_device_alltoall(const void* input, void* output, int64_t rows,
                               int64_t row_elems, int64_t output_rows, const int64_t* splits,
                               int n_splits, int32_t* received_splits, int dtype, int device,
                               void* stream, const char* name, char* err, size_t err_len);

// `n` allreduces submitted back to back, at most `window` of them outstanding (submitted and
// not yet completed): collective i reduces `count` elements of buffers[i % k] in place. Returns
// once all completed, with the first failure; *seconds gets the wall time from the first
// submission to the last completion (the host-side cost per collective, with small buffers).
int keras_ring_device_allreduce_window(void* const* buffers, int k, int64_t count, int dtype,
                                       int reduce_op, int n, int window, int device,
                                       void* stream, double* seconds, char* err,
                                       size_t err_len);

// What the GPU backend holds now, for leak checks: CUDA events it made (each made once and
// reused), NCCL communicators. Zeros before the first GPU collective.
int keras_ring_device_objects(int64_t* events, int64_t* communicators);

// Rounds of agreement the GPU backend ran with its peers; collectives agreed by an earlier
// round's lookahead ran without one. 0 before the first GPU collective.
int keras_ring_device_agreement_rounds(int64_t* rounds);

#ifdef __cplusplus
}
#endif
