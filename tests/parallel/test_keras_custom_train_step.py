"""Models written the way keras-io writes them: a Model subclass that overrides ``train_step``
(and often has no ``call``, as the VAE and GAN examples), optimizers kept as attributes; and
the random-seed states that Keras keeps among a model's variables, which the broadcasts
leave to each rank.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring as kr
from keras_ring.callbacks import BroadcastGlobalVariablesCallback
from keras_ring.errors import WeightMismatchError

from tests.parallel import keras_support as ks
from tests.parallel.test_keras_optimizer import CollectiveLog

BATCH = 4


class Regressor(keras.Model):
    """No ``call``: ``train_step`` runs the inner model and applies ``self.optimizer``, as
    keras-io's VAE does (Keras never builds such a model; its ``built`` stays False)."""

    def __init__(self, inner: keras.Model):
        super().__init__()
        self.inner = inner
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = ks.loss()(y, self.inner(x, training=True))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


class TwoOptimizers(keras.Model):
    """keras-io's GAN shape: ``compile`` takes its own optimizers and calls the base one with
    none; ``train_step`` updates two sub-models with one each."""

    def __init__(self, first: keras.Model, second: keras.Model):
        super().__init__()
        self.first, self.second = first, second

    def compile(self, first_optimizer, second_optimizer):
        super().compile()
        self.first_optimizer, self.second_optimizer = first_optimizer, second_optimizer

    def train_step(self, data):
        x, y = data
        logs = {}
        for model, optimizer in ((self.first, self.first_optimizer),
                                 (self.second, self.second_optimizer)):
            with tf.GradientTape() as tape:
                loss = ks.loss()(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_weights)
            optimizer.apply_gradients(zip(grads, model.trainable_weights))
            logs[f"{model.name}_loss"] = loss
        return logs


class HeldInAList(TwoOptimizers):
    """The same, its optimizers kept in a list attribute."""

    def compile(self, first_optimizer, second_optimizer):
        keras.Model.compile(self)
        self.optimizers = [first_optimizer, second_optimizer]

    first_optimizer = property(lambda self: self.optimizers[0])
    second_optimizer = property(lambda self: self.optimizers[1])


class HeldInADict(TwoOptimizers):
    """The same, its optimizers kept in a dict attribute."""

    def compile(self, first_optimizer, second_optimizer):
        keras.Model.compile(self)
        self.optimizers = {"first": first_optimizer, "second": second_optimizer}

    first_optimizer = property(lambda self: self.optimizers["first"])
    second_optimizer = property(lambda self: self.optimizers["second"])


# How each of those names its optimizers in errors.
HOLDERS = {TwoOptimizers: ("first_optimizer", "second_optimizer"),
           HeldInAList: (r"optimizers\[0\]", r"optimizers\[1\]"),
           HeldInADict: (r"optimizers\['first'\]", r"optimizers\['second'\]")}


class OptimizerSetAfterCompile(Regressor):
    """keras-io's VAE compile: the base compile() with no optimizer, then ``self.optimizer``."""

    def compile(self, optimizer):
        super().compile()
        self.optimizer = optimizer


def _shards(rank: int, size: int, steps: int = 3):
    x, y = ks.classification_data(size * BATCH * steps, seed=11)
    return x, y, ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH)


def _fit(model, x, y, broadcast=True):
    callbacks = [BroadcastGlobalVariablesCallback(0)] if broadcast else []
    return model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                     callbacks=callbacks)


def test_a_model_without_call_trains_as_one_process_on_the_global_batch(world):
    rank, size = world
    x, y, my_x, my_y = _shards(rank, size)
    model = Regressor(ks.mlp(ks.rank_seed(rank)))
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.1)))
    _fit(model, my_x, my_y)
    assert not model.built  # Keras's own state for it: nothing here built it behind its back
    reference = ks.mlp(ks.rank_seed(0))
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=ks.loss())
    reference.fit(x, y, batch_size=size * BATCH, epochs=1, shuffle=False, verbose=0)
    ks.assert_weights_close(ks.weights(model.inner), ks.weights(reference), atol=1e-6)
    ks.assert_same_on_all_ranks(ks.weights(model.inner))


def test_a_model_without_call_and_different_weights_fails_on_every_rank(world):
    rank, size = world
    _, _, my_x, my_y = _shards(rank, size)
    model = Regressor(ks.mlp(ks.rank_seed(rank)))
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.1)))
    with pytest.raises(WeightMismatchError, match="model 'regressor"):
        _fit(model, my_x, my_y, broadcast=False)


def test_a_model_without_call_whose_layers_are_not_built_is_named_in_the_error(world):
    rank, size = world
    _, _, my_x, my_y = _shards(rank, size)
    inner = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(ks.CLASSES)],
                             name="lazy_inner")  # no Input: built when it first runs
    model = Regressor(inner)
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.1)))
    with pytest.raises(ValueError, match="its layer 'lazy_inner'.* is not built yet"):
        _fit(model, my_x, my_y)


def test_optimizers_kept_as_attributes_reduce_and_are_checked(world, monkeypatch):
    rank, size = world
    x, y, my_x, my_y = _shards(rank, size)
    log = CollectiveLog(monkeypatch)
    model = TwoOptimizers(ks.mlp(ks.rank_seed(rank)), ks.mlp(ks.rank_seed(rank) + 50))
    model.compile(kr.wrap(keras.optimizers.SGD(0.1), bucket_bytes=None),
                  kr.wrap(keras.optimizers.Adam(0.01), bucket_bytes=None))
    _fit(model, my_x, my_y)
    assert int(log.executed.numpy()) == 2 * 3  # two optimizers, three steps, one bucket each
    expected = []
    for seed, optimizer in ((ks.rank_seed(0), keras.optimizers.SGD(0.1)),
                            (ks.rank_seed(0) + 50, keras.optimizers.Adam(0.01))):
        reference = ks.mlp(seed)
        reference.compile(optimizer=optimizer, loss=ks.loss())
        reference.fit(x, y, batch_size=size * BATCH, epochs=1, shuffle=False, verbose=0)
        expected += ks.weights(reference)
    ks.assert_weights_close(ks.weights(model.first) + ks.weights(model.second), expected,
                            atol=1e-5)
    ks.assert_same_on_all_ranks(ks.weights(model.first) + ks.weights(model.second))

    unsynchronised = TwoOptimizers(ks.mlp(ks.rank_seed(rank)), ks.mlp(ks.rank_seed(rank)))
    unsynchronised.compile(kr.wrap(keras.optimizers.SGD(0.1)), kr.wrap(keras.optimizers.SGD(0.1)))
    with pytest.raises(WeightMismatchError, match="model 'two_optimizers"):
        _fit(unsynchronised, my_x, my_y, broadcast=False)


@pytest.mark.parametrize("holder", HOLDERS, ids=lambda holder: holder.__name__)
def test_optimizers_kept_as_attributes_but_only_some_wrapped_fail_on_every_rank(world, holder):
    # keras-io's GAN with one optimizer left unwrapped: its sub-model trained apart on each
    # rank, silently (the weight check runs before the first step, when all still agree).
    # Kept in a list or dict attribute, they were not looked at.
    rank, size = world
    _, _, my_x, my_y = _shards(rank, size)
    model = holder(ks.mlp(ks.rank_seed(0)), ks.mlp(ks.rank_seed(0) + 50))
    model.compile(kr.wrap(keras.optimizers.SGD(0.1)), keras.optimizers.Adam(0.01))
    first, second = HOLDERS[holder]
    with pytest.raises(ValueError, match=rf"holds optimizers wrapped with keras_ring.wrap "
                       rf"\({first}\) and optimizers that are not \({second}: Adam\)"):
        _fit(model, my_x, my_y)


class CompiledAndHeld(TwoOptimizers):
    """keras-io's SimCLR and distiller shape: compile()'s optimizer trains one sub-model, an
    optimizer kept as an attribute the other."""

    def compile(self, first_optimizer, second_optimizer):
        keras.Model.compile(self, optimizer=first_optimizer)
        self.second_optimizer = second_optimizer

    @property
    def first_optimizer(self):
        return self.optimizer


@pytest.mark.parametrize("wrapped, message", [
    ("compiled", r"wrap \(optimizer\) and optimizers that are not \(second_optimizer: Adam\)"),
    ("held", r"wrap \(second_optimizer\) and optimizers that are not \(optimizer: SGD\).*"
     r"if train_step never uses compile\(\)'s optimizer, compile without one"),
    ("both", None),
], ids=["compiled", "held", "both"])
def test_a_compiled_optimizer_and_one_kept_as_an_attribute_are_both_wrapped(world, wrapped,
                                                                            message):
    # Either one left unwrapped trained its sub-model apart on each rank, silently.
    rank, size = world
    _, _, my_x, my_y = _shards(rank, size)
    model = CompiledAndHeld(ks.mlp(ks.rank_seed(0)), ks.mlp(ks.rank_seed(0) + 50))
    first, second = keras.optimizers.SGD(0.1), keras.optimizers.Adam(0.01)
    model.compile(kr.wrap(first) if wrapped != "held" else first,
                  kr.wrap(second) if wrapped != "compiled" else second)
    if message is None:
        _fit(model, my_x, my_y)
        ks.assert_same_on_all_ranks(ks.weights(model.first) + ks.weights(model.second))
        return
    with pytest.raises(ValueError, match=message):
        _fit(model, my_x, my_y)


@pytest.mark.parametrize("holder", HOLDERS, ids=lambda holder: holder.__name__)
@pytest.mark.parametrize("built_everywhere", [True, False])
def test_the_broadcast_gives_every_rank_the_roots_optimizers_kept_as_attributes(
        world, built_everywhere, holder):
    # A GAN resumed Horovod's way (restored on the root, then the callback): its optimizers'
    # moments and step counts stayed each rank's own, and the ranks trained apart silently.
    rank, size = world
    _, _, my_x, my_y = _shards(rank, size)
    model = holder(ks.mlp(ks.rank_seed(0)), ks.mlp(ks.rank_seed(0) + 50))
    model.compile(kr.wrap(keras.optimizers.Adam(0.01)), kr.wrap(keras.optimizers.Adam(0.01)))
    optimizers = (model.first_optimizer, model.second_optimizer)
    for sub_model, optimizer in zip((model.first, model.second), optimizers):
        if rank == 0 or built_everywhere:
            optimizer.build(sub_model.trainable_variables)
        if rank == 0:  # the checkpoint's state
            optimizer.iterations.assign(7)
            for variable in optimizer.variables:
                if len(variable.shape) > 0:
                    variable.assign(np.full(variable.shape, 0.25, variable.dtype))
    if not built_everywhere:
        first, second = HOLDERS[holder]
        with pytest.raises(ValueError, match=rf"the optimizers it holds as attributes have "
                           rf"different variables on different ranks \(rank 0: {first} "
                           rf"\d+, {second} \d+; rank 1: {first} 2"):
            _fit(model, my_x, my_y)
        return
    _fit(model, my_x, my_y)
    for optimizer in optimizers:
        assert int(optimizer.iterations.numpy()) == 7 + 3
    ks.assert_same_on_all_ranks(ks.weights(model.first) + ks.weights(model.second)
                                + [v.numpy() for o in optimizers for v in o.variables])


def test_an_optimizer_set_after_the_base_compile_is_the_one_checked(world):
    # compile() recorded its own default optimizer as unused, and the wrapped one set after
    # it went unchecked: a rate set differently on one rank trained the ranks apart.
    rank, size = world
    _, _, my_x, my_y = _shards(rank, size)
    model = OptimizerSetAfterCompile(ks.mlp(ks.rank_seed(0)))
    model.compile(kr.wrap(keras.optimizers.SGD(0.1 if rank == 0 else 0.3)))
    with pytest.raises(kr.LearningRateMismatchError, match=r"\(rank 0 0.1, rank 1 0.3"):
        model.fit(my_x, my_y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)


def test_loss_scale_optimizers_around_wrapped_attributes_skip_overflows_together(world):
    # mixed_float16 in a GAN-style model: LossScaleOptimizer(wrap(opt)) kept as attributes.
    rank, size = world
    _, _, my_x, my_y = _shards(rank, size)
    if rank == size - 1:
        my_x = my_x.copy()
        my_x[BATCH:2 * BATCH] *= 1e6  # this rank's second batch overflows in float16
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = TwoOptimizers(ks.mlp(ks.rank_seed(0)), ks.mlp(ks.rank_seed(0) + 50))
        lso = keras.optimizers.LossScaleOptimizer
        model.compile(lso(kr.wrap(keras.optimizers.SGD(0.1))),
                      lso(kr.wrap(keras.optimizers.Adam(0.01))))
        _fit(model, my_x, my_y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for optimizer in (model.first_optimizer, model.second_optimizer):
        assert int(optimizer.inner_optimizer.iterations.numpy()) == 2  # 3 steps, 1 skipped
    ks.assert_same_on_all_ranks(ks.weights(model.first) + ks.weights(model.second)
                                + [float(model.first_optimizer.dynamic_scale.numpy())])


class TwoOptimizersOnXla(TwoOptimizers):
    """The same, where the base compile picks XLA: what ``jit_compile="auto"`` resolves to on
    a machine with a GPU."""

    def compile(self, first_optimizer, second_optimizer):
        keras.Model.compile(self, jit_compile=True)
        self.first_optimizer, self.second_optimizer = first_optimizer, second_optimizer


def test_optimizers_kept_as_attributes_turn_xla_off_when_the_step_is_traced(world, monkeypatch):
    # compile saw no wrapped optimizer; the step's collectives have no XLA kernel.
    rank, size = world
    _, _, my_x, my_y = _shards(rank, size)
    monkeypatch.setattr(kr._xla, "_warned", False)  # once per process: reset it
    model = TwoOptimizersOnXla(ks.mlp(ks.rank_seed(rank)), ks.mlp(ks.rank_seed(rank) + 50))
    model.compile(kr.wrap(keras.optimizers.SGD(0.1)), kr.wrap(keras.optimizers.Adam(0.01)))
    with pytest.warns(UserWarning, match="turning XLA off"):
        _fit(model, my_x, my_y)
    assert model.jit_compile is False
    ks.assert_same_on_all_ranks(ks.weights(model.first) + ks.weights(model.second))

    alone = TwoOptimizersOnXla(ks.mlp(1), ks.mlp(2))  # plain optimizers: XLA stays
    alone.compile(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1))
    _fit(alone, my_x, my_y, broadcast=False)
    assert alone.jit_compile is True


# --- random seeds ---------------------------------------------------------------------------

def _dropout_model(rank: int) -> keras.Model:
    keras.utils.set_random_seed(ks.rank_seed(rank))  # each process its own seeds, as usual
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64),
                             keras.layers.Dropout(0.5), keras.layers.GaussianNoise(1.0)])


def _masks_and_noise(model: keras.Model) -> np.ndarray:
    """What the random layers drew for one input, the same on every rank."""
    hidden = model.layers[0](np.ones((2, 64), "float32"))
    dropped = model.layers[1](hidden, training=True)
    noise = model.layers[2](tf.zeros_like(hidden), training=True)
    return np.concatenate([(dropped.numpy() == 0).ravel(), noise.numpy().ravel()])


def _distinct_on_every_rank(values: np.ndarray) -> bool:
    gathered = kr.allgather(tf.constant(values[np.newaxis]), name="random_draws").numpy()
    return all(not np.array_equal(gathered[i], gathered[j])
               for i in range(len(gathered)) for j in range(i))


@pytest.mark.parametrize("how", ["callback", "broadcast_variables", "broadcast_"])
def test_broadcasts_leave_each_rank_its_own_random_seeds(world, how):
    rank, size = world
    model = _dropout_model(rank)
    if how == "callback":
        model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.0)), loss="mse")
        data = np.ones((BATCH, 64), "float32")
        _fit(model, data, data)
    elif how == "broadcast_variables":
        kr.broadcast_variables(model.variables, root_rank=0)  # Horovod's custom-loop idiom
    else:
        values = kr.broadcast_(model.variables, root_rank=0, name="seeds")
        assert len(values) == len(model.variables)  # one value per variable, seeds included
        for variable, value in zip(model.variables, values):
            np.testing.assert_array_equal(variable.numpy(), value.numpy())
    ks.assert_same_on_all_ranks(ks.weights(model))  # the weights are the root's
    assert _distinct_on_every_rank(_masks_and_noise(model))  # the draws are each rank's own


def test_a_seed_state_broadcast_on_purpose_gives_every_rank_the_same_draws(world):
    rank, _ = world
    model = _dropout_model(rank)
    kr.broadcast_variables(model.weights, root_rank=0)
    for layer in model.layers[1:]:
        state = layer.seed_generator.state
        state.assign(kr.broadcast(state.value, root_rank=0, name=f"seed.{layer.name}"))
    ks.assert_same_on_all_ranks([_masks_and_noise(model)])
