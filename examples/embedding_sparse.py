"""Sparse gradients: an ``Embedding`` model whose gradients are ``tf.IndexedSlices``.

    keras-ring-run -np 2 python examples/embedding_sparse.py
    keras-ring-run -np 2 python examples/embedding_sparse.py --sparse-as-dense

An embedding's gradient only has rows for the tokens in the batch. By default keras_ring
allgathers those rows (values and indices) instead of allreducing the whole table, which
moves far less data when the vocabulary is large and batches touch few tokens. With
``--sparse-as-dense`` the gradient is densified and allreduced like any other, which is
better when most rows are touched anyway. The task (offline, fixed seed): sequences of
tokens whose label says whether "positive" tokens outnumber "negative" ones.
"""

from __future__ import annotations

import argparse

import numpy as np

import keras
import keras_ring

VOCAB, LENGTH = 5000, 20


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    polarity = np.random.default_rng(5).choice([-1, 0, 1], size=VOCAB, p=[0.3, 0.4, 0.3])
    tokens = np.random.default_rng(seed).integers(0, VOCAB, size=(n, LENGTH))
    score = polarity[tokens].sum(axis=1)
    keep = score != 0  # no ties: every kept sequence leans one way
    return tokens[keep].astype("int32"), (score[keep] > 0).astype("int64")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--sparse-as-dense", action="store_true")
    args = parser.parse_args()

    keras_ring.init()
    rank, size = keras_ring.rank(), keras_ring.size()
    x, y = make_data(20000, seed=0)
    x_val, y_val = make_data(3000, seed=1)
    # Equal shards: every rank must run the same number of steps.
    n, n_val = len(x) // size * size, len(x_val) // size * size
    x, y = x[rank:n:size], y[rank:n:size]
    x_val, y_val = x_val[rank:n_val:size], y_val[rank:n_val:size]

    keras.utils.set_random_seed(rank)
    model = keras.Sequential([
        keras.Input((LENGTH,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 8),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1, activation="sigmoid"),
    ])
    optimizer = keras_ring.wrap(keras.optimizers.Adam(0.01 * size),
                                sparse_as_dense=args.sparse_as_dense)
    model.compile(optimizer=optimizer, loss="binary_crossentropy", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=64, epochs=args.epochs, validation_data=(x_val, y_val),
                        verbose=2 if rank == 0 else 0,
                        callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0),
                                   keras_ring.callbacks.MetricAverageCallback()])
    if rank == 0:
        how = "dense allreduce" if args.sparse_as_dense else "allgather of rows"
        print(f"embedding gradients by {how}; final val_accuracy (averaged over {size} ranks): "
              f"{history.history['val_accuracy'][-1]:.2f}")


if __name__ == "__main__":
    main()
