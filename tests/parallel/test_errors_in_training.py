"""Errors raised inside training code are keras_ring's classes, with their attributes.

TensorFlow raises an op's error where the graph runs (``fit``, ``train_on_batch``,
``predict``, any ``tf.function``), and its function runtime replaces some codes
(UnavailableError becomes InternalError). keras_ring's errors there must still be
``CollectiveMismatchError`` & co., subclasses of the matching ``tf.errors`` class, with
``collective``, ``rank`` and ``reason``. A shape that differs on the last rank makes a
collective fail on every rank without breaking the runtime, so each case runs here.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring as kr
from keras_ring import errors
from keras_ring.callbacks import BroadcastGlobalVariablesCallback


def _width(rank: int, size: int) -> int:
    return 5 if rank == size - 1 else 4  # the last rank diverges


def _check(error: Exception, size: int) -> None:
    assert isinstance(error, kr.CollectiveMismatchError), type(error)
    # The attributes come from the core's own structure of the error, not from its text.
    info = errors.error_info(str(error))
    assert info is not None and info.rank == size - 1, (info, str(error))
    assert info.collective == error.collective and info.reason == error.reason
    assert isinstance(error, tf.errors.FailedPreconditionError)
    assert error.rank == size - 1, (error.rank, str(error))
    assert error.collective is not None and "mismatch" in error.reason, error.reason
    # Still usable afterwards.
    assert kr.allreduce(tf.constant([1.0]), op=kr.Sum).numpy()[0] == size


def test_in_a_tf_function(world):
    rank, size = world

    @tf.function
    def step(x):
        return kr.allreduce(x, name="in_graph") * 2.0

    with pytest.raises(tf.errors.OpError) as info:
        step(tf.ones([_width(rank, size)]))
    _check(info.value, size)


class RankShapedStatistic(keras.layers.Layer):
    """Allreduces a statistic whose shape differs on the last rank (the program's bug; the
    models' weights and configurations agree, so fit's own checks have nothing to say
    first: the width is the rank's, not the layer's)."""

    def call(self, x):
        width = _width(kr.rank(), kr.size())
        return x + 0.0 * tf.reduce_sum(kr.allreduce(tf.ones([width]), name="statistic"))


def _model(rank: int, size: int) -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              RankShapedStatistic()])
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    return model


def test_in_fit_and_train_on_batch(world):
    rank, size = world
    model = _model(rank, size)
    x = np.ones((8, 3), "float32")
    y = np.ones((8, 4), "float32")
    with pytest.raises(tf.errors.OpError) as info:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    _check(info.value, size)
    with pytest.raises(tf.errors.OpError) as info:
        model.train_on_batch(x, y)
    _check(info.value, size)


class AllreduceLayer(keras.layers.Layer):
    """A layer that averages its input over the ranks (like a synchronized statistic)."""

    def call(self, x):
        return kr.allreduce(x, name="layer_stat")


def test_in_predict(world):
    rank, size = world
    model = keras.Sequential([keras.Input((_width(rank, size),)), AllreduceLayer()])
    with pytest.raises(tf.errors.OpError) as info:
        model.predict(np.ones((2, _width(rank, size)), "float32"), verbose=0)
    _check(info.value, size)


def test_early_stopping_on_one_ranks_own_metric_is_named_at_the_epochs_end(world):
    # EarlyStopping without MetricAverageCallback stops the last rank after its second epoch
    # while the others go on: its fit's last rate check meets their next epoch's, a name
    # mismatch, which said only "uneven data shards" (pointing the wrong way).
    rank, size = world
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.01)), loss="mse")
    # The loss falls every epoch; the last rank waits for it to rise, so it stops as soon
    # as Keras lets it (epoch 1).
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0,
                                         mode="max" if rank == size - 1 else "min")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    with pytest.raises(kr.CollectiveMismatchError) as info:
        model.fit(x, y, batch_size=4, epochs=4, verbose=0,
                  callbacks=[BroadcastGlobalVariablesCallback(0), stop])
    message = str(info.value)
    assert "name mismatch" in message and "'keras_ring.rate_check.train_end'" in message, message
    assert "The fit ended on some ranks only" in message and "EarlyStopping" in message, message
    assert kr.allreduce(tf.constant([1.0]), op=kr.Sum).numpy()[0] == size  # still usable


class _StopMidEpoch(keras.callbacks.Callback):
    """TerminateOnNaN's move (stop_training after a batch) on the last rank only."""

    def on_train_batch_end(self, batch, logs=None):
        self.model.stop_training = True


@pytest.mark.parametrize("cause", ["stopped mid-epoch", "validation on rank 0 only"])
def test_metric_averaging_met_by_another_collective_names_the_likely_cause(world, cause):
    # The mismatch named MetricAverage[...] with only the uneven-shards advice.
    rank, size = world
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    callbacks = [BroadcastGlobalVariablesCallback(0), kr.callbacks.MetricAverageCallback()]
    extra = {}
    if cause == "stopped mid-epoch" and rank == size - 1:
        callbacks.append(_StopMidEpoch())
    if cause == "validation on rank 0 only" and rank == 0:
        extra["validation_data"] = (x, y)
    with pytest.raises(kr.CollectiveMismatchError) as info:
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=callbacks, **extra)
    message = str(info.value)
    assert "'MetricAverage[" in message, message
    if cause == "stopped mid-epoch":
        assert "operation mismatch" in message, message
        assert "An epoch ended on some ranks while the others went on training" in message
        assert "TerminateOnNaN" in message, message
    else:
        assert "name mismatch" in message, message
        assert "validation data (or validation_freq, validation_split) given on some ranks only" in message
    assert kr.allreduce(tf.constant([1.0]), op=kr.Sum).numpy()[0] == size  # still usable
