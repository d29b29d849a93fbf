"""join(): ranks with less data join early and add zeros to the others' allreduces."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr
from tests.parallel import keras_support as ks


def test_joined_ranks_add_zeros_and_all_learn_the_last(world):
    rank, size = world
    # Rank r runs r + 1 allreduces (a small one completes inline, a large one on the ring).
    for step in range(rank + 1):
        small = kr.allreduce(tf.constant([1.0, 2.0]), op=kr.Sum, name="join.small")
        large = kr.allreduce(tf.fill([20000], 1.0), op=kr.Average, name="join.large")
        still = size - step  # ranks step..size-1 are still here, the others joined
        assert small.numpy().tolist() == [still, 2.0 * still]
        assert np.all(large.numpy() == still / size)
    assert kr.join() == size - 1
    # Everyone is back in step: an ordinary collective works.
    assert kr.allreduce(tf.constant([1.0]), op=kr.Sum).numpy().tolist() == [size]


def test_join_twice_in_a_row_and_at_once(world):
    assert kr.join() == kr.size() - 1  # all at the same collective: the highest rank
    assert kr.join() == kr.size() - 1


def test_what_cannot_take_zeros_fails_everywhere_while_ranks_have_joined(world):
    rank, size = world
    if rank == 0:
        with pytest.raises(kr.CollectiveArgumentError, match="rank.s. 0 have called keras_ring.join"):
            kr.join()
    else:
        with pytest.raises(kr.CollectiveArgumentError, match="only allreduce and grouped_allreduce"):
            kr.allgather(tf.constant([rank]), name="gather_while_joined")
    assert kr.join() == size - 1


def test_uneven_shards_train_with_a_tape_then_share_the_last_model(world):
    rank, size = world
    keras.utils.set_random_seed(7)
    model = ks.mlp(ks.rank_seed(0))
    optimizer = keras.optimizers.SGD(0.1)
    x, y = ks.classification_data(4 * (rank + 1), seed=rank)
    for k in range(rank + 1):  # rank r has r + 1 batches of 4
        with tf.GradientTape() as tape:
            loss = ks.loss()(y[4 * k:4 * k + 4], model(x[4 * k:4 * k + 4]))
        grads = kr.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
    last = kr.join()
    assert last == size - 1
    kr.broadcast_variables(model.variables, root_rank=last)
    ks.assert_same_on_all_ranks(ks.weights(model))
