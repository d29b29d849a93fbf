"""Process sets: collectives among a subset of the ranks, each set on a runtime of its own.

Every rank runs every test; only a set's members call its collectives, the others check that
they are refused. The sets are the even and the odd ranks (at 2 ranks: {0} and {1}) and,
from 3 ranks on, the first two ranks (at 2 ranks they are the whole job, which is no new set).
"""

import re
import threading

import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr


@pytest.fixture(scope="module")
def sets(world):
    rank, size = world
    evens = kr.add_process_set([r for r in range(size) if r % 2 == 0])
    odds = kr.add_process_set(kr.ProcessSet([r for r in range(size) if r % 2 == 1]))
    pair = kr.add_process_set([0, 1]) if size > 2 else None
    yield evens, odds, pair
    for ps in (evens, odds, pair):
        assert ps is None or ps.process_set_id is None or kr.remove_process_set(ps)


def _mine(sets, rank):
    """The even/odd set this rank belongs to."""
    return sets[rank % 2]


def test_sets_know_their_ranks(world, sets):
    rank, size = world
    evens, odds, pair = sets
    assert odds.process_set_id == evens.process_set_id + 1
    assert evens.size() == (size + 1) // 2 and odds.size() == size // 2
    assert pair is None or (pair.process_set_id, pair.size()) == (odds.process_set_id + 1, 2)
    mine = _mine(sets, rank)
    assert mine.included() and not sets[1 - rank % 2].included()
    assert mine.rank() == mine.ranks.index(rank) and sets[1 - rank % 2].rank() is None
    assert kr.global_process_set.ranks == list(range(size)) and kr.global_process_set.size() == size
    ids = (0, evens.process_set_id, odds.process_set_id, odds.process_set_id + 100)
    included = tf.function(lambda: [kr.process_set_included_op(i) for i in ids])()
    assert [int(v) for v in included] == [1, int(rank % 2 == 0), int(rank % 2 == 1), -3]
    # size_op's first argument is a set's id, as in Horovod (it once took a name there and
    # answered the job's size for any set).
    sizes = tf.function(lambda: [kr.size_op(i) for i in ids[:3]])()
    assert [int(v) for v in sizes] == [size, evens.size(), odds.size()]
    assert int(kr.size_op(odds.process_set_id)) == odds.size()
    with pytest.raises(tf.errors.InvalidArgumentError, match="size_op: no process set has id"):
        kr.size_op(ids[3])


def test_a_functions_unnamed_collectives_are_counted_per_set(world, sets):
    # An unnamed collective in a graph carries its position among the graph's unnamed ones;
    # counted across sets, the odd ranks' extra collective in their set would put the global
    # allreduce at another position there than on the even ranks: a false mismatch.
    rank, size = world
    mine = _mine(sets, rank)

    @tf.function
    def step(x):
        for _ in range(1 + rank % 2):
            x = kr.allreduce(x, op=kr.Sum, process_set=mine)
        return kr.allreduce(x, op=kr.Sum)

    expected = sum(_mine(sets, r).size() ** (1 + r % 2) for r in range(size))
    assert step(tf.ones([2])).numpy().tolist() == [expected] * 2


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_allreduce_runs_among_the_set_only(world, sets, mode):
    rank, size = world
    mine = _mine(sets, rank)
    fn = (lambda x: kr.allreduce(x, op=kr.Sum, name="in_set", process_set=mine))
    fn = fn if mode == "eager" else tf.function(fn)
    out = fn(tf.constant([float(rank), 1.0]))
    assert out.numpy().tolist() == [float(sum(mine.ranks)), float(len(mine.ranks))]
    # Average divides by the set's size, not the job's.
    avg = kr.allreduce(tf.constant([float(rank)]), process_set=mine)
    assert avg.numpy().tolist() == [sum(mine.ranks) / len(mine.ranks)]


def test_every_collective_takes_a_process_set(world, sets):
    rank, size = world
    mine = _mine(sets, rank)
    n, me = mine.size(), mine.rank()
    gathered = kr.allgather(tf.fill([rank + 1], rank), process_set=mine)
    assert gathered.numpy().tolist() == [r for r in mine.ranks for _ in range(r + 1)]
    root = mine.ranks[-1]  # a global rank, as in Horovod
    assert kr.broadcast(tf.constant(rank), root, process_set=mine).numpy() == root
    part = kr.reducescatter(tf.ones([2 * n + 1, 2]) * rank, op=kr.Sum, process_set=mine)
    assert part.shape[0] == 2 + (me == 0) and np.all(part.numpy() == sum(mine.ranks))
    # Horovod's positional order: the set is the sixth argument (after name), and the
    # grouped form's fifth (it has no name).
    part = kr.reducescatter(tf.ones([n, 2]) * rank, "", kr.Compression.none, kr.Sum, None, mine)
    assert part.shape[0] == 1 and np.all(part.numpy() == sum(mine.ranks))
    parts = kr.grouped_reducescatter([tf.ones([n, 1]) * rank], "", kr.Compression.none, kr.Sum,
                                     mine)
    assert parts[0].shape[0] == 1 and np.all(parts[0].numpy() == sum(mine.ranks))
    out, received = kr.alltoall(tf.fill([n, 1], rank), splits=[1] * n, process_set=mine)
    assert out.numpy().ravel().tolist() == mine.ranks and received.numpy().tolist() == [1] * n
    assert kr.allgather_object(rank, process_set=mine) == mine.ranks
    assert kr.broadcast_object(f"from {root}" if rank == root else None, root,
                               process_set=mine) == f"from {root}"
    # An object that cannot be pickled is named by its global rank, as roots are.
    with pytest.raises(kr.CollectiveArgumentError, match=rf"the object of rank {root} \("):
        kr.allgather_object(threading.Lock() if rank == root else rank, process_set=mine)
    grouped = kr.grouped_allreduce([tf.constant([1.0]), tf.constant([rank], tf.int64)],
                                   op=kr.Sum, process_set=mine)
    assert grouped[0].numpy().tolist() == [n] and grouped[1].numpy().tolist() == [sum(mine.ranks)]
    var = tf.Variable(float(rank))
    kr.broadcast_variables([var], root, process_set=mine)
    assert var.numpy() == root
    kr.barrier(process_set=mine)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_a_root_outside_the_set_on_one_member_fails_on_every_member(world, sets, mode):
    """Its last member names a global rank of the other set (Horovod's roots are global):
    every member gets the error, naming that rank, instead of the others waiting for it."""
    rank, size = world
    mine, other = _mine(sets, rank), sets[1 - rank % 2]
    last = len(mine.ranks) - 1
    root = other.ranks[0] if mine.rank() == last else mine.ranks[0]
    call = lambda: kr.broadcast(tf.constant([rank]), root, name="w", process_set=mine)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"broadcast 'w': root_rank {other.ranks[0]} is not in the process "
                             rf"set \(root_rank is a global rank, as in Horovod\); rank "
                             rf"{last} of the set \(numbered within the set from 0\) passed it"):
        call() if mode == "eager" else tf.function(call)()
    # The set is still in step.
    assert kr.allreduce(tf.constant([1]), op=kr.Sum, process_set=mine).numpy()[0] == mine.size()


def test_set_and_global_collectives_interleave(world, sets):
    rank, size = world
    evens, _, pair = sets
    for step in range(3):
        total = kr.allreduce(tf.constant([step + rank]), op=kr.Sum, name=f"global{step}")
        assert total.numpy().tolist() == [size * step + sum(range(size))]
        if pair is not None and pair.included():
            both = kr.allreduce(tf.constant([rank + 10]), op=kr.Sum, process_set=pair)
            assert both.numpy().tolist() == [21]
        if evens.included():
            kr.barrier(process_set=evens)


def test_gradients_flow_within_the_set(world, sets):
    rank, _ = world
    mine = _mine(sets, rank)
    x = tf.Variable([1.0 + rank, 2.0])
    with tf.GradientTape() as tape:
        y = kr.allreduce(x * 3.0, op=kr.Sum, process_set=mine)
        gathered = kr.allgather(x, process_set=mine)
        loss = tf.reduce_sum(y) + tf.reduce_sum(gathered * 2.0)
    # allreduce's gradient is an allreduce of ones*3 over the set, allgather's the set's
    # average of 2s, sliced: both are set-sized sums or averages.
    expected = 3.0 * mine.size() + 2.0
    assert tape.gradient(loss, x).numpy().tolist() == [expected, expected]


def test_outsiders_and_bad_sets_are_refused(world, sets):
    rank, size = world
    other = sets[1 - rank % 2]
    with pytest.raises(ValueError, match=rf"rank {rank} is not in ProcessSet"):
        kr.allreduce(tf.ones([1]), process_set=other)
    with pytest.raises(ValueError, match="has not been added"):
        kr.allgather(tf.ones([1]), process_set=kr.ProcessSet([0]))
    # "root_rank 0 on rank 0 of the process set" read as the global rank 0 for set [1].
    mine = _mine(sets, rank)
    with pytest.raises(kr.CollectiveArgumentError, match=re.escape(
            f"root_rank {other.ranks[0]} is not in the process set (root_rank is a global rank, "
            "as in Horovod); rank 0 of the set (numbered within the set from 0) passed it")):
        kr.broadcast(tf.ones([1]), other.ranks[0], process_set=mine)
    with pytest.raises(ValueError, match="exists already"):
        kr.add_process_set([0, 1])
    with pytest.raises(ValueError, match="ranks disagree about the set") as info:
        kr.add_process_set([rank])
    assert "rank 0 passed [0], rank 1 passed [1]" in str(info.value)  # the same on every rank
    with pytest.raises(ValueError, match="not a non-empty subset"):
        kr.add_process_set([0, size])
    with pytest.raises(ValueError, match="distinct"):
        kr.ProcessSet([0, 0])
    with pytest.raises(TypeError, match="must be a keras_ring.ProcessSet"):
        kr.allreduce(tf.ones([1]), process_set=[0, 1])


def test_a_mismatch_inside_a_set_fails_its_members(world, sets):
    rank, _ = world
    pair = sets[2]
    if pair is not None and pair.included():
        with pytest.raises(kr.CollectiveMismatchError, match="shape mismatch"):
            kr.allreduce(tf.ones([1 + rank]), name="pair_mismatch", process_set=pair)
        # The set's runtime goes on.
        assert kr.allreduce(tf.ones([1]), op=kr.Sum, process_set=pair).numpy().tolist() == [2.0]
    # And the global one was never involved.
    assert kr.allreduce(tf.ones([1]), op=kr.Sum).numpy().tolist() == [kr.size()]


def test_removed_sets_are_gone_and_can_be_added_again(world, sets):
    rank, size = world
    odds = sets[1]
    old = odds.process_set_id
    assert kr.remove_process_set(odds) and odds.process_set_id is None
    assert not kr.remove_process_set(odds) and not kr.remove_process_set(kr.global_process_set)
    with pytest.raises(ValueError, match="has not been added"):
        kr.allreduce(tf.ones([1]), process_set=odds)
    assert kr.add_process_set(odds) is odds and odds.process_set_id > old
    if odds.included():
        out = kr.allreduce(tf.ones([1]) * 5, op=kr.Sum, process_set=odds)
        assert out.numpy().tolist() == [5.0 * odds.size()]


def test_init_with_process_sets(world, sets):
    rank, size = world
    for ps in sets:
        assert ps is None or kr.remove_process_set(ps)
    stale = kr.add_process_set([0])
    kr.shutdown()
    last = kr.ProcessSet([size - 1])
    kr.init(process_sets=[last])
    assert last.process_set_id > stale.process_set_id and last.size() == 1
    with pytest.raises(ValueError, match="is not registered"):
        kr.allreduce(tf.ones([1]), process_set=stale)
    if last.included():
        out = kr.allreduce(tf.constant([rank]), op=kr.Sum, process_set=last)
        assert out.numpy().tolist() == [size - 1]
    assert kr.remove_process_set(last)
    # Horovod's init(process_sets="dynamic"): no sets now, added later as always here.
    kr.shutdown()
    kr.init(process_sets="dynamic")
    later = kr.add_process_set([size - 1])  # not the whole job, which exists already
    if later.included():
        assert kr.allreduce(tf.constant([1]), op=kr.Sum, process_set=later).numpy() == [1]
    assert kr.remove_process_set(later)
