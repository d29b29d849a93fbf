"""reducescatter, alltoall, the grouped forms and Horovod's other collectives, against numpy
references computed from every rank's inputs, eagerly and in tf.function."""

import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr
from tests.reference import (GATHER_DTYPES, OP_NAMES, REDUCE_DTYPES, assert_same, np_dtype,
                             rank_input, reduce_reference)

MODES = ["eager", "function"]


def _maybe_function(fn, mode):
    return fn if mode == "eager" else tf.function(fn)


def _my_rows(rows, size, rank):
    """Horovod's split, written out independently: the first rows % size ranks get one more."""
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    start = sum(counts[:rank])
    return start, counts[rank]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", OP_NAMES)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: d.name)
def test_reducescatter(world, dtype, op, mode):
    rank, size = world
    shape = (2 * size + 1, 3)  # rows that do not divide: the first rank gets one more
    inputs = [rank_input(dtype, shape, r, seed=21, op=op) for r in range(size)]
    fn = _maybe_function(lambda x: kr.reducescatter(x, op=getattr(kr, op), name=f"rs_{op}"), mode)
    out = fn(tf.constant(inputs[rank]))
    start, rows = _my_rows(shape[0], size, rank)
    assert out.dtype == dtype and out.shape == (rows, 3)
    assert_same(out.numpy(), reduce_reference(inputs, op, dtype)[start:start + rows])


@pytest.mark.parametrize("rows", [0, 1, 3, 64, 20001])
@pytest.mark.parametrize("mode", MODES)
def test_reducescatter_row_counts_and_scale_factors(world, rows, mode):
    # Fewer rows than ranks (empty parts), none at all, and parts spanning many segments.
    rank, size = world
    shape = (rows, 2, 2)
    inputs = [rank_input(tf.float64, shape, r, seed=rows) for r in range(size)]
    fn = _maybe_function(lambda x: kr.reducescatter(x, op=kr.Average, prescale_factor=0.5,
                                                    postscale_factor=3.0), mode)
    out = fn(tf.constant(inputs[rank]))
    start, mine = _my_rows(rows, size, rank)
    expected = reduce_reference(inputs, "Average", tf.float64, 0.5, 3.0)[start:start + mine]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-15)
    assert out.shape == (mine, 2, 2)


def test_reducescatter_sum_costs_one_collective_and_matches_allreduce_slice(world):
    rank, size = world
    x = tf.constant(rank_input(tf.int32, (5 * size + 2, 7), rank, seed=5))
    start, rows = _my_rows(x.shape[0], size, rank)
    assert_same(kr.reducescatter(x, op=kr.Sum).numpy(),
                kr.allreduce(x, op=kr.Sum).numpy()[start:start + rows])


def test_reducescatter_gradient_is_horovods(world):
    # Horovod: allgather of the upstream gradient, times size for Sum, times both factors.
    rank, size = world
    x = tf.constant(rank_input(tf.float32, (size + 1, 2), rank, seed=3))
    weights = tf.constant(np.arange(2 * (size + 1), dtype=np.float32).reshape(size + 1, 2))
    for op, factor in [(kr.Sum, size * 2.0 * 0.5), (kr.Average, 2.0 * 0.5)]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            part = kr.reducescatter(x, op=op, prescale_factor=2.0, postscale_factor=0.5)
            start, rows = _my_rows(size + 1, size, rank)
            loss = tf.reduce_sum(part * weights[start:start + rows])
        np.testing.assert_allclose(tape.gradient(loss, x).numpy(), weights.numpy() * factor)


def test_grouped_reducescatter(world):
    rank, size = world
    shapes = [(size, 3), (2 * size + 1,), (1, 4)]
    inputs = [[rank_input(tf.float32, s, r, seed=i) for r in range(size)]
              for i, s in enumerate(shapes)]
    outs = kr.grouped_reducescatter([tf.constant(x[rank]) for x in inputs], op=kr.Sum,
                                    name="grouped_rs")
    for shape, x, out in zip(shapes, inputs, outs):
        start, rows = _my_rows(shape[0], size, rank)
        assert_same(out.numpy(), reduce_reference(x, "Sum", tf.float32)[start:start + rows])


def _splits(size, sender):
    """Rows rank `sender` sends to each rank: uneven, with an empty one where there are two+."""
    return [0 if (sender + p) % 3 == 1 else (sender + 2 * p) % 4 + 1 for p in range(size)]


def _block(sender, receiver, rows, dtype):
    values = np.full((rows, 2), sender * 10 + receiver)
    if dtype == tf.bool:
        return ((values + np.arange(rows)[:, None]) % 2).astype(bool)
    return values.astype(np_dtype(dtype))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GATHER_DTYPES, ids=lambda d: d.name)
def test_alltoall_uneven_splits(world, dtype, mode):
    rank, size = world
    mine = _splits(size, rank)
    x = np.concatenate([_block(rank, p, mine[p], dtype) for p in range(size)])
    fn = _maybe_function(lambda t, s: kr.alltoall(t, splits=s, name="a2a"), mode)
    out, received = fn(tf.constant(x), tf.constant(mine, tf.int32))
    expected = np.concatenate([_block(p, rank, _splits(size, p)[rank], dtype) for p in range(size)])
    assert_same(out.numpy(), expected)
    assert_same(received.numpy(), np.array([_splits(size, p)[rank] for p in range(size)], np.int32))


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_equal_parts_without_splits(world, mode):
    rank, size = world
    rows = (rank + 1) * size  # ranks differ in rows; each divides by size
    x = np.arange(rows * 3, dtype=np.int64).reshape(rows, 3) + 1000 * rank
    out = _maybe_function(lambda t: kr.alltoall(t), mode)(tf.constant(x))
    expected = np.concatenate([
        (np.arange((p + 1) * size * 3, dtype=np.int64).reshape(-1, 3) + 1000 * p)
        [rank * (p + 1):(rank + 1) * (p + 1)] for p in range(size)])
    assert_same(out.numpy(), expected)


def test_alltoall_large_blocks_cross_segments(world):
    rank, size = world
    splits = [70000 + 13 * p + rank for p in range(size)]
    x = np.concatenate([np.full((splits[p], 4), rank * size + p, np.float32) for p in range(size)])
    out, received = kr.alltoall(tf.constant(x), splits=splits)
    want = [70000 + 13 * rank + p for p in range(size)]
    assert received.numpy().tolist() == want
    expected = np.concatenate([np.full((want[p], 4), p * size + rank, np.float32)
                               for p in range(size)])
    assert_same(out.numpy(), expected)


def test_alltoall_gradient_sends_rows_back(world):
    rank, size = world
    mine = _splits(size, rank)
    x = tf.constant(np.arange(sum(mine) * 2, dtype=np.float64).reshape(-1, 2) + 100 * rank)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out, _ = kr.alltoall(x, splits=mine)
        # A weight per received row that identifies it: (sender, row within the block).
        weights = np.concatenate([np.full((_splits(size, p)[rank], 2), 1.0 + p + 10 * rank)
                                  for p in range(size)])
        loss = tf.reduce_sum(out * weights)
    grad = tape.gradient(loss, x).numpy()
    # Rows this rank sent to rank p came back weighted by rank p's weight for sender `rank`.
    expected = np.concatenate([np.full((mine[p], 2), 1.0 + rank + 10 * p) for p in range(size)])
    assert_same(grad, expected)


def test_alltoall_bad_splits_fail_on_every_rank_naming_the_rank(world):
    rank, size = world
    splits = [1] * size if rank != size - 1 else [1] * (size - 1) + [5]  # last rank: sum off
    with pytest.raises(kr.CollectiveArgumentError, match=rf"rank {size - 1} passed splits"):
        kr.alltoall(tf.zeros([size, 2]), splits=splits, name="bad_splits")
    with pytest.raises(kr.CollectiveArgumentError, match=r"rank 0 has 1 rows, which do not split"):
        kr.alltoall(tf.zeros([1 if rank == 0 else size, 2]), name="indivisible")
    # And the ring goes on.
    assert kr.alltoall(tf.fill([size, 1], rank)).numpy().ravel().tolist() == list(range(size))


def test_alltoall_and_reducescatter_shape_mismatch_is_an_error_everywhere(world):
    rank, size = world
    with pytest.raises(kr.CollectiveMismatchError, match="shape mismatch"):
        kr.alltoall(tf.zeros([size, 2 + (rank == size - 1)]), name="a2a_rows")
    with pytest.raises(kr.CollectiveMismatchError, match="shape mismatch"):
        kr.reducescatter(tf.zeros([size + (rank == size - 1), 2]), name="rs_rows")


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("everywhere", [True, False], ids=["every-rank", "one-rank"])
@pytest.mark.parametrize("collective", ["reducescatter", "alltoall"])
def test_a_scalar_is_refused_on_every_rank(world, collective, everywhere, mode):
    # A scalar on one rank only was refused there alone: the others waited for it.
    rank, size = world
    odd = size - 1
    tensor = tf.constant(1.0) if everywhere or rank == odd else tf.zeros([size])
    run = getattr(kr, collective)
    with pytest.raises(kr.CollectiveArgumentError) as info:
        (tf.function(run) if mode == "graph" else run)(tensor)
    who = 0 if everywhere else odd
    assert (f"rank {who} passed a scalar; {collective} splits the first dimension, so it "
            "needs a tensor of rank >= 1 on every rank") in str(info.value), info.value
    assert info.value.rank == who


def test_splits_of_another_type_and_unsupported_dtypes_are_refused_before_anything_is_sent(
        world):
    with pytest.raises(TypeError, match="splits must be integers"):
        kr.alltoall(tf.zeros([2]), splits=tf.constant([1.0, 1.0]))
    with pytest.raises(TypeError, match="does not support dtype"):
        kr.reducescatter(tf.constant([True, False]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", ["negative", "wide"])
def test_splits_that_are_no_row_counts_on_one_rank_fail_on_every_rank(world, mode, bad):
    """The last rank's splits sum to its rows but one is negative, or beyond int32 (cast, it
    would read 1): every rank gets the error naming it, as for splits that do not add up."""
    rank, size = world
    if rank < size - 1:
        splits = tf.ones([size], tf.int64)
    elif bad == "negative":
        splits = tf.constant([2, -1] + [1] * (size - 2), tf.int64)
    else:
        splits = tf.constant([2**32 + 1] + [0] * (size - 1), tf.int64)
    shown = "[2, -1" if bad == "negative" else "[2147483647, 0"
    fn = _maybe_function(lambda s: kr.alltoall(tf.zeros([size, 2]), splits=s, name="a2a"), mode)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"alltoall 'a2a': rank {size - 1} passed splits \{shown}"):
        fn(splits)
    assert kr.alltoall(tf.fill([size, 1], rank)).numpy().ravel().tolist() == list(range(size))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allgather(world, mode):
    rank, size = world
    tensors = [np.full((rank + 1, 2), rank, np.int32), np.full((1,), rank == 0),
               np.arange(rank, dtype=np.float32)]
    outs = _maybe_function(lambda *t: kr.grouped_allgather(list(t), name="gag"), mode)(
        *[tf.constant(t) for t in tensors])
    assert_same(outs[0].numpy(), np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(size)]))
    assert_same(outs[1].numpy(), np.array([r == 0 for r in range(size)]))
    assert_same(outs[2].numpy(), np.concatenate([np.arange(r, dtype=np.float32) for r in range(size)]))


def test_grouped_allreduce_takes_indexed_slices_among_dense_tensors(world):
    rank, size = world
    dense = tf.constant([float(rank), 1.0])
    sparse = tf.IndexedSlices(tf.constant([[rank + 1.0, 2.0]]), tf.constant([rank % 3]),
                              dense_shape=tf.constant([3, 2]))
    out = kr.grouped_allreduce([dense, sparse, dense * 2], op=kr.Sum, name="mixed")
    assert isinstance(out[1], tf.IndexedSlices)
    expected = np.zeros((3, 2))
    for r in range(size):
        expected[r % 3] += [r + 1.0, 2.0]
    np.testing.assert_allclose(tf.convert_to_tensor(out[1]).numpy(), expected)
    total = sum(range(size))
    np.testing.assert_allclose(out[0].numpy(), [total, size])
    np.testing.assert_allclose(out[2].numpy(), [2 * total, 2 * size])


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_in_place(world, mode):
    rank, _ = world
    variables = [tf.Variable([rank, rank + 1.0]), tf.Variable(rank * 2)]
    values = _maybe_function(lambda: kr.broadcast_(variables, root_rank=1 % kr.size()), mode)()
    root = 1 % kr.size()
    assert variables[0].numpy().tolist() == [root, root + 1.0] and int(variables[1].numpy()) == 2 * root
    assert [v.numpy().tolist() for v in values] == [[root, root + 1.0], 2 * root]


def test_broadcast_global_variables_in_a_tf1_graph(world):
    rank, _ = world
    with tf.Graph().as_default():
        var = tf.compat.v1.get_variable("w", initializer=tf.constant([rank, -rank], tf.float32))
        bcast = kr.broadcast_global_variables(0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(bcast)
            assert sess.run(var).tolist() == [0.0, 0.0]
    with pytest.raises(RuntimeError, match="tf.compat.v1 graph mode"):
        kr.broadcast_global_variables(0)


def test_graph_ops_read_the_topology_when_they_run(world):
    rank, size = world

    @tf.function
    def topology():
        return kr.rank_op(), kr.size_op(), kr.local_rank_op(), kr.local_size_op()

    assert [int(v) for v in topology()] == [rank, size, kr.local_rank(), kr.local_size()]
    assert all(v.dtype == tf.int32 and v.shape == () for v in topology())


def test_introspection_answers_for_keras_ring(world):
    assert kr.mpi_built() is True  # the test extra installs mpi4py
    assert kr.mpi_enabled() is True  # tests/parallel runs under mpirun
    assert kr.gloo_built() is False and kr.gloo_enabled() is False
    assert kr.rocm_built() is False and kr.ddl_built() is False and kr.ccl_built() is False
    assert kr.cuda_built() == tf.test.is_built_with_cuda()
    assert kr.nccl_built() == 0  # no NCCL on the CI machines
    assert kr.is_homogeneous() is True


def test_horovod_spellings_of_allreduce(world):
    rank, size = world
    x = tf.constant([rank + 1.0, 2.0])
    total = [size * (size + 1) / 2, 2.0 * size]
    assert kr.allreduce(x, average=False).numpy().tolist() == total
    assert kr.allreduce(x, average=True).numpy().tolist() == [t / size for t in total]
    with pytest.raises(ValueError, match="not both"):
        kr.allreduce(x, op=kr.Sum, average=True)
    out = kr.allreduce(x, op=kr.Sum, compression=kr.Compression.fp16, device_dense="/cpu:0",
                       ignore_name_scope=True)
    assert out.dtype == tf.float32 and out.numpy().tolist() == total
    outs = kr.grouped_allreduce([x, x * 2], average=False, compression=kr.Compression.fp16)
    assert [o.numpy().tolist() for o in outs] == [total, [2 * t for t in total]]
    part = kr.reducescatter(tf.reshape(tf.tile(x, [size]), [size, 2]), op=kr.Sum,
                            compression=kr.Compression.fp16)
    assert part.dtype == tf.float32 and part.numpy().tolist() == [total]
