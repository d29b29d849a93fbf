#!/usr/bin/env bash
# keras_ring's NCCL backend on a GPU machine, in one call of at most 9 minutes (typically
# 2-3), without TensorFlow and without network: builds the core runtime and its C API with g++
# into libkeras_ring_core.so, then runs benchmarks/gpu_check.py on NP ranks (default 2). With
# fewer GPUs than ranks the ranks share them, which needs NCCL >= 2.30 (with
# NCCL_MULTI_RANK_GPU_ENABLE=1 and NCCL_MAX_CTAS set, so both ranks' kernels fit, and an MPS
# daemon started for the run where the machine has one, so they run side by side; the counts
# of calls are cut, since without MPS the ranks take turns on the GPU; an older NCCL runs the checks on
# as many ranks as there are GPUs, without the killed-rank scenario (it needs 2 ranks), and the
# script exits 4: an incomplete run, never a pass. The ranks check allreduce (single
# and grouped), allgather and broadcast on CuPy arrays against NumPy, edge cases, 10,000 small
# collectives with stable GPU memory, the libraries loaded and the GPUs holding their
# contexts, the host-side cost per collective with 1 and 64 in flight (gpu_check_inflight.py;
# "in flight" in the log), print an nccl-tests-style busbw table next to torch.distributed's NCCL
# allreduce, then run the failure scenarios (a rank killed, a GPU stalled, init after
# shutdown) as jobs of their own. NCCL_DEBUG=WARN: NCCL's own warnings land in the log.
#
# Needs g++, a CUDA driver, NCCL (nvidia-nccl-cu12 wheel or the system's), NumPy and CuPy;
# PyTorch (the comparison) is optional. The driver starts the ranks itself (one host needs no
# MPI); USE_MPI=1 starts them with mpirun and mpi4py instead. Output: $OUT/gpu_check.{log,json} and
# $OUT/gpu_check_faults.json if OUT is set, else build/gpu_check/. Exit status 0 when every
# check passed. BUILD_DIR=dir builds in dir (default build/gpu_check; a relative one, like
# OUT, is taken from the repository's root); BUILD_ONLY=1 stops after the build (it needs
# nothing but g++: that part is checked on machines without a GPU too).
#
#   benchmarks/gpu_check.sh
#   NP=4 PYTHON=python3.11 benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
NP=${NP:-2}
BUILD=${BUILD_DIR:-build/gpu_check}
DEST=${OUT:-$BUILD}
mkdir -p "$BUILD/obj" "$DEST"
exec > >(tee "$DEST/gpu_check.log") 2>&1

say() { echo "gpu_check: $*"; }
die() { say "$*"; exit 2; }

# 1. What this machine has.
command -v "$PY" >/dev/null || die "no $PY here (set PYTHON=...)"
CXX=${CXX:-$(command -v g++ || command -v c++ || true)}
[ -n "$CXX" ] || die "needs a C++17 compiler: no g++ or c++ on PATH (set CXX=...)"
say "$("$CXX" --version | head -1); $("$PY" --version 2>&1)"
build() {
    rm -f "$BUILD"/obj/*.o
    local src pid failed=0 start pids=()
    # The C API and the error registry it reports through; the rest of tf/ needs TensorFlow.
    local sources=(keras_ring/ops/cc/core/*.cc keras_ring/ops/cc/core/nccl/*.cc
                   keras_ring/ops/cc/tf/c_api.cc keras_ring/ops/cc/tf/error_registry.cc)
    say "building $BUILD/libkeras_ring_core.so from ${#sources[@]} files (no TensorFlow) ..."
    start=$(date +%s)
    for src in "${sources[@]}"; do
        "$CXX" -std=c++17 -O2 -fPIC -pthread -Wall -Wextra -c "$src" \
            -o "$BUILD/obj/$(echo "$src" | tr / _).o" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    [ "$failed" = 0 ] || die "compilation failed (above)"
    # --no-undefined: a source missing from the list fails here, not when every rank loads
    # the library on the GPU machine (NCCL and CUDA are opened with dlopen, so nothing else
    # is left undefined). --exclude-libs: a compiler that links libstdc++ statically (the
    # GPU machine's g++ does) would otherwise export it, and the process's own
    # libstdc++.so.6 (CuPy's, PyTorch's), of another GCC, would mix locale facets with it:
    # the first double put into an ostringstream (a timeout's message) crashed there.
    "$CXX" -shared -pthread -Wl,--no-undefined -Wl,--exclude-libs,ALL \
        -o "$BUILD/libkeras_ring_core.so" "$BUILD"/obj/*.o -ldl || die "linking failed (above)"
    if command -v readelf >/dev/null &&
        ! readelf -d "$BUILD/libkeras_ring_core.so" | grep -q 'libstdc++'; then
        say "this compiler linked libstdc++ statically (kept private to the library)"
    fi
    "$PY" -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' "$BUILD/libkeras_ring_core.so" \
        || die "the library does not load (above)"
    say "built in $(( $(date +%s) - start )) s"
}
if [ "${BUILD_ONLY:-0}" = 1 ]; then
    build
    exit 0
fi
nvidia-smi -L 2>/dev/null || say "nvidia-smi is not available (continuing)"
"$PY" - <<'EOF' || die "a required Python package is missing (see above)"
import importlib, sys
try:
    import cupy
    print(f"gpu_check: CUDA driver {cupy.cuda.runtime.driverGetVersion()}, "
          f"CuPy's runtime {cupy.cuda.runtime.runtimeGetVersion()}")
except Exception as e:
    print(f"gpu_check: no CUDA driver version ({type(e).__name__}: {e})")
missing = []
for name, required in (("numpy", True), ("cupy", True), ("torch", False), ("mpi4py", False)):
    try:
        module = importlib.import_module(name)
        print(f"gpu_check: {name} {getattr(module, '__version__', '?')}")
    except Exception as e:
        print(f"gpu_check: {name} does not import ({type(e).__name__}: {e})"
              + ("" if required else "; optional, continuing"))
        missing += [name] if required else []
sys.exit(1 if missing else 0)
EOF
read -r GPUS NCCL_DIR NCCL_CODE < <("$PY" benchmarks/gpu_check.py --find-nccl)
[ "${GPUS:-0}" -gt 0 ] || die "CuPy sees no GPU"
[ "${NCCL_CODE:-0}" -gt 0 ] || die "no libnccl.so.2 found (pip install nvidia-nccl-cu12, or put it on LD_LIBRARY_PATH)"
say "$GPUS GPU(s); newest NCCL: $NCCL_DIR (version code $NCCL_CODE)"
export KERAS_RING_GPU_CHECK_NCCL_DIR=$NCCL_DIR
ASKED=$NP
if [ "$GPUS" -lt "$NP" ] && [ "$NCCL_CODE" -lt 23000 ]; then
    # Fewer ranks still check loading, the ABI, ordering and the host cost per collective:
    # worth the GPU time, but not a pass.
    say "$NP ranks would share $GPUS GPU(s), which needs NCCL >= 2.30 (found code $NCCL_CODE): running $GPUS rank(s) instead; this run cannot pass (install a newer NCCL for $NP)"
    NP=$GPUS
fi
if [ "$GPUS" -lt "$NP" ]; then
    export NCCL_MULTI_RANK_GPU_ENABLE=${NCCL_MULTI_RANK_GPU_ENABLE:-1}
    export NCCL_MAX_CTAS=${NCCL_MAX_CTAS:-16}  # ranks sharing a GPU must run side by side
    say "$NP ranks share $GPUS GPU(s): NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=$NCCL_MAX_CTAS"
    # Without MPS the sharing ranks' kernels take turns in time slices, and every collective
    # costs milliseconds (4.5-5.5 ms on an H200, torch's the same): MPS runs them side by
    # side, so the figures are the library's. A daemon started here is stopped here.
    if [ "${MPS:-1}" = 1 ] && [ -z "${CUDA_MPS_PIPE_DIRECTORY:-}" ] &&
        command -v nvidia-cuda-mps-control >/dev/null; then
        export CUDA_MPS_PIPE_DIRECTORY=$BUILD/mps CUDA_MPS_LOG_DIRECTORY=$BUILD/mps_log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        if nvidia-cuda-mps-control -d; then
            trap 'echo quit | nvidia-cuda-mps-control' EXIT
            say "started an MPS daemon for the sharing ranks (MPS=0: without)"
        else
            say "no MPS daemon (continuing: collectives take turns on the GPU)"
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        fi
    fi
fi
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# 2. The core runtime and its C APIs, without TensorFlow.
build

# 3. The ranks: started by the driver, or by mpirun (USE_MPI=1). Each phase prints a
# timestamped line, and rank 0 writes the checks' results before the benchmark starts. The
# ranks agree on each collective as a user's job on one host does (shared memory, the fast
# agreement); KERAS_RING_SHM=0 or KERAS_RING_FAST_AGREE=0 changes that as it does for users.
ARGS=(--lib "$BUILD/libkeras_ring_core.so" --json "$DEST/gpu_check.json")
[ "$GPUS" -lt "$NP" ] && MAX_BYTES=${MAX_BYTES:-67108864}  # sharing ranks take turns
ARGS+=(--max-bytes "${MAX_BYTES:-268435456}")
rm -f "$DEST/gpu_check.json"
if [ "${USE_MPI:-0}" = 1 ]; then
    MPIRUN=$(command -v mpirun || command -v mpiexec) || die "USE_MPI=1, but no mpirun here"
    "$PY" -c "from mpi4py import MPI" || die "USE_MPI=1, but mpi4py does not load its MPI (above)"
    extra=()
    if "$MPIRUN" --version 2>&1 | grep -i "open mpi" >/dev/null; then
        extra=(--oversubscribe -x NCCL_DEBUG -x KERAS_RING_GPU_CHECK_NCCL_DIR)
        for v in NCCL_MULTI_RANK_GPU_ENABLE NCCL_MAX_CTAS; do [ -n "${!v:-}" ] && extra+=(-x "$v"); done
        [ "$(id -u)" = 0 ] && extra+=(--allow-run-as-root)
    fi
    say "running $NP rank(s) with $MPIRUN"
    timeout -k 10 200 "$MPIRUN" -np "$NP" ${extra[@]+"${extra[@]}"} "$PY" benchmarks/gpu_check.py --ranks "$NP" "${ARGS[@]}"
    rc=$?
else
    say "running $NP rank(s) started by the driver"
    timeout -k 10 215 "$PY" benchmarks/gpu_check.py --spawn "$NP" --timeout 200 "${ARGS[@]}"
    rc=$?
fi

# NCCL's own one-rank kernel, without keras_ring: does it still need the workaround?
timeout -k 5 120 "$PY" benchmarks/gpu_check_nccl_one_rank.py "$NCCL_DIR" 2>&1 | sed 's/^/gpu_check: /'

# 4. Failure paths, each a job of its own started by the driver (a killed rank needs 2 ranks;
# at one rank only the stalled GPU and init after shutdown run, and the result is 4).
say "failure scenarios on $NP rank(s)"
timeout -k 10 200 "$PY" benchmarks/gpu_check.py --faults "$NP" --timeout 60 \
    --lib "$BUILD/libkeras_ring_core.so" --json "$DEST/gpu_check_faults.json"
frc=$?
say "exit status $rc (checks), $frc (failure scenarios)"
[ "$rc" = 0 ] || exit "$rc"
[ "$frc" = 0 ] || [ "$frc" = 4 ] || exit "$frc"  # 4: a scenario needed more ranks
if [ "$NP" -lt "$ASKED" ] || [ "$frc" = 4 ]; then
    say "incomplete: ran $NP of the $ASKED ranks asked for (exit 4)"
    exit 4
fi
exit 0
