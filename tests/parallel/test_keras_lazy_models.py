"""Models built every way Keras allows, with wrap() and both callbacks, under mpirun.

Keras 3 on TensorFlow builds a model without an Input (a Sequential of bare layers, most
subclassed models) only when the first training step is traced. The broadcast must still
happen before that step, so N ranks x batch B still train exactly like one process with
batch N*B from the root's initial weights.
"""

import warnings

import numpy as np
import pytest

import keras
import tensorflow as tf

import keras_ring
from keras_ring.callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback

from tests.parallel import keras_support as ks

BATCH, STEPS, EPOCHS = 4, 5, 2


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(ks.CLASSES)

    def call(self, x):
        return self.out(self.hidden(x))


def build(kind: str, seed: int) -> keras.Model:
    """A model whose initial weights depend only on ``seed``, built (or not) as ``kind`` says."""
    keras.utils.set_random_seed(seed)
    if kind == "sequential_without_input":
        return keras.Sequential([keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(ks.CLASSES)])
    if kind == "subclassed":
        return Subclassed()
    if kind == "functional":
        inputs = keras.Input((ks.FEATURES,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        return keras.Model(inputs, keras.layers.Dense(ks.CLASSES)(hidden))
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(ks.CLASSES)])
    model.build((None, ks.FEATURES))  # "built_by_hand"
    return model


KINDS = ["sequential_without_input", "subclassed", "functional", "built_by_hand"]


def _reference(kind: str, root: int, size: int, x, y) -> list:
    """Plain Keras, one process: the root's initial model on batches of size*BATCH."""
    model = build(kind, ks.rank_seed(root))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=ks.loss())
    model.fit(x, y, batch_size=size * BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return ks.weights(model)


@pytest.mark.parametrize("kind", KINDS)
def test_every_way_of_building_trains_like_one_process(world, kind):
    rank, size = world
    root = size - 1
    x, y = ks.classification_data(size * BATCH * STEPS, seed=7)
    model = build(kind, ks.rank_seed(rank))  # every rank starts from other weights
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.Adam(0.01)), loss=ks.loss(),
                  metrics=["accuracy"])
    history = model.fit(ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH),
                        batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[BroadcastGlobalVariablesCallback(root),
                                   MetricAverageCallback()])
    assert len(history.history["accuracy"]) == EPOCHS
    ks.assert_weights_close(ks.weights(model), _reference(kind, root, size, x, y), atol=2e-6)
    ks.assert_same_on_all_ranks(ks.weights(model))


class _Batches(keras.utils.PyDataset):
    """The rank's batches, read ahead by worker threads (which keep fetching across epochs)."""

    def __init__(self, x, y, workers: int):
        super().__init__(workers=workers, use_multiprocessing=False)
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, i):
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


def _source(source: str, x, y):
    """The rank's data as ``fit`` takes it, and the keyword arguments that go with it."""
    if source == "tf_data":
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), {}
    if source == "generator":
        def batches():
            while True:
                yield from (_Batches(x, y, 1)[i] for i in range(STEPS))
        return batches(), {"steps_per_epoch": STEPS}
    return _Batches(x, y, workers=2 if source == "py_dataset_workers" else 1), {}


@pytest.mark.parametrize("source", ["tf_data", "generator", "py_dataset", "py_dataset_workers"])
def test_a_lazily_built_model_trains_on_every_batch_of_every_input(world, source):
    # Building the model before its first step must not take a batch away from training: a
    # PyDataset with workers keeps its read-ahead across the epoch's reset, so a batch taken
    # for the build left every epoch one batch behind (silently different weights).
    rank, size = world
    x, y = ks.classification_data(size * BATCH * STEPS, seed=7)
    data, kwargs = _source(source, ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH))
    model = build("sequential_without_input", ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.Adam(0.01)), loss=ks.loss())
    model.fit(data, epochs=EPOCHS, shuffle=False, verbose=0, **kwargs,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    ks.assert_weights_close(ks.weights(model), _reference("sequential_without_input", 0, size,
                                                           x, y), atol=2e-6)


def test_a_model_that_cannot_be_built_yet_gets_an_error_that_says_what_to_do(world):
    # Broadcasting by hand before anything built the model: nothing to broadcast yet.
    model = build("sequential_without_input", 1)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=ks.loss())
    with pytest.raises(ValueError, match=r"not built yet.*model\.build\("):
        keras_ring.callbacks.broadcast_model(model, 0)
    assert not model.optimizer.built  # and nothing was built on an empty variable list


@pytest.mark.parametrize("built_by", ["nothing", "default_build"])
def test_a_subclassed_model_without_a_build_is_told_to_run_on_a_batch(world, built_by):
    # Keras's default build() of a subclassed model marks it built without running call():
    # "model.build(input_shape)" was advice that led to a second error, which said call()
    # never reaches the layers (probe P: Horovod's custom train_step with a tape).
    model = Subclassed()
    if built_by == "default_build":
        with warnings.catch_warnings():  # Keras warns that the build builds nothing
            warnings.simplefilter("ignore")
            model.build((None, ks.FEATURES))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=ks.loss())
    expected = {"nothing": r"not built yet.*call it on one batch \(model\(x\[:1\]\)\)",
                "default_build": r"built by Keras's default build\(\), which marks a "
                                 r"subclassed model built without running its call\(\)"}
    with pytest.raises(ValueError, match=expected[built_by]) as caught:
        keras_ring.callbacks.broadcast_model(model, 0)
    assert "model.build(input_shape)" not in str(caught.value)
    model(np.zeros((1, ks.FEATURES), "float32"))  # the advice works
    keras_ring.callbacks.broadcast_model(model, 0)


class WithUnusedLayer(Subclassed):
    """A layer its call() never reaches (an option switched off): fit builds the model, and
    that layer stays without variables."""

    def __init__(self):
        super().__init__()
        self.unused = keras.layers.Dense(4)


def test_a_layer_the_model_never_runs_is_named_as_such_not_as_unbuilt(world):
    # The model was built (by fit, through wrap), so "build it first" was wrong advice.
    # Broadcasting without it is no way out: a custom train_step that builds it later would
    # leave each rank its own initial values there, after the weight check settled.
    rank, size = world
    x, y = ks.classification_data(size * BATCH * STEPS, seed=7)
    model = WithUnusedLayer()
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss())
    with pytest.raises(ValueError, match=r"layer 'dense_\d+' did not run when the model was "
                                         r"built.*call\(\) never reaches it.*remove it"):
        model.fit(ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH),
                  batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[BroadcastGlobalVariablesCallback(0)])
    assert model.built and not model.unused.built
