"""One rank of a small Keras job with a fault (test_job_failure.py starts it under each launcher).

Environment: ``FAULT`` = ``none``, ``stall`` (sleep 600 s in user code: a hung data loader), ``crash``
(``os._exit(3)``: gone without a word), ``raise`` (an exception in user code, uncaught) or
``stop`` (this rank's callback stops training: its ``fit`` returns and the program ends),
``sigstop`` (the rank stops itself with SIGSTOP: it can run nothing, not even keras_ring's
failure exit) or
``before_init`` (an uncaught error before ``keras_ring.init()``, under mpirun);
``FAULT_RANK`` (default 1) and ``FAULT_STEP`` (default 5) say where. ``JOB_DIR`` gets
``fault`` (the CLOCK_MONOTONIC time of the fault) and ``error.R`` (rank R's error, as JSON:
class, keras_ring attributes, message) when a rank's ``fit`` fails. The exception is
re-raised, as an uncaught error, so the exit path is the one real programs take; with
``CATCH=<code>`` the program catches it and ends with ``sys.exit(code)`` instead (it logged
the error, say).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import keras
import keras_ring


class Fault(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            print("TRAINING", flush=True)
        if batch != int(os.environ.get("FAULT_STEP", "5")):
            return
        if keras_ring.rank() != int(os.environ.get("FAULT_RANK", "1")):
            return
        fault = os.environ.get("FAULT", "none")
        if fault == "none":
            return
        Path(os.environ["JOB_DIR"], "fault").write_text(repr(time.monotonic()))
        if fault == "stall":
            time.sleep(600)
        elif fault == "crash":
            os._exit(3)
        elif fault == "raise":
            raise ValueError("a bad record in the input")
        elif fault == "stop":  # as EarlyStopping or TerminateOnNaN decide on one rank alone
            self.model.stop_training = True
        elif fault == "sigstop":  # a rank that cannot run at all: stopped, or stuck in the kernel
            os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    if (os.environ.get("FAULT") == "before_init"
            and os.environ.get("PMI_RANK") == os.environ.get("FAULT_RANK", "1")):
        Path(os.environ["JOB_DIR"], "fault").write_text(repr(time.monotonic()))
        raise FileNotFoundError("this rank's data shard is missing")  # before init()
    if os.environ.get("FAULT") == "stall_before_init":  # rank 1 stalls, rank 0 waits in init()
        if os.environ.get("PMI_RANK") == "1":
            time.sleep(600)
        Path(os.environ["JOB_DIR"], "waiting").write_text(str(os.getpid()))
    keras_ring.init()
    rng = np.random.default_rng(keras_ring.rank())
    x = rng.normal(size=(2048, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int64")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.05)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        model.fit(x, y, batch_size=32, epochs=int(os.environ.get("EPOCHS", "5")), verbose=0,
                  callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0), Fault()])
    except Exception as e:
        record = {"type": type(e).__name__, "message": str(e),
                  "keras_ring": isinstance(e, keras_ring.KerasRingError),
                  "rank": getattr(e, "rank", None), "collective": getattr(e, "collective", None)}
        Path(os.environ["JOB_DIR"], f"error.{keras_ring.rank()}").write_text(json.dumps(record))
        if "CATCH" not in os.environ:
            raise
        sys.exit(int(os.environ["CATCH"]))


if __name__ == "__main__":
    main()
