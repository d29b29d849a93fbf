"""An elastic worker with a custom training loop, the way Horovod's TensorFlow 2 elastic
example is written: ``TensorFlowState`` over the model's and optimizer's variables, a
``tf.function`` step with ``DistributedGradientTape``, a commit every few steps, and the step
traced anew in a reset callback (not with ``KR_RETRACE=0``, as Horovod's example). Prints
``RESULT`` (and ``DEATH``) records like train_worker.py; ``KR_DIE_ON_HOST`` (or
``KR_DIE_WORKER``, a worker id) and ``KR_DIE_AT_STEP`` kill a worker in its first world;
``KR_RAISE_AT_STEP`` makes every worker raise there (a bug of the program), and
``KR_MISMATCH_AT_STEP`` makes rank 0 run another collective than the others there;
``KR_STEP_BEFORE_RUN=1`` takes one training step before ``elastic.run``, as Horovod's
tensorflow2_synthetic_benchmark_elastic.py does.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import tensorflow as tf

import keras_ring
import keras_ring.runtime
from keras_ring import elastic

HOST = os.environ.get("KERAS_RING_HOST_ID", "")
STEPS = 60
COMMIT_EVERY = 5


def record(kind: str, **fields) -> None:
    print(f"{kind} {json.dumps(dict(fields, pid=os.getpid()))}", flush=True)


def main() -> None:
    keras_ring.init()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(512, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.1
    tf.random.set_seed(100 + keras_ring.rank())  # differ: the sync must fix it
    w = tf.Variable(tf.random.normal((4, 1)))
    b = tf.Variable(tf.zeros((1,)))
    optimizer = tf.keras.optimizers.SGD(0.05)
    optimizer.build([w, b])
    state = elastic.TensorFlowState([w, b, *optimizer.variables], step=0)
    die_at = int(os.environ.get("KR_DIE_AT_STEP", "-1"))
    dying = HOST == os.environ.get("KR_DIE_ON_HOST") or os.environ.get(
        "KERAS_RING_ELASTIC_WORKER") == os.environ.get("KR_DIE_WORKER")

    def make_step():
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((xb @ w + b - yb) ** 2)
            tape = keras_ring.DistributedGradientTape(tape)
            grads = tape.gradient(loss, [w, b])
            optimizer.apply_gradients(zip(grads, [w, b]))
            return loss
        return step

    holder = {"step": make_step(), "first_size": keras_ring.size(), "waited": False}
    if os.environ.get("KR_RETRACE", "1") == "1":
        state.register_reset_callbacks([lambda: holder.update(step=make_step())])
    raise_at = int(os.environ.get("KR_RAISE_AT_STEP", "-1"))
    mismatch_at = int(os.environ.get("KR_MISMATCH_AT_STEP", "-1"))

    def wait_for_replacement():
        # KR_WAIT_NEWCOMER: rank 0 of the shrunken world waits (bounded) for the replacement
        # to wait at the rendezvous, so that it joins at the next commit however slow its
        # start; the other ranks wait in their next collective meanwhile.
        if (holder["waited"] or not os.environ.get("KR_WAIT_NEWCOMER")
                or keras_ring.size() >= holder["first_size"] or keras_ring.rank() != 0):
            return
        holder["waited"] = True
        client = keras_ring.runtime.RUNTIME.elastic
        deadline = time.monotonic() + 240
        while not client.updates_waiting():
            if time.monotonic() > deadline:
                raise RuntimeError("no replacement arrived within 240 s")
            time.sleep(0.05)

    @elastic.run
    def train(state):
        n, r = keras_ring.size(), keras_ring.rank()
        wait_for_replacement()
        while state.step < STEPS:
            if dying and state.step == die_at:
                record("DEATH", host=HOST)
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step == raise_at:
                raise ValueError("a bug of the program")
            if state.step == mismatch_at:
                keras_ring.allreduce(tf.ones([2]), name=f"mismatch.{keras_ring.rank() == 0}")
            rows = slice(state.step % 8 * 64, state.step % 8 * 64 + 64)
            holder["step"](x[rows][r::n], y[rows][r::n])
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    if os.environ.get("KR_STEP_BEFORE_RUN") == "1":
        holder["step"](x[:64], y[:64])
    train(state)
    loss = float(np.mean((x @ w.numpy() + b.numpy() - y) ** 2))
    record("RESULT", rank=keras_ring.rank(), size=keras_ring.size(), host=HOST,
           checksum=float(w.numpy().sum() + b.numpy().sum()), loss=loss, step=state.step)
    keras_ring.shutdown()


if __name__ == "__main__":
    main()
