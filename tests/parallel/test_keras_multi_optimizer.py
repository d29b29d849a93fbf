"""keras.optimizers.MultiOptimizer (Keras 3.13 and later) under mpirun: wrapped whole (Horovod's
DistributedOptimizer(MultiOptimizer(...))) or made of wrapped sub-optimizers."""

import numpy as np
import pytest

import keras
import keras_ring
from keras_ring.callbacks import BroadcastGlobalVariablesCallback, LearningRateWarmupCallback

from tests.parallel import keras_support as ks

pytestmark = pytest.mark.skipif(not hasattr(keras.optimizers, "MultiOptimizer"),
                                reason="this Keras has no MultiOptimizer (it came in 3.13)")

BATCH = 4


def _multi(wrap_parts: bool):
    """The output layer's variables by SGD, the hidden layer's by Adam."""
    adam, sgd = keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1, momentum=0.5)
    if wrap_parts:
        adam, sgd = keras_ring.wrap(adam), keras_ring.wrap(sgd)
    return keras.optimizers.MultiOptimizer(
        lambda v: sgd if v.shape[-1] == ks.CLASSES else adam)


def _data(size: int):
    return ks.classification_data(size * BATCH * 4, seed=11)


def _fit(optimizer, rank, size, x, y, callbacks=(), epochs=2, model=None):
    model = model or ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=optimizer, loss=ks.loss())
    model.fit(ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH), batch_size=BATCH,
              epochs=epochs, shuffle=False, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0), *callbacks])
    return model


@pytest.mark.parametrize("how", ["wrapped whole", "of wrapped parts"])
def test_a_multi_optimizer_trains_as_one_process_on_the_global_batch(world, how):
    # Wrapped whole, the rate check read the MultiOptimizer's learning rate, which Keras
    # refuses (AttributeError as fit began); made of wrapped parts, the broadcast callback
    # refused the model as one whose optimizer is not wrapped.
    rank, size = world
    x, y = _data(size)
    optimizer = keras_ring.wrap(_multi(False)) if how == "wrapped whole" else _multi(True)
    model = _fit(optimizer, rank, size, x, y)
    reference = ks.mlp(ks.rank_seed(0))
    reference.compile(optimizer=_multi(False), loss=ks.loss())
    reference.fit(x, y, batch_size=BATCH * size, epochs=2, shuffle=False, verbose=0)
    ks.assert_weights_close(ks.weights(model), ks.weights(reference), atol=1e-5)
    ks.assert_same_on_all_ranks(ks.weights(model))
    # Both sub-optimizers took part: each counted every update.
    assert [int(o.iterations.numpy()) for o in model.optimizer.optimizers] == [8, 8]


def test_a_multi_optimizer_given_a_map_trains_alike_on_every_rank(world):
    # An OptimizerMap names its sub-optimizers before it is built, a function only after.
    rank, size = world
    x, y = _data(size)
    model = ks.mlp(ks.rank_seed(rank))
    table = keras.optimizers.OptimizerMap(default_optimizer=keras.optimizers.Adam(0.01))
    table[f"(.*/)?{model.layers[-1].name}/.*"] = keras.optimizers.SGD(0.1)
    _fit(keras_ring.wrap(keras.optimizers.MultiOptimizer(table)), rank, size, x, y, epochs=1,
         model=model)
    ks.assert_same_on_all_ranks(ks.weights(model))
    assert [int(o.iterations.numpy()) for o in model.optimizer.optimizers] == [4, 4]


@pytest.mark.parametrize("how", ["wrapped whole", "of wrapped parts"])
def test_a_sub_optimizers_rate_set_on_one_rank_fails_on_every_rank(world, how):
    rank, size = world
    x, y = _data(size)

    class SlowerOnLastRank(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1 and rank == size - 1:
                self.model.optimizer.optimizers[1].learning_rate = 0.05

    optimizer = keras_ring.wrap(_multi(False)) if how == "wrapped whole" else _multi(True)
    with pytest.raises(keras_ring.LearningRateMismatchError) as info:
        _fit(optimizer, rank, size, x, y, callbacks=[SlowerOnLastRank()])
    assert "as epoch 1 begins" in str(info.value)
    assert f"rank {size - 1} " in str(info.value) and "0.05" in str(info.value)


def test_a_multi_optimizer_of_wrapped_and_plain_parts_is_refused_naming_the_plain_one(world):
    rank, size = world
    x, y = _data(size)
    adam, sgd = keras_ring.wrap(keras.optimizers.Adam(0.01)), keras.optimizers.SGD(0.1)
    optimizer = keras.optimizers.MultiOptimizer(
        lambda v: sgd if v.shape[-1] == ks.CLASSES else adam)
    with pytest.raises(ValueError, match=r"optimizer\.optimizers\[1\]: SGD") as info:
        _fit(optimizer, rank, size, x, y, epochs=1)
    assert "train apart" in str(info.value)


def test_a_learning_rate_callback_on_a_multi_optimizer_says_to_schedule_each_part(world):
    rank, size = world
    x, y = _data(size)
    with pytest.raises(ValueError, match="MultiOptimizer, whose sub-optimizers") as info:
        _fit(keras_ring.wrap(_multi(False)), rank, size, x, y, epochs=1,
             callbacks=[LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1)])
    assert "Give each sub-optimizer its own schedule" in str(info.value)


@pytest.mark.parametrize("how", ["wrapped whole", "of wrapped parts"])
def test_a_multi_optimizer_under_mixed_float16(world, how):
    # Keras puts a LossScaleOptimizer around it: wrapped whole, that one communicates (every
    # rank skips the same steps); around wrapped parts each rank would check its own
    # gradients, so that is refused, saying what to do.
    rank, size = world
    x, y = _data(size)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        if how == "of wrapped parts":
            with pytest.raises(ValueError, match=r"Wrap the MultiOptimizer instead"):
                _fit(_multi(True), rank, size, x, y, epochs=1)
            return
        model = _fit(keras_ring.wrap(_multi(False)), rank, size, x, y, epochs=1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert keras_ring.optimizer.is_wrapped(model.optimizer)
    ks.assert_same_on_all_ranks(ks.weights(model) + [model.optimizer.dynamic_scale.numpy()])
    assert np.isfinite(np.concatenate([w.ravel() for w in ks.weights(model)])).all()


class TwoOptimizerModel(keras.Model):
    """keras-io's GAN shape: its own train_step applies an optimizer it holds to each part,
    one of them a MultiOptimizer given a function (of wrapped optimizers)."""

    def __init__(self, first_optimizer, second_optimizer):
        super().__init__()
        self.first = keras.layers.Dense(8, activation="tanh")
        self.second = keras.layers.Dense(ks.CLASSES)
        self.first_optimizer, self.second_optimizer = first_optimizer, second_optimizer
        self.loss_fn = ks.loss()

    def call(self, x):
        return self.second(self.first(x))

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self(x))
        first, second = self.first.trainable_variables, self.second.trainable_variables
        grads = tape.gradient(loss, first + second)
        self.first_optimizer.apply(grads[:len(first)], first)
        self.second_optimizer.apply(grads[len(first):], second)
        return {"loss": loss}


def test_a_multi_optimizer_a_model_applies_to_some_of_its_variables_is_left_to_build(world):
    # Asked which optimizers train the model, keras_ring built such a MultiOptimizer on all
    # of the model's variables, and its apply to the first layer's alone failed ("Gradients
    # must match trainable variables one-to-one").
    rank, size = world
    x, y = _data(size)
    kernel, bias = keras_ring.wrap(keras.optimizers.SGD(0.1)), keras_ring.wrap(
        keras.optimizers.Adam(0.01))
    keras.utils.set_random_seed(ks.rank_seed(rank))
    model = TwoOptimizerModel(
        keras.optimizers.MultiOptimizer(lambda v: kernel if len(v.shape) == 2 else bias),
        keras_ring.wrap(keras.optimizers.SGD(0.1)))
    model(x[:1])
    model.compile()
    model.fit(ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH), batch_size=BATCH,
              epochs=1, shuffle=False, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    ks.assert_same_on_all_ranks(ks.weights(model))
    assert [int(o.iterations.numpy()) for o in (kernel, bias)] == [4, 4]


def test_an_unbuilt_multi_optimizer_beside_its_wrapped_parts_trains(world):
    # A model built only by its first step, compiled with a MultiOptimizer given a function
    # and holding its wrapped parts as attributes: the MultiOptimizer, not built yet, counted
    # as an unwrapped optimizer beside wrapped ones, and fit was refused.
    rank, size = world
    x, y = _data(size)
    adam, sgd = keras_ring.wrap(keras.optimizers.Adam(0.01)), keras_ring.wrap(
        keras.optimizers.SGD(0.1))

    class Lazy(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden, self.out = keras.layers.Dense(8), keras.layers.Dense(ks.CLASSES)
            self.parts = [adam, sgd]

        def call(self, x):
            return self.out(self.hidden(x))

    keras.utils.set_random_seed(ks.rank_seed(rank))
    model = Lazy()
    _fit(keras.optimizers.MultiOptimizer(lambda v: sgd if v.shape[-1] == ks.CLASSES else adam),
         rank, size, x, y, epochs=1, model=model)
    ks.assert_same_on_all_ranks(ks.weights(model))


def test_loss_scaling_around_wrapped_parts_in_a_custom_loop_is_refused(world):
    # Outside fit nothing asked: each rank's LossScaleOptimizer checked its own gradients,
    # and ranks that skipped different steps paired their parts' collectives across steps.
    rank, size = world
    model = ks.mlp(ks.rank_seed(0))
    optimizer = keras.optimizers.LossScaleOptimizer(_multi(True))
    grads = [keras.ops.ones_like(v) for v in model.trainable_variables]
    with pytest.raises(ValueError, match=r"LossScaleOptimizer '.*' is a LossScaleOptimizer "
                                         r".*Wrap the MultiOptimizer instead"):
        optimizer.apply(grads, model.trainable_variables)
