"""What KERAS_RING_TIMELINE costs a long run: each rank's memory growth over N eager
collectives with the timeline recording, and the time and peak memory of writing the trace at
shutdown(). Run it under mpirun; each rank prints one line.

    mpirun -np 2 python benchmarks/timeline_memory.py --collectives 20000 --trace /tmp/t.json
"""

from __future__ import annotations

import argparse
import os
import re
import time


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--collectives", type=int, default=20000)
    parser.add_argument("--trace", required=True, help="KERAS_RING_TIMELINE's path")
    args = parser.parse_args()
    os.environ["KERAS_RING_TIMELINE"] = args.trace

    import tensorflow as tf

    import keras_ring as kr

    kr.init()
    x = tf.ones([16])
    for i in range(200):  # TensorFlow's and the runtime's own warm-up
        kr.allreduce(x, name="warm-up")
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    for i in range(args.collectives):
        kr.allreduce(x, name="step")
    loop = time.perf_counter() - start
    grown = _status_kib("VmRSS") - before
    rank = kr.rank()
    start = time.perf_counter()
    kr.shutdown()
    write = time.perf_counter() - start
    peak = _status_kib("VmHWM") - before
    size = os.path.getsize(args.trace) if rank == 0 and os.path.exists(args.trace) else 0
    print(f"rank {rank}: {args.collectives} collectives in {loop:.1f} s; memory grew "
          f"{grown / 1024:.1f} MiB while recording; shutdown() {write:.2f} s, peak "
          f"{peak / 1024:.1f} MiB over the start; trace {size / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
