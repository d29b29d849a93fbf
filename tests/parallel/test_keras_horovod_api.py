"""Horovod's Keras API under mpirun: backward passes, local gradients, compressors, load_model,
and programs written for Horovod (its two TF2 MNIST examples) with the import swapped."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring
import keras_ring._accumulation
from keras_ring.callbacks import BroadcastGlobalVariablesCallback
from keras_ring.optimizer import is_wrapped

from tests.parallel import keras_support as ks
from tests.parallel.test_keras_optimizer import BATCH, CollectiveLog, _fit, _reference


def _maybe_traced(fn, traced):
    return tf.function(fn) if traced else fn


# --- backward_passes_per_step ---------------------------------------------------------------

@pytest.mark.parametrize("average", [False, True], ids=["sum", "average"])
@pytest.mark.parametrize("run_eagerly", [False, True], ids=["graph", "eager"])
def test_wrap_backward_passes_communicate_once_and_sum_the_passes(world, monkeypatch, average,
                                                                  run_eagerly):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    x, y = ks.classification_data(size * BATCH * 8, seed=3)
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1, momentum=0.5), bucket_bytes=None,
                                backward_passes_per_step=2, average_aggregated_gradients=average)
    model = _fit(ks.mlp(ks.rank_seed(rank)), optimizer, rank, size, x, y,
                 run_eagerly=run_eagerly)
    assert int(log.executed.numpy()) == 4  # 8 passes, 4 updates, one bucket each
    # Horovod's semantics: the update gets the sum of the 2 passes' averaged gradients, i.e.
    # twice the gradient of the global batch of 2 * size * BATCH rows (unless averaged).
    expected = _reference(x, y, 2 * size * BATCH,
                          keras.optimizers.SGD(0.1 if average else 0.2, momentum=0.5))
    ks.assert_weights_close(ks.weights(model), expected, atol=1e-6)
    ks.assert_same_on_all_ranks(ks.weights(model))  # bitwise: no rank's own sums left in


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_broadcast_of_the_optimizer_mid_accumulation_keeps_each_ranks_passes(world, traced):
    # Horovod's loop broadcasts the model and the optimizer's variables after its first
    # step; with backward_passes_per_step=2 that is between the passes of the first update,
    # and each rank's accumulated pass must survive it (one process's equal on the same start).
    rank, size = world
    x, y = ks.classification_data(size * BATCH * 4, seed=5)
    model = ks.mlp(ks.rank_seed(0))
    optimizer = keras_ring.wrap(keras.optimizers.Adam(0.01), backward_passes_per_step=2,
                                average_aggregated_gradients=True)
    optimizer.build(model.trainable_variables)

    def step(xb, yb, first):
        with tf.GradientTape() as tape:
            loss = ks.loss()(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        if first:
            keras_ring.broadcast_variables(model.variables, root_rank=0)
            keras_ring.broadcast_variables(optimizer.variables, root_rank=0)

    step = _maybe_traced(step, traced)
    mine_x, mine_y = ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH)
    for k in range(4):
        step(mine_x[k * BATCH:(k + 1) * BATCH], mine_y[k * BATCH:(k + 1) * BATCH], k == 0)
    expected = _reference(x, y, 2 * size * BATCH, keras.optimizers.Adam(0.01))
    ks.assert_weights_close(ks.weights(model), expected, atol=1e-6)
    ks.assert_same_on_all_ranks(ks.weights(model))


@pytest.mark.parametrize("average", [False, True], ids=["sum", "average"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_tape_backward_passes_return_the_reduced_sum_every_nth_pass(world, average, traced):
    rank, size = world
    passes, updates = 2, 2
    x, y = ks.classification_data(size * BATCH * passes * updates, seed=9)
    model = ks.mlp(ks.rank_seed(0))

    def one_pass(x, y):
        with tf.GradientTape() as tape:
            loss = ks.loss()(y, model(x))
        tape = keras_ring.DistributedGradientTape(tape, backward_passes_per_step=passes,
                                                  average_aggregated_gradients=average)
        return tape.gradient(loss, model.trainable_variables), tape.update_step

    def global_gradient(k):  # one process, the global micro-batch k
        rows = slice(k * size * BATCH, (k + 1) * size * BATCH)
        with tf.GradientTape() as tape:
            loss = ks.loss()(y[rows], model(x[rows]))
        return tape.gradient(loss, model.trainable_variables)

    one_pass = _maybe_traced(one_pass, traced)
    mine_x, mine_y = ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH)
    flags = []
    for k in range(passes * updates):
        rows = slice(k * BATCH, (k + 1) * BATCH)
        grads, update = one_pass(mine_x[rows], mine_y[rows])
        flags.append(bool(update))
        if not update:
            assert all(not np.any(g) for g in grads)
            continue
        parts = [global_gradient(j) for j in range(k + 1 - passes, k + 1)]
        for i, g in enumerate(grads):
            expected = sum(p[i] for p in parts) / (passes if average else 1)
            np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-6)
    assert flags == [False, True] * updates


def test_an_elastic_world_change_drops_the_tapes_pending_passes(world):
    # Kept outside any elastic state, a survivor's accumulator carried a pass of a step that
    # the restore rolled back into its next update (and counted apart from a newcomer's).
    rank, size = world
    x, y = ks.classification_data(size * BATCH * 3, seed=9)
    model = ks.mlp(ks.rank_seed(0))

    def one_pass(k):
        rows = slice(k * BATCH, (k + 1) * BATCH)
        with tf.GradientTape() as tape:
            loss = ks.loss()(ks.shard(y, rank, size, BATCH)[rows],
                             model(ks.shard(x, rank, size, BATCH)[rows]))
        tape = keras_ring.DistributedGradientTape(tape, backward_passes_per_step=2)
        return tape.gradient(loss, model.trainable_variables), tape.update_step

    def global_gradient(k):
        rows = slice(k * size * BATCH, (k + 1) * size * BATCH)
        with tf.GradientTape() as tape:
            loss = ks.loss()(y[rows], model(x[rows]))
        return tape.gradient(loss, model.trainable_variables)

    assert not bool(one_pass(0)[1])  # the pass that the world change drops
    keras_ring._accumulation.drop_pending_passes()  # what elastic.run does on every rank
    assert not bool(one_pass(1)[1])
    grads, update = one_pass(2)
    assert bool(update)
    for g, a, b in zip(grads, global_gradient(1), global_gradient(2)):
        np.testing.assert_allclose(g, a + b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("average", [False, True], ids=["sum", "average"])
def test_backward_passes_under_a_loss_scale_optimizer_sum_the_passes(world, monkeypatch, average):
    # As Model.compile arranges it under mixed_float16: the outer LossScaleOptimizer reduces
    # every pass (so all ranks agree on overflows), the inner one accumulates the passes.
    rank, size = world
    log = CollectiveLog(monkeypatch)
    model = ks.mlp(ks.rank_seed(0))
    inner = keras_ring.wrap(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                            average_aggregated_gradients=average)
    optimizer = keras_ring.wrap(keras.optimizers.LossScaleOptimizer(inner))
    optimizer.build(model.trainable_variables)
    before, scale = ks.weights(model), float(optimizer.dynamic_scale.numpy())
    for step in range(2):
        variables = model.trainable_variables
        optimizer.apply([tf.ones_like(v) * scale * (rank + step) for v in variables], variables)
    total = sum(np.mean([r + step for r in range(size)]) for step in range(2))
    for w0, w1 in zip(before, ks.weights(model)):
        np.testing.assert_allclose(w1, w0 - total / (2 if average else 1), rtol=1e-6)
    assert int(log.executed.numpy()) == 2 and int(inner.iterations.numpy()) == 1


# --- local gradients ------------------------------------------------------------------------

def _two_layer_model():
    keras.utils.set_random_seed(0)
    shared, head = keras.layers.Dense(3), keras.layers.Dense(2)
    return keras.Sequential([keras.Input((4,)), shared, head]), shared, head


@pytest.mark.parametrize("scale", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("how", ["local_layers", "register_local_var"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_partial_optimizer_applies_local_gradients_unreduced(world, scale, how, traced):
    rank, size = world
    model, shared, head = _two_layer_model()
    if how == "local_layers":
        optimizer = keras_ring.PartialDistributedOptimizer(
            keras.optimizers.SGD(1.0), local_layers=head, scale_local_gradients=scale)
    else:
        optimizer = keras_ring.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                                    scale_local_gradients=scale)
        for variable in head.trainable_weights:
            optimizer.register_local_var(variable)
    variables = model.trainable_variables
    optimizer.build(variables)
    before = ks.weights(model)
    apply = _maybe_traced(lambda grads: optimizer.apply(grads, variables), traced)
    apply([tf.fill(v.shape, float(rank + 1)) for v in variables])
    mean = np.mean([r + 1.0 for r in range(size)])
    local = (rank + 1.0) / (size if scale else 1)
    steps = [mean] * len(shared.trainable_weights) + [local] * len(head.trainable_weights)
    for w0, w1, step in zip(before, ks.weights(model), steps):
        np.testing.assert_allclose(w1, w0 - step, rtol=1e-6)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_local_overflow_on_one_rank_skips_the_step_on_every_rank(world, traced):
    # Mixed precision with local layers: the loss-scale optimizer's finiteness check also
    # sees this rank's own, unreduced gradients. One rank's overflow must make every rank
    # skip the step and lower its scale alike, or their shared weights part ways.
    rank, size = world
    model, shared, head = _two_layer_model()
    optimizer = keras_ring.PartialDistributedOptimizer(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0)), local_layers=head)
    variables = model.trainable_variables
    optimizer.build(variables)
    before, scale = ks.weights(model), float(optimizer.dynamic_scale)
    apply = _maybe_traced(lambda grads: optimizer.apply(grads, variables), traced)
    grads = [tf.ones(v.shape) for v in variables]
    overflowing = grads[:-1] + [grads[-1] * np.inf]  # the head's bias: local
    apply(overflowing if rank == size - 1 else grads)
    for w0, w1 in zip(before, ks.weights(model)):
        np.testing.assert_array_equal(w1, w0)  # skipped everywhere, the shared layer included
    assert int(optimizer.iterations) == 0 and float(optimizer.dynamic_scale) == scale / 2
    apply(grads)  # a finite step is taken everywhere
    after = ks.weights(model)
    assert not np.array_equal(after[0], before[0])
    ks.assert_same_on_all_ranks(after[:len(shared.trainable_weights)])


def test_global_clipnorm_with_local_gradients_is_refused(world):
    model, shared, head = _two_layer_model()
    optimizer = keras_ring.PartialDistributedOptimizer(
        keras.optimizers.SGD(1.0, global_clipnorm=0.1), local_layers=head)
    variables = model.trainable_variables
    optimizer.build(variables)
    with pytest.raises(ValueError, match="global_clipnorm=0.1 and local gradients"):
        optimizer.apply([tf.ones(v.shape) for v in variables], variables)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_partial_tape_keeps_local_layers_and_sources_on_their_rank(world, traced):
    rank, size = world
    model, shared, head = _two_layer_model()
    extra = tf.Variable([1.0, 2.0])
    sources = model.trainable_variables + [extra]

    def gradients():
        with tf.GradientTape() as tape:
            loss = float(rank + 1) * tf.add_n([tf.reduce_sum(v) for v in sources])
        tape = keras_ring.PartialDistributedGradientTape(tape, local_layers=[head])
        tape.register_local_source(extra)
        return tape.gradient(loss, sources)

    grads = _maybe_traced(gradients, traced)()
    mean = np.mean([r + 1.0 for r in range(size)])
    expected = ([mean] * len(shared.trainable_weights)
                + [(rank + 1.0) / size] * (len(head.trainable_weights) + 1))
    for g, value in zip(grads, expected):
        np.testing.assert_allclose(g, np.full(g.shape, value), rtol=1e-6)


@pytest.mark.parametrize("form", ["keras.Variable", "tf.Variable", "one variable"])
def test_broadcast_callback_leaves_local_variables_alone(world, form):
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    own = ks.weights(model)
    kernel = model.layers[-1].kernel
    local = {"keras.Variable": [kernel], "tf.Variable": [kernel.value], "one variable": kernel}
    callback = BroadcastGlobalVariablesCallback(0, local_variables=local[form])
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.0))  # weights stay put
    # Local in the optimizer too: a weight that differs by rank on purpose (else the weight
    # check names it as the epoch ends).
    optimizer.register_local_var(kernel)
    model.compile(optimizer=optimizer, loss=ks.loss())
    x, y = ks.classification_data(BATCH, seed=1)
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[callback])
    roots = ks.weights(ks.mlp(ks.rank_seed(0)))
    local_index = [id(w) for w in model.weights].index(id(kernel))
    for i, (w, root, mine) in enumerate(zip(ks.weights(model), roots, own)):
        np.testing.assert_array_equal(w, mine if i == local_index else root)
    # Ranks started apart, so the local kernel is really each rank's own.
    assert rank == 0 or not np.array_equal(own[local_index], roots[local_index])


# --- compressors of Horovod's shape ---------------------------------------------------------

class FlatHalf:
    """A user's compressor: flattens and sends float16 of twice the value (undone after)."""

    @staticmethod
    def compress(tensor):
        return tf.cast(tf.reshape(tensor, [-1]) * 2.0, tf.float16), (tensor.shape, tensor.dtype)

    @staticmethod
    def decompress(tensor, ctx):
        shape, dtype = ctx
        return tf.reshape(tf.cast(tensor, dtype) / 2.0, shape)


@pytest.mark.parametrize("compression", [FlatHalf, FlatHalf()], ids=["class", "instance"])
@pytest.mark.parametrize("user", ["wrap", "tape"])
def test_custom_compressor_shapes_what_travels(world, monkeypatch, compression, user):
    rank, size = world
    log = CollectiveLog(monkeypatch)
    variables = [tf.Variable(tf.zeros((2, 3))), tf.Variable(tf.zeros((4,)))]
    grads = [tf.fill(v.shape, float(rank + 1)) for v in variables]
    if user == "wrap":
        optimizer = keras_ring.wrap(keras.optimizers.SGD(1.0), compression=compression)
        optimizer.apply(grads, variables)
        reduced = [-v.numpy() for v in variables]
    else:
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        reduced = keras_ring.DistributedGradientTape(tape, compression=compression).gradient(
            loss, variables)
    assert [dtypes for _, _, dtypes in log.traced] == [["float16", "float16"]]
    assert log.shapes == [[(4,), (6,)]]  # flat, in reverse variable order
    mean = np.mean([r + 1.0 for r in range(size)])
    for r, v in zip(reduced, variables):
        assert r.dtype == tf.float32 and tuple(r.shape) == tuple(v.shape)
        np.testing.assert_allclose(r, np.full(v.shape, mean), rtol=1e-3)


# --- load_model -----------------------------------------------------------------------------

class CustomSGD(keras.optimizers.SGD):
    """An optimizer class Keras does not know by name."""


def _train(model, optimizer, rank, size, seed):
    x, y = ks.classification_data(size * BATCH * 3, seed=seed)
    return _fit(model, optimizer, rank, size, x, y)


def test_load_model_resumes_with_the_optimizer_state(world, tmp_path):
    rank, size = world
    model = _train(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(keras.optimizers.Adam(0.01)),
                   rank, size, seed=4)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras_ring.load_model(path)
    assert is_wrapped(loaded.optimizer) and loaded.optimizer.__class__ is keras.optimizers.Adam
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) > 0
    ks.assert_weights_close([v.numpy() for v in loaded.optimizer.variables],
                            [v.numpy() for v in model.optimizer.variables], atol=0.0)
    # Training on from the loaded model is training on from the original one.
    for m in (model, loaded):
        _train(m, m.optimizer, rank, size, seed=5)
    ks.assert_weights_close(ks.weights(loaded), ks.weights(model), atol=1e-6)
    ks.assert_same_on_all_ranks(ks.weights(loaded))


def test_load_model_takes_compression_and_custom_optimizers(world, monkeypatch, tmp_path):
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    _train(model, keras_ring.wrap(CustomSGD(0.1)), rank, size, seed=6)
    path = tmp_path / "custom.keras"
    model.save(path)
    # Without custom_optimizers, newer Keras cannot find the class and says so; Keras 3.5
    # finds it through its module path (this test module) and loads it.
    try:
        keras_ring.load_model(path)
    except TypeError as e:
        assert "CustomSGD" in str(e)
    loaded = keras_ring.load_model(path, custom_optimizers=[CustomSGD],
                                   compression=keras_ring.Compression.fp16)
    assert is_wrapped(loaded.optimizer) and isinstance(loaded.optimizer, CustomSGD)
    log = CollectiveLog(monkeypatch)
    _train(loaded, loaded.optimizer, rank, size, seed=7)
    assert log.traced and all(dtypes == ["float16"] * len(dtypes) for _, _, dtypes in log.traced)


# --- a program written for Horovod, import swapped ------------------------------------------

def test_horovods_keras_mnist_example_runs_with_the_import_swapped(world, tmp_path):
    # The shape of Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py (generated
    # images instead of a download): tf.keras names, a model without an Input,
    # DistributedOptimizer with Horovod's arguments, compile(experimental_run_tf_function=
    # False), which Keras 3 no longer has, the three callbacks, a rank-0 checkpoint
    # (".keras": Keras 3 refuses the example's ".h5"), a repeated dataset, steps_per_epoch.
    hvd = keras_ring
    rank, size = world
    rng = np.random.default_rng(rank)
    images = rng.random((256, 12, 12)).astype("float32")
    labels = (images.mean(axis=(1, 2)) > 0.5).astype("int64")
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images[..., tf.newaxis], tf.float32), tf.cast(labels, tf.int64)))
    dataset = dataset.repeat().shuffle(256, seed=rank).batch(16)
    tf.keras.utils.set_random_seed(rank)  # different on every rank: the broadcast mends it
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(4, [3, 3], activation="relu"),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(8, activation="relu"),
        tf.keras.layers.Dense(2, activation="softmax"),
    ])
    scaled_lr = 0.01 * hvd.size()
    opt = hvd.DistributedOptimizer(tf.optimizers.Adam(scaled_lr), backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                  metrics=["accuracy"], experimental_run_tf_function=False)
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2),
    ]
    checkpoint = tmp_path / "checkpoint-{epoch}.keras"
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(str(checkpoint)))
    history = model.fit(dataset, steps_per_epoch=32 // hvd.size(), callbacks=callbacks,
                        epochs=3, verbose=0)
    ks.assert_same_on_all_ranks(ks.weights(model))
    losses = history.history["loss"]
    assert len(losses) == 3 and all(np.isfinite(losses)), losses
    # The metrics every rank logged are the averages, the same everywhere.
    ks.assert_same_on_all_ranks([np.array(losses)])
    assert (tmp_path / "checkpoint-3.keras").exists() == (rank == 0)


def test_horovods_custom_loop_mnist_example_runs_with_the_import_swapped(world, tmp_path):
    # The shape of Horovod's examples/tensorflow2/tensorflow2_mnist.py: a tf.function step
    # with DistributedGradientTape and a plain optimizer, the broadcast of model and
    # optimizer variables inside the first step, after its update (first_batch is a Python
    # bool: two traces), a tf.train.Checkpoint saved on rank 0. Keras 3's optimizer.variables
    # is a list where the example calls opt.variables().
    hvd = keras_ring
    rank, size = world
    rng = np.random.default_rng(rank)
    images = rng.random((128, 10, 10, 1)).astype("float32")
    labels = (images.mean(axis=(1, 2, 3)) > 0.5).astype("int64")
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().shuffle(128).batch(8)
    tf.keras.utils.set_random_seed(rank)
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(4, [3, 3], activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(2, activation="softmax"),
    ])
    loss = tf.losses.SparseCategoricalCrossentropy()
    opt = tf.optimizers.Adam(0.001 * hvd.size())
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss_value

    losses = [float(training_step(x, y, batch == 0))
              for batch, (x, y) in enumerate(dataset.take(24 // hvd.size()))]
    assert all(np.isfinite(losses)), losses
    ks.assert_same_on_all_ranks(ks.weights(model) + [v.numpy() for v in opt.variables])
    if hvd.rank() == 0:
        assert checkpoint.save(str(tmp_path / "ckpt"))


def test_horovods_elastic_custom_loop_example_runs_with_the_import_swapped(world):
    # tensorflow2_mnist_elastic.py's shape: one call without reducing builds the optimizer,
    # so keras_ring's state is first made when the step is traced again; the state class is
    # Horovod's TensorFlowKerasState.
    import keras_ring as hvd
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))  # the state's sync makes them equal
    optimizer = tf.optimizers.Adam(0.001 * hvd.size())
    loss = ks.loss()
    x, y = ks.classification_data(BATCH * 6, seed=rank)

    @tf.function
    def training_step(images, labels, allreduce=True):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss_value

    training_step(x[:BATCH], y[:BATCH], allreduce=False)

    @hvd.elastic.run
    def train(state):
        for state.batch in range(state.batch, 6):
            training_step(x[state.batch * BATCH:(state.batch + 1) * BATCH],
                          y[state.batch * BATCH:(state.batch + 1) * BATCH])
            if state.batch % 2 == 0:
                state.commit()

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)
    train(state)
    assert state.batch == 5
    ks.assert_same_on_all_ranks(ks.weights(model) + [v.numpy() for v in optimizer.variables])
