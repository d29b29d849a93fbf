"""SyncBatchNormalization under mpirun: the same as BatchNormalization on the global batch."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring
from keras_ring import SyncBatchNormalization
from keras_ring.callbacks import BroadcastGlobalVariablesCallback

from tests.parallel import keras_support as ks

BATCH = 4


def _rows(size):
    """Uneven per-rank batch sizes: rank r holds r + 1 rows."""
    return [1 + r for r in range(size)]


def _my_rows(array, rank, size):
    rows = _rows(size)
    start = sum(rows[:rank])
    return array[start:start + rows[rank]]


def _twin_layers(axis, input_shape):
    """A SyncBatchNormalization and a BatchNormalization with equal, non-trivial weights."""
    sync = SyncBatchNormalization(axis=axis, momentum=0.5)
    plain = keras.layers.BatchNormalization(axis=axis, momentum=0.5)
    for layer in (sync, plain):
        layer.build((None,) + input_shape[1:])
    channels = input_shape[axis]
    rng = np.random.default_rng(11)
    gamma, beta = rng.uniform(0.5, 2.0, channels), rng.normal(size=channels)
    for layer in (sync, plain):
        layer.gamma.assign(gamma.astype("float32"))
        layer.beta.assign(beta.astype("float32"))
    return sync, plain


def _training_step(layer):
    def step(x, upstream):
        # loss = sum(output * upstream): its gradient is `upstream`, a different one per row.
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(x, training=True)
            loss = tf.reduce_sum(out * upstream)
        return out, tape.gradient(loss, [x] + layer.trainable_weights)
    return step


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("axis", [-1, 1], ids=["channels_last", "channels_first"])
def test_equals_batch_norm_on_the_concatenated_uneven_batch(world, traced, axis):
    rank, size = world
    channels = 3
    rng = np.random.default_rng(5)
    # A large mean next to a small spread: the variance must not come from E[x^2] - E[x]^2.
    shape = (sum(_rows(size)), channels, channels) if axis == 1 else (sum(_rows(size)), channels)
    x_all = (100.0 + rng.normal(scale=0.5, size=shape)).astype("float32")
    up_all = rng.normal(size=shape).astype("float32")
    sync, plain = _twin_layers(axis, shape)
    sync_step, plain_step = _training_step(sync), _training_step(plain)
    if traced:
        sync_step, plain_step = tf.function(sync_step), tf.function(plain_step)
    for _ in range(2):  # two updates of the moving statistics
        out, grads = sync_step(tf.constant(_my_rows(x_all, rank, size)),
                               tf.constant(_my_rows(up_all, rank, size)))
        ref_out, ref_grads = plain_step(tf.constant(x_all), tf.constant(up_all))
    # The input gradient includes every rank's loss through the shared statistics.
    np.testing.assert_allclose(grads[0], _my_rows(ref_grads[0].numpy(), rank, size),
                               rtol=2e-4, atol=2e-4)
    # gamma, beta: the ranks' parts add up. Each is a sum of up to 36 terms of size ~1 made
    # from x ~ 100 in float32 (1e-5 each), summed in another order than the reference's.
    for g, ref in zip(grads[1:], ref_grads[1:]):
        np.testing.assert_allclose(keras_ring.allreduce(g, op=keras_ring.Sum), ref,
                                   rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(sync.moving_mean, plain.moving_mean, rtol=1e-6)
    np.testing.assert_allclose(sync.moving_variance, plain.moving_variance, rtol=1e-4)
    np.testing.assert_allclose(out, _my_rows(ref_out.numpy(), rank, size), rtol=1e-4, atol=1e-4)


def test_masked_steps_count_only_unmasked_elements(world):
    rank, size = world
    rng = np.random.default_rng(6)
    x_all = rng.normal(loc=2.0, size=(sum(_rows(size)), 5, 3)).astype("float32")
    mask_all = rng.uniform(size=x_all.shape[:2]) < 0.6
    sync, plain = _twin_layers(-1, x_all.shape)
    out = sync(_my_rows(x_all, rank, size), training=True, mask=_my_rows(mask_all, rank, size))
    ref = plain(x_all, training=True, mask=mask_all)
    np.testing.assert_allclose(sync.moving_mean, plain.moving_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sync.moving_variance, plain.moving_variance, rtol=1e-5)
    np.testing.assert_allclose(out, _my_rows(ref.numpy(), rank, size), rtol=1e-4, atol=1e-4)


def _bn_model(norm, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((ks.FEATURES,)),
        keras.layers.Dense(8),
        norm(momentum=0.7),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(ks.CLASSES),
    ])


def test_fit_equals_one_process_on_the_global_batch(world):
    rank, size = world
    x, y = ks.classification_data(size * BATCH * 6, seed=8)
    model = _bn_model(SyncBatchNormalization, ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.2, momentum=0.5)),
                  loss=ks.loss())
    model.fit(ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH), batch_size=BATCH,
              epochs=2, shuffle=False, verbose=0, callbacks=[BroadcastGlobalVariablesCallback(0)])
    reference = _bn_model(keras.layers.BatchNormalization, ks.rank_seed(0))
    reference.compile(optimizer=keras.optimizers.SGD(0.2, momentum=0.5), loss=ks.loss())
    reference.fit(x, y, batch_size=size * BATCH, epochs=2, shuffle=False, verbose=0)
    # Weights, gamma and beta, and the moving statistics alike.
    ks.assert_weights_close(ks.weights(model), ks.weights(reference), atol=1e-5, rtol=1e-5)
    ks.assert_same_on_all_ranks(ks.weights(model))


def test_saves_and_loads_with_its_config(world, tmp_path):
    rank, size = world
    model = _bn_model(lambda **kw: SyncBatchNormalization(epsilon=0.01, center=False, **kw), 3)
    model(np.ones((2, ks.FEATURES), "float32"), training=True)
    path = tmp_path / "sync_bn.keras"
    model.save(path)
    for loaded in (keras_ring.load_model(path, compile=False), keras.models.load_model(path)):
        layer = loaded.layers[1]
        assert type(layer) is SyncBatchNormalization
        assert layer.get_config() == model.layers[1].get_config()
        assert (layer.epsilon, layer.center, layer.momentum) == (0.01, False, 0.7)
        ks.assert_weights_close(ks.weights(loaded), ks.weights(model), atol=0.0)


def test_rejects_what_it_does_not_support(world):
    with pytest.raises(ValueError, match="does not support fused=True.*got fused=True"):
        SyncBatchNormalization(fused=True)
    with pytest.raises(ValueError, match="got synchronized=True"):
        SyncBatchNormalization(synchronized=True)
    assert SyncBatchNormalization(fused=False).name.startswith("sync_batch_normalization")
