"""A custom training loop with ``keras_ring.DistributedGradientTape``.

    keras-ring-run -np 2 python examples/custom_loop.py
    mpirun -np 2 python examples/custom_loop.py

The tape computes this rank's gradients and averages them over the ranks; the optimizer is
a plain Keras one. The first thing the loop does is to give every rank rank 0's weights and
optimizer state (``broadcast_model``), the last is to average the loss over the ranks for
printing. Data is generated here (offline, fixed seed): a noisy linear regression.
"""

from __future__ import annotations

import argparse

import numpy as np
import tensorflow as tf

import keras
import keras_ring

FEATURES = 16


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    true_w = np.random.default_rng(99).normal(size=(FEATURES, 1))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x @ true_w + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    keras_ring.init()
    rank, size = keras_ring.rank(), keras_ring.size()
    x, y = make_data(8192 // size * size, seed=0)  # equal shards: equal step counts
    dataset = (tf.data.Dataset.from_tensor_slices((x, y))
               .shard(size, rank)  # every rank takes every size-th example
               .batch(args.batch_size, drop_remainder=True))  # equal step counts on all ranks

    keras.utils.set_random_seed(rank)  # different on purpose: the broadcast fixes it
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01 * size, momentum=0.9)
    optimizer.build(model.trainable_variables)
    model.optimizer = optimizer
    keras_ring.callbacks.broadcast_model(model, root_rank=0)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = keras_ring.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for epoch in range(args.epochs):
        losses = [train_step(xb, yb) for xb, yb in dataset]
        mean_loss = keras_ring.allreduce(tf.reduce_mean(losses), name="epoch_loss")
        if rank == 0:
            print(f"epoch {epoch + 1}: loss (averaged over {size} ranks) {float(mean_loss):.4f}")


if __name__ == "__main__":
    main()
