"""Mixed precision (``mixed_float16``) with a wrapped optimizer.

    keras-ring-run -np 2 python examples/mixed_precision.py
    mpirun -np 2 python examples/mixed_precision.py

Under the ``mixed_float16`` policy, ``model.compile`` puts a ``LossScaleOptimizer`` around
the optimizer. keras_ring then moves its gradient averaging to that outer optimizer, so the
overflow check sees the averaged gradients: every rank skips the same steps and lowers its
loss scale in step with the others. Gradients of float32 variables travel as float16
here (``Compression.fp16``) to halve the bytes. The same works on CPUs (slowly: float16
matmuls are emulated) and on GPUs, where it pays. Offline data, fixed seed.
"""

from __future__ import annotations

import argparse

import numpy as np

import keras
import keras_ring

FEATURES, CLASSES = 32, 4


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    centers = np.random.default_rng(7).normal(size=(CLASSES, FEATURES))
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=n)
    x = (centers[y] + 1.5 * rng.normal(size=(n, FEATURES))).astype("float32")
    return x, y.astype("int64")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    keras_ring.init()
    rank, size = keras_ring.rank(), keras_ring.size()
    keras.mixed_precision.set_global_policy("mixed_float16")

    x, y = make_data(8192 // size * size, seed=0)  # equal shards: equal step counts
    x, y = x[rank::size], y[rank::size]
    keras.utils.set_random_seed(rank)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(64, activation="relu"),
        # Softmax in float32: the output of a mixed-precision model should be.
        keras.layers.Dense(CLASSES, activation="softmax", dtype="float32"),
    ])
    optimizer = keras_ring.wrap(keras.optimizers.Adam(1e-3 * size),
                                compression=keras_ring.Compression.fp16)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=64, epochs=args.epochs, verbose=2 if rank == 0 else 0,
                        callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0),
                                   keras_ring.callbacks.MetricAverageCallback()])
    if rank == 0:
        outer = model.optimizer
        print(f"optimizer: {type(outer.inner_optimizer).__name__} inside "
              f"{type(outer).__name__}, loss scale {float(outer.dynamic_scale.numpy()):g}")
        print(f"final accuracy (averaged over {size} ranks): {history.history['accuracy'][-1]:.2f}")


if __name__ == "__main__":
    main()
