"""A model trained with a wrapped optimizer loads with plain Keras, in a process without keras_ring."""

import itertools
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import keras
import keras_ring
from keras_ring.callbacks import BroadcastGlobalVariablesCallback
from keras_ring.config import MPI_VARIABLE_PREFIXES

from tests.parallel import keras_support as ks

LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import keras
    result = {}
    for path in sys.argv[1:]:
        model = keras.models.load_model(path)
        optimizer = model.optimizer
        inner = getattr(optimizer, "inner_optimizer", None)
        result[path] = {
            "class": type(optimizer).__module__ + "." + type(optimizer).__qualname__,
            "inner": None if inner is None else type(inner).__qualname__,
            "iterations": int(optimizer.iterations.numpy()),
            "weights": [w.tolist() for w in model.get_weights()],
            "slots": [np.asarray(v.numpy(), dtype="float64").tolist() for v in optimizer.variables],
        }
        # It trains on without keras_ring.
        model.fit(np.zeros((4, 6), "float32"), np.zeros((4,), "int64"), verbose=0)
        result[path]["iterations_after_fit"] = int(optimizer.iterations.numpy())
    result["keras_ring_imported"] = any(m.startswith("keras_ring") for m in sys.modules)
    print("RESULT " + json.dumps(result))
""")


def _train_and_save(rank, size, path, policy, distributed=True):
    keras.mixed_precision.set_global_policy(policy)
    try:
        model = ks.mlp(ks.rank_seed(rank))
        optimizer = keras.optimizers.Adam(0.01)
        model.compile(optimizer=keras_ring.wrap(optimizer) if distributed else optimizer,
                      loss=ks.loss())
        x, y = ks.classification_data(size * 8, seed=4)
        callbacks = [BroadcastGlobalVariablesCallback(0)] if distributed else []
        model.fit(ks.shard(x, rank, size, 4), ks.shard(y, rank, size, 4), batch_size=4,
                  verbose=0, callbacks=callbacks)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.save(path)
    return model


def _load_in_fresh_process(paths):
    # No launcher variables (the child must not think it is a rank) and no keras_ring on
    # the path: the loader must not need it.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(MPI_VARIABLE_PREFIXES + ("KERAS_RING",))}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", LOADER, *paths], env=env, cwd="/",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_saved_model_loads_without_keras_ring(world, tmp_path):
    rank, size = world
    plain = _train_and_save(rank, size, str(tmp_path / "adam.keras"), "float32")
    mixed = _train_and_save(rank, size, str(tmp_path / "mixed.keras"), "mixed_float16")
    ks.assert_same_on_all_ranks(ks.weights(plain) + ks.weights(mixed))
    if rank != 0:
        return  # one fresh process is enough; there are no collectives below
    # The same model trained without keras_ring: what plain Keras saves and loads.
    _train_and_save(rank, size, str(tmp_path / "keras_mixed.keras"), "mixed_float16",
                    distributed=False)
    paths = [str(tmp_path / n) for n in ("adam.keras", "mixed.keras", "keras_mixed.keras")]
    result = _load_in_fresh_process(paths)
    assert result["keras_ring_imported"] is False
    loaded = result[paths[0]]
    assert (loaded["class"], loaded["inner"]) == ("keras.src.optimizers.adam.Adam", None)
    assert loaded["iterations"] == int(plain.optimizer.iterations.numpy()) == 2
    _assert_loaded_state(loaded, plain)
    assert loaded["iterations_after_fit"] == 3
    # Under mixed_float16 the wrapped model round-trips exactly as plain Keras's does.
    loaded_mixed, keras_mixed = result[paths[1]], result[paths[2]]
    for key in ("class", "inner", "iterations", "iterations_after_fit"):
        assert loaded_mixed[key] == keras_mixed[key], key
    assert len(loaded_mixed["slots"]) == len(keras_mixed["slots"])
    for got, want in zip(loaded_mixed["weights"], ks.weights(mixed)):
        np.testing.assert_array_equal(np.array(got, dtype=want.dtype), want)


def _assert_loaded_state(loaded, model):
    for got, want in zip(loaded["weights"], ks.weights(model)):
        np.testing.assert_array_equal(np.array(got, dtype=want.dtype), want)
    slots = [v.numpy() for v in model.optimizer.variables]
    assert len(loaded["slots"]) == len(slots)
    for got, want in zip(loaded["slots"], slots):
        np.testing.assert_array_equal(np.array(got), np.asarray(want, dtype="float64"))


def test_an_optimizer_restored_without_its_slots_on_one_rank_is_named_by_the_broadcast(world, tmp_path):
    # Horovod's examples resume from ".h5" on rank 0 only. Keras 3's legacy loader gives back
    # a built SGD without its momentums: 2 variables against 6 (iteration, rate, 4 momentums).
    rank, size = world
    x, y = ks.classification_data(size * 8, seed=11)

    def compiled():
        model = ks.mlp(ks.rank_seed(0))
        model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1, momentum=0.9)),
                      loss=ks.loss())
        return model

    model = compiled()
    if rank == 0:  # an earlier run's checkpoint (trained alone, so no collectives here)
        earlier = ks.mlp(ks.rank_seed(0))
        earlier.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=ks.loss())
        earlier.fit(x, y, batch_size=8, epochs=1, verbose=0)
        earlier.save(tmp_path / "ckpt.h5")
        model = keras_ring.load_model(tmp_path / "ckpt.h5")
    with pytest.raises(ValueError) as info:
        model.fit(ks.shard(x, rank, size, 8), ks.shard(y, rank, size, 8), batch_size=8,
                  epochs=1, verbose=0, callbacks=[BroadcastGlobalVariablesCallback(0)])
    message = str(info.value)
    assert "the ranks hold different variables (rank 0: 4 model weights, 2 variables of its SGD; " \
           "rank 1: 4 model weights, 6 variables of its SGD" in message, message
    assert "checkpoint to .keras" in message


def test_a_layer_frozen_on_some_ranks_only_is_named_by_the_broadcast(world):
    # Adam's slots follow the trainable weights, so the counts differ there too: the message
    # once blamed a legacy .h5 checkpoint.
    rank, size = world
    x, y = ks.classification_data(size * 8, seed=11)
    model = ks.mlp(ks.rank_seed(0))
    if rank == 1:
        model.layers[0].trainable = False
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.Adam(0.01)), loss=ks.loss())
    with pytest.raises(ValueError) as info:
        model.fit(ks.shard(x, rank, size, 8), ks.shard(y, rank, size, 8), batch_size=8,
                  epochs=1, verbose=0, callbacks=[BroadcastGlobalVariablesCallback(0)])
    message = str(info.value)
    first = model.layers[0]
    assert (f"(rank 0 trains 4 weights, rank 1 trains 2; only rank 0 trains "
            f"'{first.kernel.path}', '{first.bias.path}')") in message, message
    assert "frozen (trainable=False) on some ranks only" in message


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_a_checkpoint_taken_mid_accumulation_resumes_as_one_process_would(world, tmp_path,
                                                                           policy):
    # Horovod's resume: rank 0 loads, the others build afresh and the callback broadcasts.
    # The checkpoint's accumulators hold a pass not yet applied: every rank must take it (a
    # rank keeping its zeros counted it 1/N; under mixed_float16, where the sums are the
    # ranks' shared averages, the ranks trained apart).
    rank, size = world
    x, y = ks.classification_data(size * 4 * 5, seed=6)
    make = lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)  # noqa: E731
    keras.mixed_precision.set_global_policy(policy)
    try:
        reference = ks.mlp(ks.rank_seed(0))
        reference.compile(optimizer=make(), loss=ks.loss())
        reference.fit(x, y, batch_size=size * 4, shuffle=False, verbose=0)  # 5 passes
        path = str(tmp_path / "mid_accumulation.keras")
        reference.save(path)
        reference.fit(x, y, batch_size=size * 4, shuffle=False, verbose=0)
        if rank == 0:
            model = keras_ring.load_model(path)
        else:
            model = ks.mlp(ks.rank_seed(rank))
            model.compile(optimizer=keras_ring.wrap(make()), loss=ks.loss())
        model.fit(ks.shard(x, rank, size, 4), ks.shard(y, rank, size, 4), batch_size=4,
                  shuffle=False, verbose=0, callbacks=[BroadcastGlobalVariablesCallback(0)])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    ks.assert_same_on_all_ranks(ks.weights(model))
    ks.assert_weights_close(ks.weights(model), ks.weights(reference), atol=1e-4, rtol=1e-4)


def test_load_model_warns_where_the_saved_optimizer_accumulates_and_nothing_says_how(
        world, tmp_path):
    # The file keeps backward_passes_per_step only as Keras's gradient_accumulation_steps:
    # loaded without it, the trained sum of 3 passes silently became their mean (a probe: the
    # resumed weights 9x off the uninterrupted run's).
    rank, size = world
    model = ks.mlp(ks.rank_seed(0))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.05),
                                            backward_passes_per_step=3), loss=ks.loss())
    x, y = ks.classification_data(size * 4 * 6, seed=7)
    model.fit(ks.shard(x, rank, size, 4), ks.shard(y, rank, size, 4), batch_size=4,
              shuffle=False, verbose=0)
    path = str(tmp_path / f"accumulating.{rank}.keras")
    model.save(path)
    with pytest.warns(UserWarning, match=r"accumulates 3 passes per update, and no "
                      r"backward_passes_per_step was given.*backward_passes_per_step=3"):
        keras_ring.load_model(path)
    for options in ({"backward_passes_per_step": 3},
                    {"backward_passes_per_step": 3, "average_aggregated_gradients": True}):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            loaded = keras_ring.load_model(path, **options)
        assert loaded.optimizer.gradient_accumulation_steps == 3


@pytest.mark.parametrize("given", ["list", "iterator"])
def test_each_optimizers_sums_follow_its_own_step_counter(world, given):
    # Two accumulating optimizers (a GAN's), one resumed on the root mid-accumulation and
    # one in step: only the first one's sums are the root's; the second keeps each rank's
    # own passes, not yet reduced. Also from a one-shot iterable (itertools.chain), which
    # the step-counter walk found empty after the broadcast had read it.
    rank, size = world
    model = ks.mlp(ks.rank_seed(0))
    optimizers = [keras_ring.wrap(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
                  for _ in range(2)]
    def accumulators(optimizer):
        return [v for v in optimizer.variables
                if keras_ring._keras_private.is_gradient_accumulator(v)]

    for optimizer in optimizers:
        optimizer.build(model.trainable_variables)
        assert accumulators(optimizer)
        for sums in accumulators(optimizer):
            sums.assign(np.full(sums.shape, rank + 1.0, np.float32))
    if rank == 0:
        keras_ring._keras_private.raw_iterations(optimizers[0]).assign(3)  # the checkpoint's
    both = (optimizers[0].variables + optimizers[1].variables if given == "list" else
            itertools.chain(optimizers[0].variables, optimizers[1].variables))
    keras_ring.broadcast_variables(both, 0)
    for i, optimizer in enumerate(optimizers):
        expected = 1.0 if i == 0 else rank + 1.0
        for sums in accumulators(optimizer):
            np.testing.assert_array_equal(sums.numpy(), np.full(sums.shape, expected))
