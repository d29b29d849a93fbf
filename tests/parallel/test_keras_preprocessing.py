"""Preprocessing layers adapted on each rank's own shard (a one-process program moved to N
ranks the obvious way): the ranks must end up preprocessing alike, or fail naming the layer.

Normalization keeps its statistics in variables (broadcast like any weight) and a copy that
its call reads; lookups and Discretization keep theirs outside variables, where no broadcast
reaches (keras_ring._adapted_state).
"""

import numpy as np
import pytest

import keras
import keras_ring
import tensorflow as tf
from keras_ring.elastic import KerasState

PROBE = np.linspace(-3, 3, 8, dtype="float32").reshape(2, 4)


def _shard(rank: int) -> np.ndarray:
    """Data whose statistics differ by rank, as shards of a real dataset do."""
    rng = np.random.default_rng(rank)
    return (rng.normal(size=(64, 4)) * (1 + 2 * rank) + 5 * rank).astype("float32")


def _normalized_model(rank: int) -> tuple[keras.Model, keras.layers.Normalization]:
    keras.utils.set_random_seed(rank)
    norm = keras.layers.Normalization()
    norm.adapt(_shard(rank))
    model = keras.Sequential([keras.Input((4,)), norm, keras.layers.Dense(2)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    return model, norm


def _rank0_normalizes(norm: keras.layers.Normalization) -> np.ndarray:
    data = _shard(0)
    return (PROBE - data.mean(axis=0)) / np.sqrt(data.var(axis=0))


def _same_everywhere(value: np.ndarray) -> bool:
    everyone = keras_ring.allgather_object(np.asarray(value))
    return all(np.array_equal(v, everyone[0]) for v in everyone)


@pytest.mark.parametrize("how", ["callback", "broadcast_variables_before_fit"])
def test_normalization_adapted_per_rank_uses_the_roots_statistics(world, how):
    rank, _ = world
    model, norm = _normalized_model(rank)
    x = _shard(rank)
    callbacks = []
    if how == "callback":
        callbacks = [keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)]
    else:  # Horovod's custom programs broadcast by hand; fit must still see the new values
        keras_ring.broadcast_variables(model.variables, root_rank=0)
    model.fit(x, x[:, :2], batch_size=16, epochs=1, verbose=0, callbacks=callbacks)
    normalized = keras.ops.convert_to_numpy(norm(PROBE))
    np.testing.assert_allclose(normalized, _rank0_normalizes(norm), rtol=1e-4, atol=1e-4)
    assert _same_everywhere(model.predict(PROBE, verbose=0))
    assert _same_everywhere(np.concatenate([w.ravel() for w in model.get_weights()]))


def test_elastic_keras_state_sync_reaches_normalization(world):
    rank, _ = world
    model, norm = _normalized_model(rank)
    KerasState(model, batch=0).sync()
    np.testing.assert_allclose(keras.ops.convert_to_numpy(norm(PROBE)), _rank0_normalizes(norm),
                               rtol=1e-4, atol=1e-4)


def _lookup_model(vocabulary: list[str]) -> keras.Model:
    keras.utils.set_random_seed(0)
    lookup = keras.layers.StringLookup(name="tokens")
    lookup.adapt(vocabulary)
    model = keras.Sequential([keras.Input((1,), dtype="string"), lookup,
                              keras.layers.Embedding(16, 2), keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    return model


def _words(rank: int) -> np.ndarray:
    # Each rank's shard has other frequent words: ids would mean different words by rank.
    common = ["cat"] * (3 + rank) + ["dog"] * (5 - rank) + ["emu", f"rank{rank}"]
    return np.array(common).reshape(-1, 1)


def _word_batches(rank: int) -> tf.data.Dataset:
    x = _words(rank)  # numpy strings are no input Keras's fit takes; a dataset is
    return tf.data.Dataset.from_tensor_slices((x, np.ones((len(x), 1), "float32"))).batch(2)


def test_lookup_adapted_per_rank_fails_naming_the_layer(world):
    rank, size = world
    model = _lookup_model(list(_words(rank).ravel()))
    with pytest.raises(keras_ring.WeightMismatchError) as caught:
        model.fit(_word_batches(rank), epochs=1, verbose=0,
                  callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)])
    message = str(caught.value)
    assert "layer 'tokens', its vocabulary" in message
    assert "adapted them on its own data" in message
    assert caught.value.rank in range(1, size)


def test_lookup_given_the_roots_vocabulary_trains(world):
    rank, _ = world
    model = _lookup_model(list(_words(rank).ravel()))
    lookup = model.get_layer("tokens")
    # The README's remedy: the root's vocabulary on every rank.
    lookup.set_vocabulary(keras_ring.broadcast_object(lookup.get_vocabulary(), 0))
    model.fit(_word_batches(rank), epochs=2, verbose=0,
              callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert _same_everywhere(np.array(lookup.get_vocabulary()))
    assert _same_everywhere(np.concatenate([w.ravel() for w in model.get_weights()]))


def test_discretization_adapted_per_rank_fails_naming_the_layer(world):
    rank, _ = world
    keras.utils.set_random_seed(0)
    bins = keras.layers.Discretization(num_bins=4, name="buckets")
    bins.adapt(_shard(rank)[:, 0])
    model = keras.Sequential([keras.Input((1,)), bins,
                              keras.layers.CategoryEncoding(4, output_mode="one_hot"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    x = _shard(rank)[:, :1]
    with pytest.raises(keras_ring.WeightMismatchError, match="layer 'buckets', its bin boundaries"):
        model.fit(x, x, batch_size=16, epochs=1, verbose=0,
                  callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)])


# --- tf-idf weights, and TextVectorization inside the model ---------------------------------

def _documents(rank: int) -> list[str]:
    """As many documents and words on every rank (a 8, b 4, d 2), in other documents: equal
    vocabularies, different inverse document frequencies."""
    return ["a a"] * (4 - rank) + ["a b"] * (2 * rank) + ["b b"] * (2 - rank) + ["d d"]


def _text_model(layer: keras.layers.Layer, shape: tuple) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(shape, dtype="string"), layer, keras.layers.Dense(1)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    return model


def _fit_text(model: keras.Model, x: np.ndarray, epochs: int = 1) -> None:
    data = tf.data.Dataset.from_tensor_slices((x, np.ones((len(x), 1), "float32"))).batch(2)
    model.fit(data, epochs=epochs, verbose=0,
              callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)])


@pytest.mark.parametrize("layer", ["StringLookup", "TextVectorization"])
def test_tf_idf_weights_adapted_per_rank_fail_naming_the_layer(world, layer):
    # The vocabularies compared equal and the weights in tf.Variables of the layer's own went
    # unseen: each rank weighed tokens its own way, trained and saved apart, exit 0.
    rank, size = world
    if layer == "StringLookup":
        lookup = keras.layers.StringLookup(output_mode="tf_idf", name="tokens")
        x = np.array([d.split() for d in _documents(min(rank, 1))])
    else:
        lookup = keras.layers.TextVectorization(output_mode="tf_idf", name="tokens")
        x = np.array(_documents(min(rank, 1))).reshape(-1, 1)
    lookup.adapt(x)
    model = _text_model(lookup, x.shape[1:])
    with pytest.raises(keras_ring.WeightMismatchError) as caught:
        _fit_text(model, x)
    message = str(caught.value)
    assert "layer 'tokens', its idf weights" in message, message
    assert "idf_weights=" in message and caught.value.rank == 1


@pytest.mark.parametrize("mode", ["int", "multi_hot", "tf_idf"])
def test_text_vectorization_inside_the_model_trains(world, mode):
    # keras-io's text classification: TextVectorization adapted on the same data everywhere.
    # Its own lookup never runs as a layer, and fit refused the model, even in one process.
    rank, size = world
    text = keras.layers.TextVectorization(max_tokens=8, output_mode=mode,
                                          output_sequence_length=4 if mode == "int" else None)
    text.adapt(np.array(_documents(0) + _documents(1)))
    layers = [text] + ([keras.layers.Embedding(8, 2), keras.layers.Flatten()]
                       if mode == "int" else [])
    keras.utils.set_random_seed(rank)
    model = keras.Sequential([keras.Input((1,), dtype="string"), *layers, keras.layers.Dense(1)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    _fit_text(model, np.array(_documents(min(rank, 1))).reshape(-1, 1), epochs=2)
    assert _same_everywhere(np.concatenate([w.ravel() for w in model.get_weights()]))
