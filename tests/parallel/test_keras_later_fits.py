"""The weight check again as each later fit begins: between fits a program can change the
weights on some ranks only, and the ranks then trained apart with no error; rounding
differences (a GPU's updates are not bit-identical across ranks) must still pass."""

import numpy as np
import pytest

import keras
import keras_ring
from tests.parallel import keras_support as ks


def _model(rank: int) -> keras.Model:
    model = ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss())
    return model


def _fit(model, rank, size, callbacks=(), epochs=1, **kwargs):
    x, y = ks.classification_data(64 * size, seed=3)
    return model.fit(ks.shard(x, rank, size, 16), ks.shard(y, rank, size, 16), batch_size=16,
                     epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks), **kwargs)


def _trained(rank, size):
    model = _model(rank)
    _fit(model, rank, size, [keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)])
    return model


def test_a_checkpoint_loaded_on_one_rank_between_fits_fails_the_next_fit(world, tmp_path):
    rank, size = world
    model = _model(rank)
    _fit(model, rank, size, [keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)])
    saved = keras_ring.broadcast_object(ks.weights(model), 0)
    _fit(model, rank, size, epochs=2)
    if rank == 0:  # the "best" checkpoint, restored on rank 0 alone
        model.set_weights(saved)
    with pytest.raises(keras_ring.WeightMismatchError) as caught:
        _fit(model, rank, size)
    assert "as a later fit of model" in str(caught.value)
    assert caught.value.rank in range(1, size)


def test_early_stopping_restoring_each_ranks_own_best_epoch_fails_the_next_fit(world):
    rank, size = world
    model = _model(rank)
    # Each rank's own validation data, and no MetricAverageCallback: the ranks choose apart.
    x, y = ks.classification_data(64 * size, seed=3)  # the training data's labelling
    # Rank 0 validates on what it learns (improves every epoch); the others on other labels
    # (worse every epoch): their best epochs differ.
    x, y = x[:32], (y[:32] + min(rank, 1)) % ks.CLASSES
    stop = keras.callbacks.EarlyStopping(patience=10, restore_best_weights=True)
    _fit(model, rank, size, [keras_ring.callbacks.BroadcastGlobalVariablesCallback(0), stop],
         epochs=4, validation_data=(x, y))
    chosen = keras_ring.allgather_object(stop.best_epoch)
    assert len(set(chosen)) > 1, chosen  # otherwise this test proves nothing
    with pytest.raises(keras_ring.WeightMismatchError, match="restore_best_weights"):
        _fit(model, rank, size)


@pytest.mark.parametrize("ulps", [0, 4])
def test_rounding_differences_between_fits_pass(world, ulps):
    rank, size = world
    model = _trained(rank, size)
    if rank == 1:  # what non-bit-identical updates leave: the last bits differ
        weights = ks.weights(model)
        for _ in range(ulps):
            weights = [np.nextafter(w, np.inf) for w in weights]
        model.set_weights(weights)
    _fit(model, rank, size)  # no error
    everyone = keras_ring.allgather_object(ks.weights(model))
    for mine, other in zip(everyone[0], everyone[-1]):
        np.testing.assert_allclose(mine, other, rtol=1e-5, atol=1e-6)
