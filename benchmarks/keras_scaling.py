"""Milliseconds per training step of ``model.fit`` at 1 and N ranks, next to N independent
single-rank processes running at the same time (the machine's own contention baseline), so
the cost of communication is separated from the cost of sharing the cores.

Run with: python benchmarks/keras_scaling.py [--ranks 2] [--steps 60] [--repeat 3] [--models mlp]
(it starts its own processes: one alone, N independent ones, then N-rank mpirun jobs; all are
measured --repeat times, interleaved, and each column shows the median, because one round on
a small shared machine moves by several percent). Each round's N-rank job trains one model
per bucket layout, in turn (a different layout first in each round): "default" (what wrap() chooses: "auto"), "one bucket" (32 MiB, no first bucket:
the layout before issue 17, in which these models' gradients go in one collective after
backprop) and "overlap" (a 1 MiB first bucket, then 2 MiB buckets: communication during
backprop), so the layouts are compared side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = {"mlp": 128, "cnn": 64}  # model -> batch size per rank


def build_model(name: str):
    import keras

    if name == "mlp":
        return keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                                 keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    return keras.Sequential([
        keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10),
    ])


# --buckets: the N-rank job's gradient buckets, as wrap() keyword arguments.
BUCKETS = {"default": {}, "one bucket": {"bucket_bytes": 32 << 20, "first_bucket_bytes": None},
           "overlap": {"bucket_bytes": 2 << 20, "first_bucket_bytes": 1 << 20}}


def worker(model_name: str, steps: int, distributed: bool, threads: int,
           layouts: list[str]) -> None:
    """Trains on synthetic data and prints one JSON line with the median ms/step per bucket
    layout (each a model of its own, trained in turn in this process)."""
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    if distributed:
        import keras_ring

        keras_ring.init()
    result = {}
    for layout in layouts:
        ms = _train(model_name, steps, layout if distributed else None)
        if distributed:
            ms = max(keras_ring.allgather_object(ms))  # a step is as slow as the slowest rank
        result[layout] = ms
    if not distributed or keras_ring.rank() == 0:
        print(json.dumps(result), flush=True)


def _train(model_name: str, steps: int, layout: str | None) -> float:
    """Median ms per step of one fit (wrapped with `layout`'s buckets unless None)."""
    import numpy as np
    import tensorflow as tf
    import keras

    batch = MODELS[model_name]
    model = build_model(model_name)
    shape = model.input_shape[1:]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * 8, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch * 8)
    optimizer = keras.optimizers.SGD(0.01)
    callbacks = []
    if layout is not None:
        import keras_ring

        optimizer = keras_ring.wrap(optimizer, **BUCKETS[layout])
        callbacks.append(keras_ring.callbacks.BroadcastGlobalVariablesCallback(0))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.t)

    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[*callbacks, Timer()])
    return float(np.median(times[10:])) * 1e3  # after warm-up (tracing, first steps)


def _run(cmds: list[list[str]]) -> list[dict[str, float]]:
    """Each command's JSON lines: {layout: ms}."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in cmds]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(p.args)} failed:\n{err[-2000:]}")
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--worker", choices=["single", "dist"])
    parser.add_argument("--model", choices=list(MODELS), default="mlp")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--buckets", default=",".join(BUCKETS),
                        help="a worker's bucket layouts, comma-separated, trained in turn")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="the models of the table (all by default)")
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.steps, args.worker == "dist", args.threads, args.buckets.split(","))
        return
    n = args.ranks
    me = [sys.executable, str(Path(__file__).resolve())]
    mpirun = str(Path(sys.executable).parent / "mpirun")
    share = max(1, (os.cpu_count() or 1) // n)  # what keras_ring.init() gives each rank
    print(f"# {os.cpu_count()} cores; ms per step, median after warm-up; {n} ranks; batch per rank: "
          + ", ".join(f"{m} {MODELS[m]}" for m in args.models))
    layouts = [b for b in BUCKETS if b != "default"]
    print(f"{'model':<6} | {'1 rank':>8} | {f'{n} independent':>15} | {f'{n} ranks':>9} | {'vs baseline':>11}"
          + "".join(f" | {name:>10} | {'vs baseline':>11}" for name in layouts)
          + " | per round vs baseline: default, " + ", ".join(layouts))
    for model in args.models:
        common = ["--model", model, "--steps", str(args.steps)]
        singles, bases = [], []
        dists: dict[str, list[float]] = {b: [] for b in BUCKETS}
        single_only = ["--buckets", "default"]
        for i in range(args.repeat):
            singles += [r["default"] for r in _run([[*me, "--worker", "single", *single_only, *common]])]
            baseline = _run([[*me, "--worker", "single", "--threads", str(share), *single_only, *common]
                             for _ in range(n)])
            bases.append(sum(r["default"] for r in baseline) / len(baseline))
            # One job trains every layout in turn, first a different one each round.
            order = list(BUCKETS)[i % len(BUCKETS):] + list(BUCKETS)[:i % len(BUCKETS)]
            (dist,) = _run([[mpirun, "-np", str(n), *me, "--worker", "dist", "--buckets", ",".join(order),
                             *common]])
            for layout, times in dists.items():
                times.append(dist[layout])
        single, base = statistics.median(singles), statistics.median(bases)
        cells = ""
        for layout, times in dists.items():
            ms = statistics.median(times)
            cells += f" | {ms:{9 if layout == 'default' else 10}.2f} | {100 * (ms / base - 1):+10.1f}%"
        rounds = ", ".join("/".join(f"{100 * (dists[b][i] / bases[i] - 1):+.0f}" for b in BUCKETS) + "%"
                           for i in range(len(bases)))
        print(f"{model:<6} | {single:8.2f} | {base:15.2f}{cells} | {rounds}", flush=True)


if __name__ == "__main__":
    main()
