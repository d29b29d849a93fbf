"""A worker of the elastic tests, written the way Horovod's elastic Keras examples are.

It trains a small classifier with ``fit`` and the three elastic callbacks, and prints JSON
records the tests read: ``EPOCH`` (the world an epoch ended in), ``RESET`` (the first batch
after a change of world), ``RESULT`` (the final weights' checksum), ``DEATH`` (right before a
worker kills itself). What happens is set by the test through the environment:

- ``KR_DIE_ON_HOST=host`` (or ``KR_DIE_WORKER=id``) and ``KR_DIE_AT=epoch:batch``: the
  worker on that host (or with that id) kills
  itself (SIGKILL: no clean-up at all) when it reaches that batch, in its first world only;
- ``KR_FAIL_ON_HOST=host``: the worker on that host exits with code 3 at start;
- ``KR_FIT_FIRST=1``: one step of ``fit`` before the elastic state is made;
- ``KR_GROW_FILE=path`` and ``KR_GROW_LINE=host:slots``: rank 0 appends that line to the
  discovery file the first time it trains in a smaller world than the first one, and before
  that world's second batch waits (bounded) until the newcomer waits at the rendezvous, so
  that it joins at the next commit however long its start takes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

HOST = os.environ.get("KERAS_RING_HOST_ID", "")
WORKER = os.environ.get("KERAS_RING_ELASTIC_WORKER", "")
if HOST and HOST == os.environ.get("KR_FAIL_ON_HOST"):
    sys.exit(3)

import keras  # noqa: E402

import keras_ring  # noqa: E402
import keras_ring.runtime  # noqa: E402
from keras_ring import elastic  # noqa: E402

EPOCHS = int(os.environ.get("KR_EPOCHS", "4"))
BATCH = 16
SAMPLES = 960


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int32")
    return x, y


def model() -> keras.Model:
    keras.utils.set_random_seed(1234 + keras_ring.rank())  # differ: the sync must fix it
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(2, activation="softmax")])


def record(kind: str, **fields) -> None:
    print(f"{kind} {json.dumps(dict(fields, pid=os.getpid()))}", flush=True)


def resources() -> dict:
    """This process's threads, open descriptors and sockets (to tell leaks across worlds)."""
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the descriptor listdir itself used, closed meanwhile
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(fds), "sockets": sockets}


def wait_for_newcomer(bound: float = 240.0) -> None:
    """Rank 0 of the shrunken world: until a new worker waits to join (the others wait in
    their next collective meanwhile, within KERAS_RING_TIMEOUT_SECONDS)."""
    client = keras_ring.runtime.RUNTIME.elastic
    deadline = time.monotonic() + bound
    while not client.updates_waiting():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no new worker arrived within {bound} s")
        time.sleep(0.05)


class Faults(keras.callbacks.Callback):
    """Kills this worker at the configured batch; records the first batch of each world."""

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state
        self.first_size = keras_ring.size()
        self.fresh = False
        die_at = os.environ.get("KR_DIE_AT", "")
        self.die_at = tuple(map(int, die_at.split(":"))) if die_at else None
        self.dying = HOST == os.environ.get("KR_DIE_ON_HOST") or WORKER == os.environ.get(
            "KR_DIE_WORKER")
        self.grew = False

    def on_train_begin(self, logs=None):
        self.fresh = True
        grow = os.environ.get("KR_GROW_FILE")
        if grow and keras_ring.rank() == 0 and keras_ring.size() < self.first_size:
            with open(grow, "a") as f:
                f.write(os.environ["KR_GROW_LINE"] + "\n")
            os.environ.pop("KR_GROW_FILE")
            self.grew = True

    def on_train_batch_begin(self, batch, logs=None):
        if self.fresh:
            self.fresh = False
            record("RESET", rank=keras_ring.rank(), size=keras_ring.size(), time=time.time(),
                   epoch=self.state.epoch, **resources())
        elif self.grew:
            self.grew = False
            wait_for_newcomer()
        if self.dying and (self.state.epoch, batch) == self.die_at:
            record("DEATH", host=HOST, time=time.time())
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_end(self, epoch, logs=None):
        record("EPOCH", epoch=epoch, rank=keras_ring.rank(), size=keras_ring.size(),
               loss=float(logs["loss"]))


def main() -> None:
    keras_ring.init()
    x, y = data()
    net = model()
    net.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.05)),
                loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    if os.environ.get("KR_FIT_FIRST"):
        # Horovod's elastic Keras example fits one step to make the optimizer's state, on
        # weights that differ by rank: the state sync mends them, no error (a world that a
        # worker joins later must not: see the README).
        net.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    state = elastic.KerasState(net, epoch=0, batch=0)
    faults = Faults(state)

    @elastic.run
    def train(state):
        # The shard depends on the world: computed in every world anew.
        shard = slice(keras_ring.rank(), None, keras_ring.size())
        net.fit(x[shard], y[shard], batch_size=BATCH, initial_epoch=state.epoch,
                epochs=EPOCHS, verbose=0, shuffle=False,
                callbacks=[elastic.CommitStateCallback(state),
                           elastic.UpdateBatchStateCallback(state),
                           elastic.UpdateEpochStateCallback(state), faults,
                           keras_ring.callbacks.MetricAverageCallback()])

    train(state)
    weights = np.concatenate([w.ravel() for w in net.get_weights()]).astype("float64")
    _, accuracy = net.evaluate(x, y, verbose=0)
    record("RESULT", rank=keras_ring.rank(), size=keras_ring.size(), host=HOST,
           checksum=float(weights.sum()), norm=float(np.linalg.norm(weights)),
           accuracy=float(accuracy), epoch=state.epoch)
    keras_ring.shutdown()


if __name__ == "__main__":
    main()
