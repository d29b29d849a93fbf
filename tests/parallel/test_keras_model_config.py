"""Ranks whose models have weights of the same shapes but compute different things (another
checkpoint loaded on one rank, another activation, a weightless layer more, another dtype
policy) must fail on every rank as fit begins, naming the layer and the setting; what one
program may differ in by rank (names, seeds, batch sizes) must not (keras_ring._model_config).
"""

import numpy as np
import pytest

import keras
import keras_ring
from keras_ring.callbacks import BroadcastGlobalVariablesCallback

from tests.parallel import keras_support as ks


def _model(activation: str = "relu", dropout: bool = False, policy: str | None = None,
           seed: int | None = None, names: str = "") -> keras.Model:
    init = keras.initializers.GlorotUniform(seed=seed)
    layers = [keras.Input((4,)),
              keras.layers.Dense(8, activation=activation, kernel_initializer=init,
                                 dtype=policy, name=f"{names}hidden" if names else None)]
    if dropout:
        layers.append(keras.layers.Dropout(0.25, seed=seed))
    layers.append(keras.layers.Dense(2, kernel_initializer=init, dtype=policy,
                                     name=f"{names}out" if names else None))
    model = keras.Sequential(layers, name=f"{names}model" if names else None)
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    return model


def _fit(model: keras.Model, rank: int) -> None:
    rng = np.random.default_rng(rank)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 2)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])


@pytest.mark.parametrize("odd, expected", [
    ({"activation": "tanh"}, r"'net_hidden' on rank 0 and 'net_hidden' on rank \d+: activation: "
                             r"rank 0 'relu', rank \d+ 'tanh'"),
    ({"dropout": True}, r"layer 3 of Keras's walk .* 'net_out' on rank 0 and 'dropout.*' on rank "
                        r"\d+: class: rank 0 '.*Dense', rank \d+ '.*Dropout'"),
    ({"policy": "mixed_bfloat16"}, r"dtype policy: rank 0 'float32', rank \d+ "
                                   r"'mixed_bfloat16'"),
])
def test_same_weights_but_another_model_on_one_rank_fails_every_rank(world, odd, expected):
    rank, size = world
    model = _model(**(odd if rank == size - 1 else {}), names="net_")
    with pytest.raises(keras_ring.WeightMismatchError, match=expected) as caught:
        _fit(model, rank)
    assert "are built differently as fit begins" in str(caught.value)
    assert caught.value.rank == size - 1


def test_names_seeds_lambdas_files_and_the_order_models_were_made_in_may_differ(world):
    rank, size = world
    for _ in range(rank):  # Keras numbers names as layers are made: they differ by rank
        keras.layers.Dense(1)
    model = _model(dropout=True, seed=rank)
    # The program's file at another path on each host: a Lambda's code holds the path.
    double = eval(compile("lambda x: x * 2.0", f"/host{rank}/train.py", "eval"))
    model = keras.Sequential([*model.layers, keras.layers.Lambda(double)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    assert ks.weights(model)[0].shape == (4, 8)
    _fit(model, rank)
    ks.assert_same_on_all_ranks(ks.weights(model))


class Tagged(keras.layers.Layer):
    """A layer of the program's own, made with the rank's own values: its class and dtype
    policy are compared, not its constructor's arguments."""

    def __init__(self, rank, log_dir, **kwargs):
        super().__init__(**kwargs)
        self.rank, self.log_dir = rank, log_dir

    def call(self, x):
        return x


def test_the_programs_own_layers_and_lambdas_may_hold_the_ranks_own_values(world):
    rank, size = world
    scale = {"factor": 2.0, "log_dir": f"/tmp/rank{rank}"}  # an argparse Namespace, say
    model = keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8), Tagged(rank, f"/tmp/rank{rank}"),
        keras.layers.Lambda(lambda t: t * scale["factor"]),
        keras.layers.Masking(mask_value=float("nan")),  # a setting not equal to itself
        keras.layers.Dense(2)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    _fit(model, rank)
    ks.assert_same_on_all_ranks(ks.weights(model))


class Residual(keras.Model):
    """A subclassed model: Keras cannot write its configuration (get_config raises)."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.inner = keras.layers.Dense(4)

    def call(self, x):
        return x + self.scale * self.inner(x)


def test_a_subclassed_model_without_a_config_trains():
    rank = keras_ring.rank()
    model = Residual(np.float32(0.5))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(16, 4)).astype("float32")
    model.fit(x, x, batch_size=8, epochs=1, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    ks.assert_same_on_all_ranks(ks.weights(model))
