"""N ranks x batch B must train exactly like one process with batch N*B.

Ranks start from different random weights; the broadcast makes them continue from the
root's. The single-process reference (the root's initial model, the full data in batches of
N*B, same order) is computed on every rank locally.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring
from keras_ring.callbacks import BroadcastGlobalVariablesCallback, broadcast_model

from tests.parallel import keras_support as ks

BATCH, STEPS, EPOCHS = 4, 5, 2


# Besides plain SGD and Adam: options that act on the gradients inside the optimizer's apply.
# With the gradient averaged first they see what one process with the whole batch sees;
# clipping a rank's own gradient instead (Horovod's Keras optimizer once did) averages
# clipped halves. The limits are far below these gradients' norms, so clipping acts on
# every step.
_OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd_unclipped": lambda: keras.optimizers.SGD(0.1),
    "sgd_global_clipnorm": lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.02),
    "sgd_clipnorm": lambda: keras.optimizers.SGD(0.1, clipnorm=0.01),
    "adamw_ema": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.5, use_ema=True,
                                                 ema_overwrite_frequency=3),
}


def _optimizer(kind: str) -> keras.optimizers.Optimizer:
    return _OPTIMIZERS[kind]()


def _data(size):
    return ks.classification_data(size * BATCH * STEPS, seed=7)


@functools.lru_cache(maxsize=None)
def _reference(kind: str, root: int, size: int) -> tuple:
    """The root's initial model trained in one process on batches of size*BATCH."""
    x, y = _data(size)
    model = ks.mlp(ks.rank_seed(root))
    model.compile(optimizer=_optimizer(kind), loss=ks.loss())
    model.fit(x, y, batch_size=size * BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return tuple(ks.weights(model))


def _rank_data(rank, size):
    x, y = _data(size)
    return ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH)


def _tolerance(kind):
    # Summing in a different order moves the gradient by a few ulps; Adam's normalisation
    # can magnify that on near-zero gradients a little more than SGD does.
    return 1e-6 if kind.startswith("sgd") else 2e-6


@pytest.mark.parametrize("kind, root", [("sgd", 0), ("adam", -1)])
def test_fit_matches_single_process_with_larger_batch(world, kind, root):
    rank, size = world
    root = root % size
    model = ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(_optimizer(kind)), loss=ks.loss())
    x, y = _rank_data(rank, size)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(root)])
    ks.assert_weights_close(ks.weights(model), _reference(kind, root, size), atol=_tolerance(kind))
    ks.assert_same_on_all_ranks(ks.weights(model))


@pytest.mark.parametrize("mode", ["steps_per_execution", "run_eagerly"])
def test_fit_variants_match_single_process(world, mode):
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(_optimizer("sgd")), loss=ks.loss(),
                  steps_per_execution=3 if mode == "steps_per_execution" else 1,
                  run_eagerly=mode == "run_eagerly")
    x, y = _rank_data(rank, size)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    ks.assert_weights_close(ks.weights(model), _reference("sgd", 0, size), atol=1e-6)


@pytest.mark.parametrize("kind", ["sgd_global_clipnorm", "sgd_clipnorm", "adamw_ema"])
def test_clipping_decay_and_ema_see_the_averaged_gradients(world, kind):
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(_optimizer(kind)), loss=ks.loss())
    x, y = _rank_data(rank, size)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    ks.assert_weights_close(ks.weights(model), _reference(kind, 0, size), atol=_tolerance(kind))
    # The option changed the training (else matching the reference would prove nothing).
    plain = "adam" if kind == "adamw_ema" else "sgd_unclipped"
    assert max(np.abs(a - b).max() for a, b in zip(_reference(kind, 0, size),
                                                   _reference(plain, 0, size))) > 100 * _tolerance(kind)


def test_train_on_batch_matches_single_process(world):
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(_optimizer("sgd")), loss=ks.loss())
    broadcast_model(model, root_rank=0)
    x, y = _rank_data(rank, size)
    for _ in range(EPOCHS):
        for k in range(STEPS):
            model.train_on_batch(x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH])
    ks.assert_weights_close(ks.weights(model), _reference("sgd", 0, size), atol=1e-6)


def _custom_loop(model, optimizer, x, y, step):
    for _ in range(EPOCHS):
        for k in range(STEPS):
            step(tf.constant(x[k * BATCH:(k + 1) * BATCH]), tf.constant(y[k * BATCH:(k + 1) * BATCH]))


@pytest.mark.parametrize("how", ["wrapped_apply_gradients", "distributed_gradient_tape"])
def test_custom_loop_matches_single_process(world, how):
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    optimizer = _optimizer("adam")
    if how == "wrapped_apply_gradients":
        optimizer = keras_ring.wrap(optimizer)
    optimizer.build(model.trainable_variables)
    model.optimizer = optimizer
    broadcast_model(model, root_rank=0)
    loss_fn = ks.loss()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        if how == "distributed_gradient_tape":
            tape = keras_ring.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    x, y = _rank_data(rank, size)
    _custom_loop(model, optimizer, x, y, step)
    ks.assert_weights_close(ks.weights(model), _reference("adam", 0, size), atol=2e-6)
