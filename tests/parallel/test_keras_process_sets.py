"""Keras training inside process sets: two data-parallel groups (the even and the odd ranks)
train their own models side by side, as the stages of a hybrid program would. Each group must
end equal to one process training on the group's global batch, and the groups must not mix.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr
from tests.parallel import keras_support as ks

BATCH = 4
STEPS = 3


@pytest.fixture(scope="module")
def groups(world):
    """The even ranks' set and the odd ranks'."""
    _, size = world
    both = [kr.add_process_set([r for r in range(size) if r % 2 == parity]) for parity in (0, 1)]
    yield both
    for g in both:
        assert kr.remove_process_set(g)


@pytest.fixture
def group(world, groups):
    """This rank's set."""
    return groups[world[0] % 2]


def _group_data(group):
    """Each group its own data; its ranks shard it as one process with the group's batch."""
    n = group.size()
    x, y = ks.classification_data(n * BATCH * STEPS, seed=50 + group.ranks[0])
    return x, y, ks.shard(x, group.rank(), n, BATCH), ks.shard(y, group.rank(), n, BATCH)


def _reference(group, x, y):
    model = ks.mlp(ks.rank_seed(group.ranks[0]))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=ks.loss())
    model.fit(x, y, batch_size=group.size() * BATCH, epochs=1, shuffle=False, verbose=0)
    return ks.weights(model)


def test_fit_in_a_group_equals_one_process_with_the_group_batch(world, group):
    rank, _ = world
    x, y, x_mine, y_mine = _group_data(group)
    model = ks.mlp(ks.rank_seed(rank))  # differs per rank until the group's broadcast
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.1), process_set=group),
                  loss=ks.loss())
    history = model.fit(
        x_mine, y_mine, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
        callbacks=[kr.callbacks.BroadcastGlobalVariablesCallback(group.ranks[0], process_set=group),
                   kr.callbacks.MetricAverageCallback(process_set=group)])
    ks.assert_weights_close(ks.weights(model), _reference(group, x, y), atol=1e-6)
    # The averaged loss is the group's: equal on its ranks.
    losses = kr.allgather_object(history.history["loss"][-1], process_set=group)
    assert len(set(losses)) == 1
    # And the groups trained different models (their own data and seeds).
    firsts = kr.allgather_object(float(ks.weights(model)[0].ravel()[0]))
    assert firsts[0] != firsts[1]


def test_tape_in_a_group_averages_over_the_group(world, group):
    rank, _ = world
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(rank + 1))
    grad = kr.DistributedGradientTape(tape, process_set=group).gradient(loss, [w])[0]
    expected = np.mean([r + 1.0 for r in group.ranks])
    assert grad.numpy().tolist() == [expected, expected]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_tape_outside_its_set_keeps_the_local_gradients_as_horovods(world, groups, traced):
    # Horovod's tape returns a non-member's gradients as they are; this one raised an
    # allgather's "rank 1 is not in ProcessSet" error, naming a call the program never made.
    rank, _ = world
    other = groups[1 - rank % 2]
    w = tf.Variable([1.0, 2.0])

    def gradient():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * float(rank + 1))
        return kr.DistributedGradientTape(tape, process_set=other).gradient(loss, [w])[0]

    grad = tf.function(gradient)() if traced else gradient()
    assert grad.numpy().tolist() == [rank + 1.0] * 2  # its own, no collective


def test_keras_options_refuse_what_is_not_a_process_set(world, group):
    with pytest.raises(TypeError, match="process_set must be a keras_ring.ProcessSet"):
        kr.wrap(keras.optimizers.SGD(0.1), process_set=[0])
