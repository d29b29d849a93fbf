"""fit and train_on_batch check that the ranks train the same weights (keras_ring/_weight_check.py).

Ranks that start from different weights would otherwise train side by side for ever: the
averaged gradients move each rank's weights alike. The weights are compared before the first
step; where they differ, again before the second (a broadcast after the first batch mends
them), and only then is it an error.
"""

import re
import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring as kr
from keras_ring.callbacks import BroadcastGlobalVariablesCallback
from keras_ring.errors import WeightMismatchError

from tests.parallel import keras_support as ks

BATCH = 4


class Steps(keras.callbacks.Callback):
    """Counts the training batches begun and ended."""

    def __init__(self):
        super().__init__()
        self.begun = self.ended = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.begun += 1

    def on_train_batch_end(self, batch, logs=None):
        self.ended += 1


class BroadcastAfterFirstBatch(keras.callbacks.Callback):
    """Horovod's older callback: the first step runs on each rank's own weights, then the
    root's weights and optimizer state replace them."""

    def __init__(self):
        super().__init__()
        self.done = False

    def on_train_batch_end(self, batch, logs=None):
        if not self.done:
            kr.broadcast_variables(self.model.variables + self.model.optimizer.variables, 0)
            self.done = True


def _compiled(seed: int, optimizer=None) -> keras.Model:
    model = ks.mlp(seed)
    model.compile(optimizer=optimizer or kr.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss())
    return model


def _data(rank: int):
    x, y = ks.classification_data(8 * BATCH, seed=rank)
    return x, y


def _expected_message(size: int) -> str:
    others = ", ".join(str(r) for r in range(1, size))
    return f"differ between rank 0 and rank(s) {others}, also after the first step."


def test_ranks_that_start_apart_fail_on_every_rank_before_the_second_step(world):
    rank, size = world
    model = _compiled(ks.rank_seed(rank))  # no broadcast: each rank its own initial weights
    steps = Steps()
    x, y = _data(rank)
    with pytest.raises(WeightMismatchError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[steps])
    assert (steps.begun, steps.ended) == (2, 1)  # one step done, the second refused
    message = str(info.value)
    assert _expected_message(size) in message, message
    # The kernels differ, the zero-initialised biases do not: named, and counted.
    kernels = [w.path for w in model.trainable_weights if "kernel" in w.path]
    assert f"2 of 4 trainable weights ('{kernels[0]}', '{kernels[1]}')" in message, message
    assert "BroadcastGlobalVariablesCallback(0)" in message
    assert isinstance(info.value, kr.WeightMismatchError) and isinstance(info.value, ValueError)
    assert info.value.rank == 1 and info.value.reason in message
    # Nothing broke: the job goes on, and a broadcast mends the model.
    kr.broadcast_variables(model.variables, root_rank=0)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    ks.assert_same_on_all_ranks(ks.weights(model))


def test_a_fit_of_one_step_that_starts_apart_warns_as_its_epoch_ends(world):
    # No second step to fail on: every rank warns at the epoch's end, and the next step fails
    # unless the program gave every rank the same weights meanwhile.
    rank, size = world
    x, y = _data(rank)
    model = _compiled(ks.rank_seed(rank))
    with pytest.warns(UserWarning, match=re.escape(_expected_message(size)) +
                      ".*No second step came to fail on"):
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    with pytest.raises(WeightMismatchError, match=re.escape(_expected_message(size))):
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    # Mended after the one step (Horovod's elastic example copies rank 0's state so): the
    # next fit trains on.
    model = _compiled(ks.rank_seed(rank))
    with pytest.warns(UserWarning, match="No second step came to fail on"):
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    kr.broadcast_variables(model.variables + model.optimizer.variables, 0)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    ks.assert_same_on_all_ranks(ks.weights(model))
    # A broadcast after that one batch mends them before the epoch ends: nothing to say.
    model = _compiled(ks.rank_seed(rank))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*No second step")
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[BroadcastAfterFirstBatch()])
    ks.assert_same_on_all_ranks(ks.weights(model))


def test_train_on_batch_is_checked_too(world):
    rank, size = world
    model = _compiled(ks.rank_seed(rank))
    x, y = _data(rank)
    model.train_on_batch(x[:BATCH], y[:BATCH])
    with pytest.raises(WeightMismatchError, match=re.escape(_expected_message(size))):
        model.train_on_batch(x[:BATCH], y[:BATCH])


def test_the_same_start_passes_however_it_is_reached(world):
    rank, _ = world
    x, y = _data(rank)
    # The callback, a broadcast after the first batch, or the same seed on every rank.
    for seed, callbacks in [(ks.rank_seed(rank), [BroadcastGlobalVariablesCallback(0)]),
                            (ks.rank_seed(rank), [BroadcastAfterFirstBatch()]),
                            (7, [])]:
        model = _compiled(seed)
        steps = Steps()
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=callbacks + [steps])
        assert steps.ended == 16
        ks.assert_same_on_all_ranks(ks.weights(model))


class OneRankDriftsByAnUlp(keras.callbacks.Callback):
    """Stands in for updates that are not bit-identical across ranks (a GPU's atomic
    scatter-adds, a norm summed by another number of threads): rank 1's weights move by one
    unit in the last place after the first step."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0 and kr.rank() == 1:
            for w in self.model.trainable_weights:
                w.assign(np.nextafter(w.numpy(), np.inf))


def test_ranks_that_start_equal_are_not_compared_again(world):
    rank, size = world
    model = _compiled(ks.rank_seed(rank))
    x, y = _data(rank)
    steps = Steps()
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[
        BroadcastGlobalVariablesCallback(0), OneRankDriftsByAnUlp(), steps])
    assert steps.ended == 16
    drift = kr.allgather(model.layers[0].kernel.value[np.newaxis], name="drifted").numpy()
    assert (drift[1] != drift[0]).any() and np.allclose(drift[1], drift[0], rtol=1e-5)


def test_a_rank_with_a_single_batch_may_join_while_the_others_train_on(world):
    # Uneven shards: rank 0 has one batch, then joins; nothing of the check is left to run
    # (the weights compared equal before the first step), so the others' steps go on.
    rank, size = world
    model = _compiled(ks.rank_seed(rank))
    kr.broadcast_variables(model.variables, root_rank=0)
    x, y = _data(rank)
    for b in range(1 if rank == 0 else 3):
        model.train_on_batch(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH])
    last = kr.join()
    assert last != 0 or size == 1


def _assert_only_the_local_layer_differs(model, local, size):
    """The shared layer agrees; the local one kept each rank's own weights."""
    ks.assert_same_on_all_ranks(ks.weights(model)[2:])
    kernels = kr.allgather(local.kernel.value[np.newaxis], name="local_kernels").numpy()
    assert all((kernels[r] != kernels[0]).any() for r in range(1, size))


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_local_layers_may_differ(world, frozen):
    # Frozen weights are compared too, but not those of a local layer: a frozen per-rank
    # head (or LoRA's frozen kernel inside one) differs by design.
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    local = model.layers[0]
    local.trainable = not frozen
    optimizer = kr.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[local])
    model.compile(optimizer=optimizer, loss=ks.loss())
    x, y = _data(rank)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[
        BroadcastGlobalVariablesCallback(0, local_variables=local.weights)])
    _assert_only_the_local_layer_differs(model, local, size)


def test_a_model_compiled_again_without_keras_ring_is_not_checked(world):
    rank, size = world
    model = _compiled(ks.rank_seed(rank))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=ks.loss())  # each rank alone
    x, y = _data(rank)
    steps = Steps()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[steps])
    assert steps.ended == 8
    kernels = kr.allgather(model.layers[0].kernel.value[np.newaxis], name="own_kernels").numpy()
    assert all((kernels[r] != kernels[0]).any() for r in range(1, size))


def test_off_with_the_variable_and_on_again_after_each_init(world, monkeypatch):
    rank, size = world
    model = _compiled(ks.rank_seed(rank))
    x, y = _data(rank)
    monkeypatch.setenv("KERAS_RING_CHECK_WEIGHTS", "0")
    kr.shutdown()
    kr.init()
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # unchecked: trains apart
    finally:
        monkeypatch.delenv("KERAS_RING_CHECK_WEIGHTS")
        kr.shutdown()
        kr.init()
    # A new init() checks the same model again, before its second step since then.
    steps = Steps()
    with pytest.raises(WeightMismatchError, match=re.escape(_expected_message(size))):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[steps])
    assert steps.ended == 1


# --- custom training steps (keras_ring/_step_check.py) ---------------------------------------

def _custom_step(model, optimizer, path, traced, broadcast_first, tape_options=None):
    """A custom loop's step as Horovod's TF2 example writes it; ``path``: who reduces (a
    DistributedGradientTape, or a wrapped optimizer under a plain tape)."""
    loss_fn = ks.loss()

    def step(x, y, first):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if path == "tape":
            tape = kr.DistributedGradientTape(tape, **(tape_options or {}))
        grads = tape.gradient(loss, model.trainable_variables)
        # With accumulation the passes that do not update get zeros: plain SGD keeps still.
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first and broadcast_first:
            kr.broadcast_variables(model.variables, root_rank=0)
            kr.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    return tf.function(step) if traced else step


def _run_steps(step, rank, count):
    x, y = _data(rank)
    done = 0
    for b in range(count):
        step(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH], b == 0)
        done += 1
    return done


def _model_and_optimizer(seed, path):
    """A model, and the optimizer its step applies: wrapped where it is the one to reduce."""
    optimizer = keras.optimizers.SGD(0.1)
    return ks.mlp(seed), kr.wrap(optimizer) if path == "optimizer" else optimizer


PATHS = [("tape", False), ("tape", True), ("optimizer", False), ("optimizer", True)]
PATH_IDS = ["tape-eager", "tape-traced", "optimizer-eager", "optimizer-traced"]


@pytest.mark.parametrize("path,traced", PATHS, ids=PATH_IDS)
def test_a_custom_loop_that_never_broadcasts_fails_on_every_rank_in_its_second_step(
        world, path, traced):
    rank, size = world
    model, optimizer = _model_and_optimizer(ks.rank_seed(rank), path)
    step = _custom_step(model, optimizer, path, traced, broadcast_first=False)
    x, y = _data(rank)
    step(x[:BATCH], y[:BATCH], False)  # the first step: a broadcast after it would mend them
    with pytest.raises(WeightMismatchError) as info:
        step(x[BATCH:2 * BATCH], y[BATCH:2 * BATCH], False)
    message = str(info.value)
    assert _expected_message(size) in message, message
    where = ("in keras_ring.DistributedGradientTape.gradient" if path == "tape"
             else f"in the apply of wrapped optimizer '{optimizer.name}'")
    kernels = [w.path for w in model.trainable_weights if "kernel" in w.path]
    assert f"{where}, 2 of 4 trainable weights ('{kernels[0]}', '{kernels[1]}')" in message
    assert "broadcast_variables(model.variables, root_rank=0)" in message
    assert info.value.rank == 1 and "\\'" not in message and not message.endswith("]")


@pytest.mark.parametrize("path,traced", PATHS, ids=PATH_IDS)
def test_horovods_broadcast_inside_the_first_step_passes_and_is_not_compared_again(
        world, path, traced):
    rank, _ = world
    model, optimizer = _model_and_optimizer(ks.rank_seed(rank), path)
    step = _custom_step(model, optimizer, path, traced, broadcast_first=True)
    assert _run_steps(step, rank, 2) == 2
    ks.assert_same_on_all_ranks(ks.weights(model))
    from keras_ring import _step_check
    ids = {id(w) for w in model.trainable_weights}
    checks = [c for key, c in _step_check._CHECKS.items() if set(key[2]) & ids]
    assert checks and all(c.settled for c in checks)  # the host knows: no read per step
    # Settled: rank 1 drifting by an ulp (updates need not be bit-identical) is not an error.
    if rank == 1:
        for w in model.trainable_weights:
            w.assign(np.nextafter(w.numpy(), np.inf))
    x, y = _data(rank)
    for b in range(2, 5):
        step(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH], False)


def _first_traced_without_reducing(model, path):
    """Horovod's elastic TF2 examples' step: called once with ``allreduce=False`` to build the
    optimizer, so keras_ring's state is first made in a later trace of the function."""
    plain = keras.optimizers.SGD(0.1)
    reducing = kr.wrap(keras.optimizers.SGD(0.1)) if path == "optimizer" else plain
    options = {"backward_passes_per_step": 2} if path == "accumulating_tape" else {}
    loss_fn = ks.loss()

    @tf.function
    def step(x, y, allreduce):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if allreduce and path != "optimizer":
            tape = kr.DistributedGradientTape(tape, **options)
        grads = tape.gradient(loss, model.trainable_variables)
        (reducing if allreduce else plain).apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


@pytest.mark.parametrize("path", ["tape", "optimizer", "accumulating_tape"])
def test_a_step_first_traced_without_reducing_reduces_and_checks_when_traced_again(world, path):
    rank, size = world
    x, y = _data(rank)
    model = ks.mlp(ks.rank_seed(rank))
    step = _first_traced_without_reducing(model, path)
    step(x[:BATCH], y[:BATCH], False)
    kr.broadcast_variables(model.variables, root_rank=0)
    for b in range(1, 5):
        step(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH], True)
    ks.assert_same_on_all_ranks(ks.weights(model))

    apart = ks.mlp(ks.rank_seed(rank))  # never broadcast: the check made in that trace fires
    step = _first_traced_without_reducing(apart, path)
    step(x[:BATCH], y[:BATCH], False)
    with pytest.raises(WeightMismatchError, match=re.escape(_expected_message(size))):
        for b in range(1, 5):
            step(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH], True)


def test_accumulated_passes_may_differ_until_their_first_update(world):
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    step = _custom_step(model, optimizer, "tape", True, broadcast_first=False,
                        tape_options={"backward_passes_per_step": 2})
    x, y = _data(rank)
    step(x[:BATCH], y[:BATCH], False)  # pass 1 of the first update
    step(x[BATCH:2 * BATCH], y[BATCH:2 * BATCH], False)  # pass 2: the update
    kr.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
    assert _run_steps(step, rank, 4) == 4  # equal now: settled
    ks.assert_same_on_all_ranks(ks.weights(model))

    apart = ks.mlp(ks.rank_seed(rank))
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(apart.trainable_variables)
    step = _custom_step(apart, optimizer, "tape", True, broadcast_first=False,
                        tape_options={"backward_passes_per_step": 2})
    step(x[:BATCH], y[:BATCH], False)
    step(x[BATCH:2 * BATCH], y[BATCH:2 * BATCH], False)
    with pytest.raises(WeightMismatchError, match=re.escape(_expected_message(size))):
        step(x[2 * BATCH:3 * BATCH], y[2 * BATCH:3 * BATCH], False)


def test_a_custom_loop_with_local_layers_may_differ_there(world):
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    local = model.layers[0]
    kr.broadcast_variables(model.layers[1].weights, root_rank=0)
    optimizer = keras.optimizers.SGD(0.1)
    loss_fn = ks.loss()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = kr.PartialDistributedGradientTape(tape, local_layers=[local])
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    x, y = _data(rank)
    for b in range(3):
        step(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH])
    _assert_only_the_local_layer_differs(model, local, size)


def test_fit_does_not_add_the_custom_step_check_to_its_step(world):
    from keras_ring import _step_check

    rank, _ = world
    model = _compiled(ks.rank_seed(rank))
    x, y = _data(rank)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    ids = {id(v) for v in model.trainable_variables}
    assert not [key for key in _step_check._CHECKS if set(key[2]) & ids]


def _conditionals(step, rank) -> int:
    x, y = _data(rank)
    graph = step.get_concrete_function(x[:BATCH], y[:BATCH], False).graph
    return sum(op.type in ("If", "StatelessIf") for op in graph.get_operations())


@pytest.mark.parametrize("path", ["tape", "optimizer"])
def test_a_step_traced_on_equal_weights_gets_nothing_and_one_traced_apart_a_check(world, path):
    rank, _ = world
    steps = []
    for seed in (7, ks.rank_seed(rank)):  # equal on every rank, then each rank its own
        model, optimizer = _model_and_optimizer(seed, path)
        steps.append(_custom_step(model, optimizer, path, True, broadcast_first=False))
    assert _conditionals(steps[0], rank) == 0  # settled while tracing: nothing per step
    assert _conditionals(steps[1], rank) == 1  # compared each time it runs, until settled


def _collectives_in_program_order(graph) -> list:
    """The step's ops that run collectives (conditionals whose branches do included), in the
    order they were made."""
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}

    def called(attrs) -> list[str]:  # the functions a node or op runs (branches, bodies)
        return [a.func.name for a in attrs if a.func.name]

    def in_function(name: str) -> bool:
        nodes = library[name].node_def if name in library else []
        return any(n.op.startswith("KerasRing") and n.op != "KerasRingTimelineMark"
                   or any(in_function(f) for f in called(n.attr.values())) for n in nodes)

    def runs_collectives(op) -> bool:
        if op.type.startswith("KerasRing"):
            return op.type != "KerasRingTimelineMark"
        return any(in_function(f) for f in called(op.node_def.attr.values()))

    return [op for op in graph.get_operations() if runs_collectives(op)]


def _runs_after(later, earlier) -> bool:
    seen, todo = set(), [later]
    while todo:
        op = todo.pop()
        for before in [t.op for t in op.inputs] + list(op.control_inputs):
            if before is earlier:
                return True
            if before not in seen:
                seen.add(before)
                todo.append(before)
    return False


@pytest.mark.parametrize("path", ["tape", "optimizer", "accumulating_tape"])
def test_two_reductions_in_one_step_keep_their_checks_in_program_order(world, path):
    """A GAN's step as Horovod's TF2 example writes it: two lists of weights reduced in one
    traced step, each with its own check (each rank's own weights, broadcast after the first
    step). A check is a conditional that reads variables, which TensorFlow orders only against
    those variables' users: the two checks ran in either order, and the ranks' allgathers
    paired with each other's (a shape mismatch, 4 of 6 runs) until every collective in a
    function wrote one variable before and after it (keras_ring/ops/wrappers.py)."""
    rank, _ = world
    keras.utils.set_random_seed(ks.rank_seed(rank))
    first = keras.Sequential([keras.Input((ks.FEATURES,)), keras.layers.Dense(3)])
    second = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5), keras.layers.Dense(1)])
    wrap = kr.wrap if path == "optimizer" else (lambda o: o)
    optimizers = [wrap(keras.optimizers.SGD(0.1)), wrap(keras.optimizers.SGD(0.1))]
    options = {"backward_passes_per_step": 2} if path == "accumulating_tape" else {}

    @tf.function
    def step(x, first_batch):
        with tf.GradientTape() as tape_a, tf.GradientTape() as tape_b:
            out = second(first(x))
            losses = [tf.reduce_mean(out ** 2), tf.reduce_mean((out - 1) ** 2)]
        for tape, loss, model, optimizer in zip((tape_a, tape_b), losses, (first, second),
                                                optimizers):
            if path != "optimizer":
                tape = kr.DistributedGradientTape(tape, **options)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            kr.broadcast_variables(first.variables + second.variables, root_rank=0)
            for optimizer in optimizers:
                kr.broadcast_variables(optimizer.variables, root_rank=0)
        return losses[0]

    x, _ = _data(rank)
    graph = step.get_concrete_function(x[:BATCH], True).graph
    ordered = _collectives_in_program_order(graph)
    assert sum(op.type in ("If", "StatelessIf") for op in ordered) >= 2, ordered
    for earlier, later in zip(ordered, ordered[1:]):
        assert _runs_after(later, earlier), (earlier.name, later.name)
    for b in range(4):
        step(x[b * BATCH:(b + 1) * BATCH], b == 0)
    ks.assert_same_on_all_ranks(ks.weights(first) + ks.weights(second))


def test_a_users_conditional_broadcast_keeps_its_place_before_a_later_allreduce(world):
    """Horovod's TF2 step with the first-batch flag as a tensor (autograph makes the broadcast
    a conditional, which reads and writes the weights) and the loss averaged after it, as
    programs log it. The allreduce of the loss has no path to the conditional but the
    collectives' order: ranks ran the two in either order (a broadcast against an allreduce,
    2 of 4 runs)."""
    rank, _ = world
    model = ks.mlp(ks.rank_seed(rank))
    optimizer = keras.optimizers.SGD(0.1)
    loss_fn = ks.loss()

    @tf.function
    def step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = kr.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            kr.broadcast_variables(model.variables, root_rank=0)
            kr.broadcast_variables(optimizer.variables, root_rank=0)
        return kr.allreduce(loss, name="loss")

    x, y = _data(rank)
    graph = step.get_concrete_function(x[:BATCH], y[:BATCH], tf.constant(True)).graph
    ordered = _collectives_in_program_order(graph)
    assert [op.type for op in ordered][-2:] == ["If", "KerasRingAllreduce"], ordered
    for earlier, later in zip(ordered, ordered[1:]):
        assert _runs_after(later, earlier), (earlier.name, later.name)
    losses = [step(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH],
                   tf.constant(b == 0)).numpy() for b in range(4)]
    ks.assert_same_on_all_ranks(ks.weights(model) + [np.array(losses)])


def test_a_nested_functions_call_keeps_its_place_before_a_later_allreduce(world):
    """A helper decorated with tf.function that broadcasts variables, called inside a step:
    its call op reads and writes those variables, so TensorFlow ordered it only against
    their users, not against the allreduce after it. The helper stays callable on its own
    (eagerly, or from another function): it captures the process's order variable, not the
    step's."""
    rank, size = world
    v = tf.Variable(np.array([1.0, 2.0], np.float32) * (rank + 1))

    @tf.function
    def sync():
        kr.broadcast_variables([v], root_rank=0)
        return tf.constant(0)

    @tf.function
    def step(x):
        loss = tf.reduce_sum(v * x)
        sync()
        return kr.allreduce(loss, name="nested.loss")

    graph = step.get_concrete_function(tf.constant([1.0, 1.0])).graph
    ordered = _collectives_in_program_order(graph)
    assert [op.type for op in ordered] == ["StatefulPartitionedCall", "KerasRingAllreduce"]
    assert _runs_after(ordered[1], ordered[0])
    # The loss read each rank's own v before the broadcast: the mean of 3 * (rank + 1).
    assert step(tf.constant([1.0, 1.0])).numpy() == np.float32(3.0 * (size + 1) / 2)
    sync()  # on its own, eagerly
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    assert step(tf.constant([1.0, 1.0])).numpy() == np.float32(3.0)


def test_a_gradient_through_a_conditional_inside_another_or_a_loop(world):
    # The order variable reaches a nested body one graph at a time: cond's gradient expects a
    # body's captures from the graph just outside it (an AssertionError while tracing).
    rank, size = world
    v = tf.Variable(2.0)

    @tf.function(autograph=False)
    def nested(p, q):
        with tf.GradientTape() as tape:
            y = tf.cond(p, lambda: tf.cond(q, lambda: kr.allreduce(v * 3.0, op=kr.Sum,
                                                                   name="nested.cond"),
                                           lambda: v + 0.0),
                        lambda: v * 1.0)
        return y, tape.gradient(y, v)

    @tf.function(autograph=False)
    def looped():
        with tf.GradientTape() as tape:
            def body(i, x):
                return i + 1, tf.cond(i < 2, lambda: kr.allreduce(x * v, op=kr.Sum,
                                                                  name="looped"),
                                      lambda: x)
            _, y = tf.while_loop(lambda i, x: i < 3, body, [tf.constant(0), tf.constant(1.0)])
        return y, tape.gradient(y, v)

    @tf.function
    def summed(x):
        return kr.allreduce(x, op=kr.Sum, name="summed") * 2.0

    @tf.function
    def calls_in_a_loop(x):  # a nested function's gradient inside a loop's gradient
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, summed(y)),
                              [tf.constant(0), x])[1]
        return tape.gradient(y, x)

    graph = nested.get_concrete_function(tf.constant(True), tf.constant(True)).graph
    ordered = _collectives_in_program_order(graph)  # the conditional, then its gradient's
    assert [op.type for op in ordered] == ["If", "If"], ordered
    assert _runs_after(ordered[1], ordered[0])
    # Both write the order variable: the gradient's conditional is ordered by it, not by
    # chance of data (its collective needs nothing of the forward one's; ranks once ran the
    # two in either order when gradients were left out of the chain).
    from keras_ring.ops import wrappers
    order = [inner for outer, inner in graph.captures if outer is wrappers._ORDER[0].handle]
    assert len(order) == 1, order
    assert all(any(t is order[0] for t in op.inputs) for op in ordered)
    y, grad = nested(tf.constant(True), tf.constant(True))
    assert (y.numpy(), grad.numpy()) == (6.0 * size, 3.0 * size)
    assert calls_in_a_loop(tf.constant(1.0)).numpy() == (2.0 * size) ** 3
    y, grad = looped()  # y = (size * v)^2 after two rounds: d/dv = 2 size^2 v
    assert (y.numpy(), grad.numpy()) == ((2.0 * size) ** 2, 2.0 * size ** 2 * 2.0)


def _with_frozen_base(base_seed: int) -> keras.Model:
    """A base "pretrained" from ``base_seed`` and frozen, and a head from one seed."""
    keras.utils.set_random_seed(base_seed)
    base = keras.layers.Dense(8, activation="tanh", name="base")
    base.build((None, ks.FEATURES))
    base.trainable = False
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((ks.FEATURES,)), base, keras.layers.Dense(ks.CLASSES)])
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss())
    return model


def test_a_frozen_base_that_differs_by_rank_fails_before_the_second_step(world):
    # A pretrained base loaded on one rank only and frozen, without the broadcast: the
    # trainable head agreed, so each rank trained its head on its own base, silently
    # (probe P). Frozen weights are compared with the trainable ones.
    rank, size = world
    model = _with_frozen_base(ks.rank_seed(rank))
    x, y = _data(rank)
    with pytest.raises(WeightMismatchError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    message = str(info.value)
    assert _expected_message(size) in message, message
    # The base's kernel (its bias starts at zero everywhere).
    assert re.search(r"1 of 4 trainable and frozen weights \('[^']*base/kernel'\)",
                     message), message
    # The broadcast gives every rank the root's frozen base too, and the check passes.
    model = _with_frozen_base(ks.rank_seed(rank))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    ks.assert_same_on_all_ranks(ks.weights(model) + [w.numpy() for w in model.non_trainable_weights])


class HiddenOptimizerGan(keras.Model):
    """keras-io's GAN shape, but the generator's optimizer is a plain one the train_step
    reaches through a closure, not an attribute: keras_ring cannot see it."""

    def __init__(self, generator_optimizer):
        super().__init__()
        self.discriminator = keras.Sequential([keras.Input((ks.FEATURES,)), keras.layers.Dense(1)])
        self.generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(ks.FEATURES)],
                                          name="generator")
        self.d_optimizer = kr.wrap(keras.optimizers.SGD(0.05))
        self.step_generator = lambda grads: generator_optimizer.apply(
            grads, self.generator.trainable_weights)

    def train_step(self, data):
        real, _ = data
        noise = tf.random.normal([tf.shape(real)[0], 2], seed=kr.rank())
        with tf.GradientTape(persistent=True) as tape:
            fake = self.generator(noise)
            d_loss = tf.reduce_mean(self.discriminator(fake)) - tf.reduce_mean(
                self.discriminator(real))
            g_loss = -tf.reduce_mean(self.discriminator(fake))
        self.d_optimizer.apply(tape.gradient(d_loss, self.discriminator.trainable_weights),
                               self.discriminator.trainable_weights)
        self.step_generator(tape.gradient(g_loss, self.generator.trainable_weights))
        return {"d_loss": d_loss}


@pytest.mark.parametrize("epochs", [1, 2])
def test_weights_that_training_moves_apart_fail_at_the_epochs_end(world, epochs):
    # The weights agreed as fit began; the generator then trained on each rank's own
    # gradients, and fit returned on every rank with different models (probe P). Each
    # epoch's start and fit's end compare a digest of the weights.
    rank, size = world
    keras.utils.set_random_seed(3)
    model = HiddenOptimizerGan(keras.optimizers.SGD(0.05))
    model.compile()
    x, y = _data(rank)
    steps = Steps()
    with pytest.raises(WeightMismatchError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0,
                  callbacks=[BroadcastGlobalVariablesCallback(0), steps])
    message = str(info.value)
    assert "at the end of epoch 0 of model" in message, message
    assert re.search(r"\d of 4 trainable weights \('generator[^']*'", message), message
    assert "though they were equal when the fit began" in message, message
    assert steps.ended == len(x) // BATCH  # one epoch trained, the next refused
