"""Quickstart: data-parallel ``model.fit`` with keras_ring.

Run it on 2 ranks (any number works; more ranks than cores is fine):

    keras-ring-run -np 2 python examples/keras_fit.py
    mpirun -np 2 python examples/keras_fit.py        # the same, with rank-prefixed output off
    python examples/keras_fit.py                     # one process

Everything runs offline: the data is generated here, with a fixed seed. It is a 10-class
problem where each class is a mixture of three Gaussian clusters, so a linear model gets
about 0.65 and a small MLP learns it to about 0.94 over a few epochs (chance is 0.1).

What each piece does:

- ``keras_ring.wrap`` averages the gradients over the ranks before every update, so N ranks
  with batch B train like one process with batch N*B; the learning rate is scaled by N.
- ``BroadcastGlobalVariablesCallback(0)`` gives every rank rank 0's initial weights.
- ``MetricAverageCallback`` averages the epoch metrics over the ranks (each rank evaluates
  its own shard of the validation data), so every rank sees the same numbers.
- ``LearningRateWarmupCallback`` ramps the scaled learning rate up over the first epochs.
- ``on_rank_zero(ModelCheckpoint(...))``: only rank 0 writes checkpoints; only rank 0 shows
  progress (``verbose``).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

import keras
import keras_ring

FEATURES, CLASSES = 20, 10


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples of the 10-class problem; the clusters are fixed, ``seed`` picks samples."""
    centers = np.random.default_rng(1234).normal(size=(3 * CLASSES, FEATURES))
    rng = np.random.default_rng(seed)
    cluster = rng.integers(0, 3 * CLASSES, size=n)
    x = (centers[cluster] + rng.normal(size=(n, FEATURES))).astype("float32")
    return x, (cluster % CLASSES).astype("int64")


def build_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--samples", type=int, default=16384, help="training samples in total")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(),
                                                             "keras_ring_keras_fit.keras"))
    args = parser.parse_args()

    keras_ring.init()
    rank, size = keras_ring.rank(), keras_ring.size()

    # Every rank generates the same data and keeps its own, equally long, shard of it
    # (equal shards: synchronous training needs the same number of steps on every rank).
    x_train, y_train = make_data(args.samples // size * size, seed=0)
    x_val, y_val = make_data(4096 // size * size, seed=1)
    x_train, y_train = x_train[rank::size], y_train[rank::size]
    x_val, y_val = x_val[rank::size], y_val[rank::size]

    # Different seeds per rank on purpose: the broadcast makes the weights equal anyway.
    keras.utils.set_random_seed(rank)
    model = build_model()
    optimizer = keras_ring.wrap(keras.optimizers.Adam(1e-3 * size))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    callbacks = [
        keras_ring.callbacks.BroadcastGlobalVariablesCallback(0),
        keras_ring.callbacks.MetricAverageCallback(),
        keras_ring.callbacks.LearningRateWarmupCallback(warmup_epochs=2, verbose=1),
        keras_ring.callbacks.on_rank_zero(keras.callbacks.ModelCheckpoint(
            args.checkpoint, monitor="val_accuracy", save_best_only=True)),
    ]
    history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                        validation_data=(x_val, y_val), callbacks=callbacks,
                        verbose=2 if rank == 0 else 0)

    if rank == 0:
        accuracy = history.history["val_accuracy"]
        print("val_accuracy per epoch: " + " ".join(f"{a:.3f}" for a in accuracy))
        print(f"best checkpoint: {args.checkpoint}")
        print(f"final val_accuracy (averaged over {size} ranks): {accuracy[-1]:.2f}")


if __name__ == "__main__":
    main()
