"""How long TensorFlow takes to destroy a tf.data iterator, with autotune on and off, on an
idle or a busy machine (no keras_ring: this is TensorFlow's own behaviour).

The destructor cancels the iterator's autotune thread and waits for it to end. On a busy
machine the cancellation's wake-up often reaches that thread before the cancellation is
marked done, so it goes back to sleep for the rest of its optimization period (which
doubles from 10 ms up to 60 s as the iterator ages). keras_ring frees the iterators of a
failed fit at once because of this (README, "When a rank fails, the job ends"): kept alive
by the error's frames, one was destroyed by a later garbage collection, mid-collective.

    python benchmarks/iterator_teardown.py --processes 4 --busy 1 --life 3 --iterators 20

Each of ``--processes`` processes makes ``--iterators`` iterators of each kind in turn
(autotune on, then off), reads batches from it for ``--life`` seconds and times its
destruction; ``--busy`` pure-Python loops keep cores busy meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SLOW_SECONDS = 0.5


def _child(iterators: int, life: float) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    data = np.random.default_rng(0).random((4096, 32), dtype=np.float32)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(iterators):
        for autotune in times:
            dataset = tf.data.Dataset.from_tensor_slices(data).repeat().batch(32)
            dataset = dataset.prefetch(tf.data.AUTOTUNE)
            options = tf.data.Options()
            options.autotune.enabled = autotune == "on"
            iterator = iter(dataset.with_options(options))
            until = time.monotonic() + life
            while time.monotonic() < until:
                next(iterator)
            start = time.monotonic()
            del iterator  # the last reference: the destructor runs here
            times[autotune].append(time.monotonic() - start)
    print(json.dumps(times), flush=True)


def _table(results: list[dict[str, list[float]]]) -> str:
    lines = [f"{'autotune':>8} | {'iterators':>9} | {'over 0.5 s':>10} | {'median s':>8} | "
             f"{'worst s':>7}"]
    for autotune in ("on", "off"):
        times = [t for result in results for t in result[autotune]]
        slow = sum(t > SLOW_SECONDS for t in times)
        lines.append(f"{autotune:>8} | {len(times):>9} | {slow:>10} | "
                     f"{statistics.median(times):>8.3f} | {max(times):>7.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--iterators", type=int, default=20, help="of each kind, per process")
    parser.add_argument("--life", type=float, default=3.0, help="seconds each iterator is read")
    parser.add_argument("--busy", type=int, default=1, help="busy loops beside the processes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.iterators, args.life)
        return
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        children = [subprocess.Popen(
            [sys.executable, __file__, "--child", "--iterators", str(args.iterators),
             "--life", str(args.life)], stdout=subprocess.PIPE, text=True)
            for _ in range(args.processes)]
        outputs = [child.communicate()[0] for child in children]
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    if any(child.returncode for child in children):
        sys.exit(f"a measuring process failed: exit codes {[c.returncode for c in children]}")
    results = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    print(f"tf.data iterator teardown: {args.processes} processes, {args.busy} busy loops, "
          f"{os.cpu_count()} cores, each iterator read for {args.life} s")
    print(_table(results))


if __name__ == "__main__":
    main()
