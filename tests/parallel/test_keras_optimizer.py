"""wrap(optimizer) under mpirun: buckets, accumulation, sparse, compression, None, mixed precision."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring
from keras_ring import _buckets
from keras_ring.callbacks import BroadcastGlobalVariablesCallback, broadcast_model

from tests.parallel import keras_support as ks

BATCH = 4


class CollectiveLog:
    """Records every gradient collective: at trace time (names, dtypes) and when it runs."""

    def __init__(self, monkeypatch):
        self.traced = []  # (kind, name, [dtype names])
        self.shapes = []  # per collective, the shapes it carried
        self.executed = tf.Variable(0, dtype=tf.int64, trainable=False)
        grouped, single = _buckets.grouped_allreduce, _buckets.allreduce

        def counting_grouped(tensors, **kwargs):
            self.traced.append(("grouped", kwargs["name"], [t.dtype.name for t in tensors]))
            self.shapes.append([tuple(t.shape) for t in tensors])
            self.executed.assign_add(1)  # runs each time the collective runs, also in graphs
            return grouped(tensors, **kwargs)

        def counting_single(tensor, **kwargs):
            kind = "sparse" if isinstance(tensor, tf.IndexedSlices) else "single"
            self.traced.append((kind, kwargs["name"], [tensor.dtype.name]))
            self.shapes.append([tuple(tensor.shape)])
            self.executed.assign_add(1)
            return single(tensor, **kwargs)

        monkeypatch.setattr(_buckets, "grouped_allreduce", counting_grouped)
        monkeypatch.setattr(_buckets, "allreduce", counting_single)


def _fit(model, optimizer, rank, size, x, y, batch=BATCH, epochs=1, **compile_kwargs):
    model.compile(optimizer=optimizer, loss=ks.loss(), **compile_kwargs)
    model.fit(ks.shard(x, rank, size, batch), ks.shard(y, rank, size, batch), batch_size=batch,
              epochs=epochs, shuffle=False, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    return model


def _reference(x, y, batch, optimizer, epochs=1, model=None):
    model = model or ks.mlp(ks.rank_seed(0))
    model.compile(optimizer=optimizer, loss=ks.loss())
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return ks.weights(model)


def test_buckets_follow_reverse_variable_order(world, monkeypatch):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    model = ks.mlp(ks.rank_seed(rank), hidden=8)
    # Variables: kernel 6x8 (192 B), bias 8 (32 B), kernel 8x3 (96 B), bias 3 (12 B).
    # Reverse order with 128-byte buckets: [bias 3, kernel 8x3], [bias 8], [kernel 6x8].
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1), bucket_bytes=128)
    optimizer.build(model.trainable_variables)
    grads = [tf.ones_like(v) * (rank + 1) for v in model.trainable_variables]
    before = ks.weights(model)
    optimizer.apply(grads, model.trainable_variables)
    assert [(kind, name) for kind, name, _ in log.traced] == [
        ("grouped", "gradients.bucket0"), ("grouped", "gradients.bucket1"),
        ("grouped", "gradients.bucket2")]
    assert log.shapes == [[(3,), (8, 3)], [(8,)], [(6, 8)]]
    assert int(log.executed.numpy()) == 3
    mean = np.mean([r + 1 for r in range(size)])
    for w0, w1 in zip(before, ks.weights(model)):
        np.testing.assert_allclose(w1, w0 - 0.1 * mean, rtol=1e-6, atol=1e-7)


def _apply_with(how, options, model, rank):
    grads = [tf.ones_like(v) * (rank + 1) for v in model.trainable_variables]
    if how == "optimizer":
        optimizer = keras_ring.DistributedOptimizer(keras.optimizers.SGD(0.1), **options)
        optimizer.build(model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(model.trainable_variables, grads)])
    tape = keras_ring.DistributedGradientTape(tape, **options)
    grads = tape.gradient(loss, model.trainable_variables)
    keras.optimizers.SGD(0.1).apply(grads, model.trainable_variables)


@pytest.mark.parametrize("how, case", [
    (how, case) for how in ("optimizer", "tape") for case in ("groups=2", "num_groups=3", "listed")
] + [("optimizer", "named")])  # Horovod's tape takes no name
def test_horovods_groups_decide_what_travels_together(world, monkeypatch, how, case):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    model = ks.mlp(ks.rank_seed(rank), hidden=8)
    k0, b0, k1, b1 = model.trainable_variables  # 6x8, 8, 8x3, 3; sent from b1 back to k0
    options, shapes = {
        # Horovod's split in variable order, [k0, b0] and [k1, b1]; the last group first.
        "groups=2": ({"groups": 2}, [[(3,), (8, 3)], [(8,), (6, 8)]]),
        "num_groups=3": ({"num_groups": 3}, [[(3,)], [(8, 3)], [(8,), (6, 8)]]),
        # Listed together, where the first of them is sent; every other gradient alone.
        "listed": ({"groups": [[k0, b1]]}, [[(3,), (6, 8)], [(8, 3)], [(8,)]]),
        "named": ({"name": "DistributedSGD", "bucket_bytes": None}, [[(3,), (8, 3), (8,), (6, 8)]]),
    }[case]
    before = ks.weights(model)
    _apply_with(how, options, model, rank)
    assert log.shapes == shapes
    prefix = "DistributedSGD" if case == "named" else "gradients"
    assert [name for _, name, _ in log.traced] == [f"{prefix}.bucket{k}" for k in range(len(shapes))]
    mean = np.mean([r + 1 for r in range(size)])
    for w0, w1 in zip(before, ks.weights(model)):
        np.testing.assert_allclose(w1, w0 - 0.1 * mean, rtol=1e-6, atol=1e-7)


def test_gradient_accumulation_communicates_once_per_update(world, monkeypatch):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    x, y = ks.classification_data(size * BATCH * 8, seed=3)
    accumulating = keras.optimizers.SGD(0.1, momentum=0.5, gradient_accumulation_steps=2)
    model = _fit(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(accumulating, bucket_bytes=None),
                 rank, size, x, y)
    # 8 micro-batches, 4 updates, one bucket each.
    assert int(log.executed.numpy()) == 4
    assert int(model.optimizer.iterations.numpy()) == 4
    # The same as one process taking batches of 2 * size * BATCH without accumulation.
    expected = _reference(x, y, 2 * size * BATCH, keras.optimizers.SGD(0.1, momentum=0.5))
    ks.assert_weights_close(ks.weights(model), expected, atol=1e-6)


def test_gradient_accumulation_eager_counts_once_per_update(world, monkeypatch):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    model = ks.mlp(ks.rank_seed(0))
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1, gradient_accumulation_steps=3))
    optimizer.build(model.trainable_variables)
    counts = []
    for step in range(6):
        grads = [tf.ones_like(v) * (rank + step) for v in model.trainable_variables]
        optimizer.apply(grads, model.trainable_variables)
        counts.append(int(log.executed.numpy()))
    assert counts == [0, 0, 1, 1, 1, 2]
    ks.assert_same_on_all_ranks(ks.weights(model))


def test_none_gradients_are_skipped_on_every_rank(world):
    rank, size = world
    keras.utils.set_random_seed(ks.rank_seed(0))
    inputs = keras.Input((ks.FEATURES,))
    used = keras.layers.Dense(ks.CLASSES, name="used")
    unused = keras.layers.Dense(2, name="unused")
    unused.build((None, ks.FEATURES))
    model = keras.Model(inputs, used(inputs))
    model.unused = unused  # tracked, trainable, never in the graph: its gradients are None
    variables = model.trainable_variables + unused.trainable_variables
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1))
    optimizer.build(variables)
    unused_before = [v.numpy() for v in unused.trainable_variables]
    x, y = ks.classification_data(BATCH, seed=rank)
    with tf.GradientTape() as tape:
        loss = ks.loss()(y, model(x))
    grads = tape.gradient(loss, variables)
    assert grads[-1] is None and grads[0] is not None
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        optimizer.apply(grads, variables)
    ks.assert_same_on_all_ranks([v.numpy() for v in model.trainable_variables])
    for before, v in zip(unused_before, unused.trainable_variables):
        np.testing.assert_array_equal(v.numpy(), before)


@pytest.mark.parametrize("path", ["tape-eager", "tape-traced", "wrap-apply"])
@pytest.mark.parametrize("case", ["swapped", "all-missing-on-one-rank"])
def test_ranks_missing_different_gradients_fail_on_every_rank_saying_which(world, path, case):
    # A data-dependent branch (routing, a multi-task batch) leaves rank 0 without a gradient
    # for b and rank 1 without one for a: same shapes, so only the positions tell them apart.
    rank, size = world
    a, b = tf.Variable([1.0, 2.0]), tf.Variable([3.0, 4.0])
    uses_a = rank % 2 == 0 or case == "all-missing-on-one-rank"

    def gradients():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * 2.0) if uses_a else tf.reduce_sum(b * 3.0)
        if case == "all-missing-on-one-rank" and rank == size - 1:
            loss = tf.constant(0.0)  # this rank's batch touched neither
        if path == "wrap-apply":
            return tape.gradient(loss, [a, b])
        return keras_ring.DistributedGradientTape(tape, op=keras_ring.Sum).gradient(loss, [a, b])

    step = tf.function(gradients) if path == "tape-traced" else gradients
    optimizer = keras_ring.wrap(keras.optimizers.SGD(1.0), op=keras_ring.Sum)
    optimizer.build([a, b])
    with pytest.raises(keras_ring.CollectiveMismatchError) as info:
        grads = step()
        if path == "wrap-apply":
            optimizer.apply(grads, [a, b])
    message = str(info.value)
    assert "name mismatch" in message, message
    if case == "swapped":
        assert "no gradient for sources 0 of 2" in message
        assert "no gradient for sources 1 of 2" in message
    else:
        assert "no gradient for sources 0-1 of 2" in message
    ks.assert_same_on_all_ranks([a.numpy(), b.numpy()])  # nothing was applied anywhere
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])


def _embedding_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(50, 4),
                             keras.layers.Flatten(), keras.layers.Dense(ks.CLASSES)])


def _token_data(n):
    rng = np.random.default_rng(11)
    x = rng.integers(0, 50, size=(n, 3)).astype("int32")
    return x, (x.sum(axis=1) % ks.CLASSES).astype("int64")


# Keras's Adam updates only the touched rows' moments for IndexedSlices, so densifying changes
# Adam's result (as it would in one process); SGD's sparse and dense updates agree.
@pytest.mark.parametrize("sparse_as_dense, make_optimizer", [
    (False, lambda: keras.optimizers.Adam(0.05)),
    (False, lambda: keras.optimizers.SGD(0.5)),
    (True, lambda: keras.optimizers.SGD(0.5)),
])
def test_sparse_gradients_match_single_process(world, monkeypatch, sparse_as_dense, make_optimizer):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    x, y = _token_data(size * BATCH * 4)
    optimizer = keras_ring.wrap(make_optimizer(), sparse_as_dense=sparse_as_dense)
    model = _fit(_embedding_model(ks.rank_seed(rank)), optimizer, rank, size, x, y)
    kinds = sorted({kind for kind, _, _ in log.traced})
    assert kinds == (["grouped"] if sparse_as_dense else ["grouped", "sparse"])
    if sparse_as_dense:  # the embedding's gradient travels dense, in a bucket
        assert (50, 4) in [shape for shapes in log.shapes for shape in shapes]
    expected = _reference(x, y, size * BATCH, make_optimizer(),
                          model=_embedding_model(ks.rank_seed(0)))
    ks.assert_weights_close(ks.weights(model), expected, atol=2e-6)


@pytest.mark.parametrize("compression, wire", [
    (keras_ring.Compression.fp16, "float16"), (keras_ring.Compression.bf16, "bfloat16")])
def test_compression_sends_narrow_floats(world, monkeypatch, compression, wire):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    x, y = ks.classification_data(size * BATCH * 4, seed=5)
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1), compression=compression)
    model = _fit(ks.mlp(ks.rank_seed(rank)), optimizer, rank, size, x, y)
    assert {d for _, _, dtypes in log.traced for d in dtypes} == {wire}
    assert all(w.dtype == np.float32 for w in ks.weights(model))
    ks.assert_same_on_all_ranks(ks.weights(model))
    expected = _reference(x, y, size * BATCH, keras.optimizers.SGD(0.1))
    ks.assert_weights_close(ks.weights(model), expected, atol=2e-2)


@pytest.mark.parametrize("options, lr_scale", [
    ({"op": keras_ring.Sum}, "1/size"), ({"gradient_predivide_factor": 2.0}, "1"),
    ({"groups": 3, "name": "DistributedSGD"}, "1")])
def test_sum_and_predivide_match_average(world, options, lr_scale):
    rank, size = world
    x, y = ks.classification_data(size * BATCH * 4, seed=9)
    lr = 0.1 / size if lr_scale == "1/size" else 0.1
    model = _fit(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(keras.optimizers.SGD(lr), **options),
                 rank, size, x, y)
    expected = _reference(x, y, size * BATCH, keras.optimizers.SGD(0.1))
    ks.assert_weights_close(ks.weights(model), expected, atol=1e-6)


def test_jit_compile_is_turned_off_with_one_warning(world, monkeypatch):
    rank, size = world
    monkeypatch.setattr(keras_ring._xla, "_warned", False)  # once per process: reset it
    x, y = ks.classification_data(size * BATCH * 2, seed=1)
    with pytest.warns(UserWarning, match="turning XLA off") as record:
        model = ks.mlp(ks.rank_seed(rank))
        model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss(),
                      jit_compile=True)
    assert model.jit_compile is False
    assert len([w for w in record if "XLA" in str(w.message)]) == 1
    _fit(model, model.optimizer, rank, size, x, y, jit_compile=False)
    ks.assert_same_on_all_ranks(ks.weights(model))


def test_xla_compiled_custom_step_raises_a_clear_error(world):
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    x, y = ks.classification_data(BATCH, seed=rank)

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = ks.loss()(y, model(x))
        return keras_ring.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)

    with pytest.raises(ValueError, match="jit_compile=True.*no XLA kernel"):
        step()


def test_mixed_precision_fit_moves_communication_to_loss_scale_optimizer(world, monkeypatch):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    x, y = ks.classification_data(size * BATCH * 4, seed=2)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = ks.mlp(ks.rank_seed(rank))
        optimizer = keras_ring.wrap(keras.optimizers.Adam(0.01))
        model = _fit(model, optimizer, rank, size, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    outer = model.optimizer
    assert isinstance(outer, keras.optimizers.LossScaleOptimizer)
    assert keras_ring.optimizer.is_wrapped(outer)
    # The inner optimizer counts the steps (the outer one's own counter stays at 0 before
    # Keras 3.9, which made it report the inner one's).
    assert int(outer.inner_optimizer.iterations.numpy()) == 4
    # Once per step, by the outer optimizer: the wrapped inner one passes reduced grads on.
    assert int(log.executed.numpy()) == 4
    assert {name for _, name, _ in log.traced} == {"gradients.bucket0"}
    ks.assert_same_on_all_ranks(ks.weights(model) + [outer.dynamic_scale.numpy()])


def test_an_inner_optimizer_wrapped_after_compile_turns_xla_off_and_trains(world, monkeypatch):
    # mixed_float16 compiles a LossScaleOptimizer; wrapping model.optimizer.inner_optimizer
    # afterwards left fit seeing no wrapped optimizer until the first update (XLA stayed on,
    # which "auto" picks on a GPU, and the collective had no XLA kernel).
    rank, size = world
    monkeypatch.setattr(keras_ring._xla, "_warned", False)  # once per process: reset it
    x, y = ks.classification_data(size * BATCH * 2, seed=4)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = ks.mlp(ks.rank_seed(rank))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=ks.loss(), jit_compile=True)
        keras_ring.wrap(model.optimizer.inner_optimizer)
        with pytest.warns(UserWarning, match="turning XLA off"):
            model.fit(ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH),
                      batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=[BroadcastGlobalVariablesCallback(0)])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert keras_ring.optimizer.is_wrapped(model.optimizer)
    ks.assert_same_on_all_ranks(ks.weights(model))


def _loss_scaled(how: str) -> keras.optimizers.LossScaleOptimizer:
    inner = keras.optimizers.SGD(0.1)
    lso = keras.optimizers.LossScaleOptimizer
    if how == "wrap(LSO(opt))":
        return keras_ring.wrap(lso(inner))
    if how == "wrap(LSO(wrap(opt)))":
        return keras_ring.wrap(lso(keras_ring.wrap(inner)))
    if how == "LSO(wrap(opt))":  # a custom loop's way to add loss scaling to an optimizer
        return lso(keras_ring.wrap(inner))
    optimizer = lso(inner)  # its inner one wrapped later (model.optimizer.inner_optimizer)
    keras_ring.wrap(optimizer.inner_optimizer)
    return optimizer


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("how", ["wrap(LSO(opt))", "wrap(LSO(wrap(opt)))", "LSO(wrap(opt))",
                                 "inner wrapped later"])
def test_non_finite_gradient_on_one_rank_is_skipped_on_every_rank(world, monkeypatch, how,
                                                                   traced):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    model = ks.mlp(ks.rank_seed(0))
    optimizer = _loss_scaled(how)
    optimizer.build(model.trainable_variables)
    apply = lambda grads: optimizer.apply(grads, model.trainable_variables)  # noqa: E731
    apply = tf.function(apply) if traced else apply
    before = ks.weights(model)
    scale = float(optimizer.dynamic_scale.numpy())
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    if rank == size - 1:
        grads[0] = grads[0] * np.inf  # only the last rank overflows
    apply(grads)
    ks.assert_weights_close(ks.weights(model), before, atol=0.0)
    assert float(optimizer.dynamic_scale.numpy()) == scale / 2
    # A finite step afterwards is applied everywhere.
    apply([tf.ones_like(v) for v in model.trainable_variables])
    assert not np.allclose(ks.weights(model)[0], before[0])
    ks.assert_same_on_all_ranks(ks.weights(model))
    assert int(log.executed.numpy()) == 2  # one bucket per step, never a second reduction


def test_loss_scale_optimizer_with_inner_accumulation_stays_in_step(world, monkeypatch):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    model = ks.mlp(ks.rank_seed(0))
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    optimizer = keras_ring.wrap(keras.optimizers.LossScaleOptimizer(inner))
    optimizer.build(model.trainable_variables)
    for step in range(4):
        grads = [tf.ones_like(v) * (rank + step) for v in model.trainable_variables]
        if rank == 0 and step == 1:
            grads[0] = grads[0] * np.inf  # one rank overflows on one micro-batch
        optimizer.apply(grads, model.trainable_variables)
    # Under a LossScaleOptimizer every micro-batch is reduced, so that the overflow check,
    # and with it the accumulation count, is the same on every rank.
    assert int(log.executed.numpy()) == 4
    assert int(inner.iterations.numpy()) == 1  # 3 finite micro-batches: one update
    ks.assert_same_on_all_ranks(ks.weights(model) + [v.numpy() for v in inner.variables])
