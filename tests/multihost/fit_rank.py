"""One rank of a small Keras training job, written the way Horovod users write theirs.

``python fit_rank.py [--epochs N] [--die-at-step S --die-rank R]``

Prints ``START {json}`` with the rank and its process id once ``init()`` returned (the test
finds the job's shared-memory segments by it), ``STEP n`` after every batch (the test pulls a cable or waits on it), and at the end
``RESULT {json}`` with the rank, its host, the final accuracy and a digest of its weights, or
``ERROR {json}`` with the exception's class and message (exit code 1). ``--die-at-step``
makes rank R kill itself with SIGKILL after that step (a crash: no error, no goodbye).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import sys

import numpy as np

import keras
import keras_ring

FEATURES, CLASSES = 12, 4



def _line(text: str) -> None:
    # One write: unbuffered (PYTHONUNBUFFERED), print writes the text and its newline apart,
    # and ranks sharing mpirun's stdout could then run two records into one line.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    centers = np.random.default_rng(7).normal(size=(2 * CLASSES, FEATURES)) * 2.0
    rng = np.random.default_rng(seed)
    cluster = rng.integers(0, 2 * CLASSES, size=n)
    x = (centers[cluster] + rng.normal(size=(n, FEATURES))).astype("float32")
    return x, (cluster % CLASSES).astype("int64")


class Steps(keras.callbacks.Callback):
    def __init__(self, die_at: int, die_rank: int):
        super().__init__()
        self.step, self.die_at, self.die_rank = 0, die_at, die_rank

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        print(f"STEP {self.step}", flush=True)
        if self.step == self.die_at and keras_ring.rank() == self.die_rank:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--die-at-step", type=int, default=-1)
    parser.add_argument("--die-rank", type=int, default=-1)
    args = parser.parse_args()
    keras_ring.init()
    _line("START " + json.dumps({"rank": keras_ring.rank(), "pid": os.getpid()}))
    x, y = make_data(2048, seed=keras_ring.rank())  # each rank its own shard
    # No Input: Keras builds it lazily, as in Horovod's own Keras examples.
    model = keras.Sequential([keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    opt = keras_ring.wrap(keras.optimizers.Adam(1e-3 * keras_ring.size()))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    try:
        history = model.fit(
            x, y, batch_size=32, epochs=args.epochs, verbose=0,
            callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0),
                       keras_ring.callbacks.MetricAverageCallback(),
                       Steps(args.die_at_step, args.die_rank)])
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
        _line("ERROR " + json.dumps({"rank": keras_ring.rank(), "type": type(e).__name__,
                                     "message": str(e)}))
        return 1
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes()
                                      for w in model.get_weights())).hexdigest()
    _line("RESULT " + json.dumps({
        "rank": keras_ring.rank(), "host": socket.gethostname(),
        "local_size": keras_ring.local_size(), "weights": digest,
        "accuracy": float(history.history["accuracy"][-1])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
