"""Ranks that train different weights of one model (a layer frozen on some ranks only) fail
on every rank, naming the weights, in fit and in custom loops.

With two layers of equal shape frozen crosswise (rank 0 freezes one, rank 1 the other), the
counts of trainable weights agree and so did everything compared before: each rank trained
its own layer with the other rank's gradients averaged in, and the ranks ended apart with
no error, even with the broadcast callback (equal initial values, an identity initialiser,
left nothing else to tell them apart).
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring as kr
from keras_ring.callbacks import BroadcastGlobalVariablesCallback
from keras_ring.errors import WeightMismatchError

from tests.parallel import keras_support as ks

BATCH = 4


def _twin_layers(*frozen: str) -> keras.Model:
    """Two hidden layers of equal shape and equal (identity) initial values; the layers
    named ``frozen`` are frozen."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((ks.FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh", name="d1")(inputs)
    for name in ("d2", "d3"):
        hidden = keras.layers.Dense(8, activation="tanh", kernel_initializer="identity",
                                    name=name)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(ks.CLASSES, name="out")(hidden))
    for name in frozen:
        model.get_layer(name).trainable = False
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss())
    return model


def _fit(model, rank, size, callbacks=()):
    x, y = ks.classification_data(size * 2 * BATCH, seed=3)
    model.fit(ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH), batch_size=BATCH,
              epochs=1, verbose=0, callbacks=list(callbacks))


def _step(model, optimizer, path="tape"):
    """A custom loop's step (as Horovod's examples write it) over the model's trainable
    variables, reduced by a DistributedGradientTape (``path="tape"``) or by the optimizer."""
    loss_fn = ks.loss()

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if path == "tape":
            tape = kr.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


CROSSWISE = ("rank 0 trains 6 weights, rank 1 trains 6; only rank 0 trains 'd3/kernel', "
             "'d3/bias'; only rank 1 trains 'd2/kernel', 'd2/bias'")


def test_layers_frozen_crosswise_are_named_by_the_broadcast(world):
    rank, size = world
    model = _twin_layers("d3" if rank == 1 else "d2")
    with pytest.raises(ValueError) as info:
        _fit(model, rank, size, [BroadcastGlobalVariablesCallback(0)])
    message = str(info.value)
    assert f"the ranks train different sets of its weights ({CROSSWISE})" in message, message
    assert "frozen (trainable=False) on some ranks only" in message


def test_layers_frozen_crosswise_fail_before_the_first_step_without_a_broadcast(world):
    rank, size = world
    model = _twin_layers("d3" if rank == 1 else "d2")
    before = ks.weights(model)
    with pytest.raises(WeightMismatchError) as info:
        _fit(model, rank, size)
    message = str(info.value)
    assert f"at the start of training model '{model.name}', the ranks train different " \
           f"weights ({CROSSWISE})" in message, message
    assert info.value.rank == 1 and info.value.layout
    ks.assert_weights_close(ks.weights(model), before, atol=0)  # no step ran


def test_a_layer_frozen_on_one_rank_only_is_named_not_blamed_on_the_data(world):
    # Before, the fingerprints' allgather failed on its shapes: "uneven data shards".
    rank, size = world
    model = _twin_layers("d2", *(["d1"] if rank == 1 else []))
    with pytest.raises(WeightMismatchError) as info:
        _fit(model, rank, size)
    message = str(info.value)
    assert ("the ranks train different weights (rank 0 trains 6 weights, rank 1 trains 4; "
            "only rank 0 trains 'd1/kernel', 'd1/bias'). Their averaged") in message, message


def test_a_layer_frozen_on_one_rank_between_fits_fails_the_next_fit(world):
    rank, size = world
    model = _twin_layers("d2")
    _fit(model, rank, size, [BroadcastGlobalVariablesCallback(0)])
    if rank == 1:  # keras-io's fine-tuning step, taken on one rank only
        model.get_layer("d1").trainable = False
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.01)), loss=ks.loss())
    with pytest.raises(WeightMismatchError) as info:
        _fit(model, rank, size)
    message = str(info.value)
    assert "as a later fit of model" in message, message
    assert "rank 0 trains 6 weights, rank 1 trains 4; only rank 0 trains 'd1/kernel', " \
           "'d1/bias'" in message, message


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("path", ["tape", "optimizer"])
def test_a_custom_loop_whose_ranks_pass_different_variables_fails_on_every_rank(
        world, path, traced):
    rank, size = world
    model = _twin_layers("d1" if rank == 1 else "d2")
    kr.broadcast_variables(model.variables, root_rank=0)
    optimizer = model.optimizer if path == "optimizer" else keras.optimizers.SGD(0.1)
    step = _step(model, optimizer, path)
    x, y = ks.classification_data(BATCH, seed=rank)
    before = ks.weights(model)
    with pytest.raises(WeightMismatchError) as info:
        (tf.function(step) if traced else step)(x, y)
    # A list of variables tells their dtypes and shapes, not which layer they belong to.
    mine = "d2/kernel" if rank == 1 else "d1/kernel"
    assert f"the ranks train different weights (variable 0 ('{mine}' on this rank) has " \
           "another dtype or shape on rank 1 than on rank 0)" in str(info.value), info.value
    assert info.value.rank == 1
    ks.assert_weights_close(ks.weights(model), before, atol=0)


@pytest.mark.parametrize("frozen_on", [0, 1], ids=["rank-0", "rank-1"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_layer_frozen_on_one_rank_in_a_settled_custom_loop_is_named_as_the_cause(
        world, traced, frozen_on):
    # Only the rank whose list of variables is new compares weights; the others reduce.
    # Every rank gets the mismatch, which now says why the ranks parted.
    rank, size = world
    model = _twin_layers("d2")
    kr.broadcast_variables(model.variables, root_rank=0)
    step = _step(model, keras.optimizers.SGD(0.1))
    x, y = ks.classification_data(BATCH, seed=rank)
    (tf.function(step) if traced else step)(x, y)
    if rank == frozen_on:
        model.get_layer("d1").trainable = False
    with pytest.raises(kr.CollectiveMismatchError) as info:
        (tf.function(step) if traced else step)(x, y)
    assert "allgather 'keras_ring.weight_check'" in str(info.value)
    assert "the ranks' lists differ (a layer frozen or unfrozen on some ranks only" \
           in info.value.reason, info.value.reason


def test_ranks_that_built_different_models_are_told_so_on_every_rank(world):
    # Rank 1's model has one more layer: its places in model.weights index nothing on rank 0
    # (an IndexError there), and its extra weights were blamed on trainable flags.
    rank, size = world
    keras.utils.set_random_seed(7)
    layers = [keras.Input((ks.FEATURES,)), keras.layers.Dense(8, name="d1")]
    if rank == 1:
        layers.append(keras.layers.Dense(8, name="extra"))
    model = keras.Sequential(layers + [keras.layers.Dense(ks.CLASSES, name="out")])
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss())
    with pytest.raises(WeightMismatchError) as info:
        _fit(model, rank, size)
    assert "the ranks built different models: rank 0's has 4 weights, rank 1's 6" \
        in str(info.value), info.value
    model = _twin_layers("d2") if rank != 1 else model
    with pytest.raises(ValueError, match=r"the ranks built different models \(rank 0's has 8 "
                                         r"weights, rank 1's 6\)"):
        _fit(model, rank, size, [BroadcastGlobalVariablesCallback(0)])


@pytest.mark.parametrize("path", ["tape", "optimizer"])
def test_a_rank_that_traces_its_step_again_while_the_check_is_open_compares_alike(world, path):
    # Horovod's examples broadcast after the first step, so the step's graph compares at its
    # second call; a rank whose second batch is shorter traces again and compares eagerly.
    # The two comparisons once sent rows of different shapes: a mismatch on every rank.
    rank, size = world
    keras.utils.set_random_seed(rank)  # apart until the broadcast
    model = keras.Sequential([keras.Input((ks.FEATURES,)), keras.layers.Dense(ks.CLASSES)])
    optimizer = kr.wrap(keras.optimizers.SGD(0.1)) if path == "optimizer" else \
        keras.optimizers.SGD(0.1)
    step = tf.function(_step(model, optimizer, path))

    x, y = ks.classification_data(2 * BATCH, seed=rank)
    step(x[:BATCH], y[:BATCH])
    kr.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
    last = BATCH // 2 if rank == size - 1 else BATCH
    step(x[BATCH:BATCH + last], y[BATCH:BATCH + last])
    step(x[:BATCH], y[:BATCH])
    ks.assert_same_on_all_ranks(ks.weights(model))


def test_a_custom_loop_with_fewer_variables_on_the_last_rank_fails_on_every_rank(world):
    rank, size = world
    model = _twin_layers()
    kr.broadcast_variables(model.variables, root_rank=0)
    variables = model.trainable_variables[1:] if rank == size - 1 else model.trainable_variables
    x, y = ks.classification_data(BATCH, seed=rank)
    with tf.GradientTape() as tape:
        loss = ks.loss()(y, model(x, training=True))
    with pytest.raises(WeightMismatchError) as info:
        kr.DistributedGradientTape(tape).gradient(loss, variables)
    assert f"rank 0 passes 8 variables, rank {size - 1} passes 7" in str(info.value), info.value


def test_ranks_whose_layers_differ_in_shape_only_are_told_so(world):
    # Equal counts of weights, tagged by place alone, once looked alike.
    rank, size = world
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((ks.FEATURES,)),
                              keras.layers.Dense(9 if rank == 1 else 8),
                              keras.layers.Dense(ks.CLASSES)])
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss())
    with pytest.raises(WeightMismatchError, match="the ranks built different models: rank 0's "
                                                  "has 4 weights, rank 1's 4, of other dtypes "
                                                  "or shapes"):
        _fit(model, rank, size)
    # Through the broadcast callback: the weight and both shapes (its counts looked equal,
    # probe F: "rank 0: 4 model weights, ...; rank 1: 4 model weights, ...").
    with pytest.raises(ValueError, match=r"the ranks built different models \(weight 0 "
                                         r"\('.*kernel'\): rank 0 \(6, 8\) float32, rank 1 "
                                         r"\(6, 9\) float32\)"):
        _fit(model, rank, size, [BroadcastGlobalVariablesCallback(0)])
