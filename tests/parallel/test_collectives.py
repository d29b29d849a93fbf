"""Every collective x dtype x op against numpy references, eagerly and in tf.function."""

import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr
from keras_ring.ops import wrappers
from tests.reference import (GATHER_DTYPES, OP_NAMES, REDUCE_DTYPES, assert_same, rank_input,
                             reduce_reference)

MODES = ["eager", "function"]


def _maybe_function(fn, mode):
    return fn if mode == "eager" else tf.function(fn)


def test_topology_matches_launcher(world):
    import os
    import socket

    rank, size = world
    assert rank == int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", -1)))
    assert size == int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", -1)))
    # The host map is the launcher's (or KERAS_RING_HOST_ID's, for a map faked on one
    # machine); on one host every rank is local and there is one "cross" group per local rank.
    hosts = kr.allgather_object(os.environ.get("KERAS_RING_HOST_ID") or socket.gethostname())
    mine = [r for r in range(size) if hosts[r] == hosts[rank]]
    assert kr.local_rank() == mine.index(rank) and kr.local_size() == len(mine)
    # Cross ranks: the ranks with this rank's local rank, one per host (Horovod's definition).
    local_rank_of = [hosts[:r].count(hosts[r]) for r in range(size)]
    cross = [r for r in range(size) if local_rank_of[r] == local_rank_of[rank]]
    assert kr.cross_rank() == cross.index(rank) and kr.cross_size() == len(cross)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", OP_NAMES)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: d.name)
def test_allreduce(world, dtype, op, mode):
    rank, size = world
    shape = (3, 5)
    inputs = [rank_input(dtype, shape, r, seed=11, op=op) for r in range(size)]
    fn = _maybe_function(lambda x: kr.allreduce(x, op=getattr(kr, op), name=f"ar_{op}"), mode)
    out = fn(tf.constant(inputs[rank]))
    assert out.shape == shape and out.dtype == dtype
    assert_same(out.numpy(), reduce_reference(inputs, op, dtype))


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.int32, tf.int8], ids=lambda d: d.name)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_allreduce_scale_factors(world, dtype, op):
    rank, size = world
    inputs = [rank_input(dtype, (17,), r, seed=5) for r in range(size)]
    out = kr.allreduce(tf.constant(inputs[rank]), op=getattr(kr, op), prescale_factor=0.5, postscale_factor=4.0)
    expected = reduce_reference(inputs, op, dtype, prescale=0.5, postscale=4.0)
    assert_same(out.numpy(), expected)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 1000, 300_001])
def test_allreduce_sizes(world, count):
    """Zero elements, fewer elements than ranks, primes, and more than one 1 MiB segment."""
    rank, size = world
    inputs = [rank_input(tf.float32, (count,), r, seed=count) for r in range(size)]
    out = kr.allreduce(tf.constant(inputs[rank]), op=kr.Sum)
    assert_same(out.numpy(), reduce_reference(inputs, "Sum", tf.float32))


def test_allreduce_scalar(world):
    rank, size = world
    out = kr.allreduce(tf.constant(float(rank + 1)), op=kr.Sum)
    assert out.shape == () and out.numpy() == size * (size + 1) / 2


def test_allreduce_results_bitwise_identical_on_every_rank(world):
    rank, size = world
    x = np.random.default_rng([3, rank]).standard_normal(10_001).astype(np.float32) / 7
    for op in (kr.Sum, kr.Average):
        out = kr.allreduce(tf.constant(x), op=op).numpy()
        gathered = kr.allgather(tf.constant(out.view(np.int32)[None, :])).numpy()
        assert all(np.array_equal(gathered[0], row) for row in gathered)


def test_allreduce_nan_and_inf_propagate(world):
    rank, size = world
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    if rank == size - 1:
        x[0] = np.nan
        x[1] = np.inf
    for op in (kr.Sum, kr.Min, kr.Max):
        out = kr.allreduce(tf.constant(x), op=op).numpy()
        assert np.isnan(out[0]), (op, out)
        assert out[1] == (np.inf if op != kr.Min else 2.0), (op, out)


def test_integer_sum_wraps(world):
    rank, size = world
    out = kr.allreduce(tf.constant([127, -128], tf.int8), op=kr.Sum).numpy()
    with np.errstate(over="ignore"):
        expected = np.array([127 * size, -128 * size], np.int64).astype(np.int8)
    assert_same(out, expected)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "IndexedSlices"])
def test_an_integer_average_with_a_postscale_truncates_once_as_horovod_does(world, sparse):
    # sum * (postscale / size), truncated once: dividing first truncated twice (probe E:
    # [1, 7, -7] averaged over 2 ranks with postscale 2 gave [0, 6, -6]).
    rank, size = world
    mine = tf.constant([[1], [7], [-7]] if rank == 0 else [[0], [0], [0]], tf.int32)
    if sparse:
        mine = tf.IndexedSlices(mine, tf.constant([0, 1, 2]), tf.constant([3, 1]))
    out = kr.allreduce(mine, op=kr.Average, postscale_factor=float(size))
    values = tf.convert_to_tensor(out).numpy() if sparse else out.numpy()
    assert values.ravel().tolist() == [1, 7, -7]


@pytest.mark.parametrize("scale", [1.0, 3.0, -3.0])
def test_int64_averages_and_scales_exactly_at_its_extremes(world, scale):
    # Beyond 2**53 a double loses the low bits; 2**63 does not fit an int64 (saturate).
    rank, size = world
    big = 2**62 // size
    inputs = [np.array([big + r, -big - 3 * r, 2**53 + 2 * r + 1, 7 * r - 5], np.int64)
              for r in range(size)]
    out = kr.allreduce(tf.constant(inputs[rank]), op=kr.Average, postscale_factor=scale)
    assert_same(out.numpy(), reduce_reference(inputs, "Average", tf.int64, postscale=scale))
    if scale == 1.0:  # the exact average, not a double's neighbour of it
        exact = [sum(int(x[i]) for x in inputs) for i in range(4)]
        assert out.numpy().tolist() == [v // size if v >= 0 else -(-v // size) for v in exact]


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_mixed_dtypes_and_shapes(world, mode):
    rank, size = world
    specs = [(tf.float32, (3, 4)), (tf.int32, (5,)), (tf.float32, ()), (tf.float16, (0,)),
             (tf.float64, (2, 2, 2)), (tf.int32, (1,)), (tf.bfloat16, (9,)), (tf.float32, (300_000,))]
    per_rank = [[rank_input(d, s, r, seed=i) for i, (d, s) in enumerate(specs)] for r in range(size)]
    fn = _maybe_function(lambda xs: kr.grouped_allreduce(xs, op=kr.Sum, name="group"), mode)
    outs = fn([tf.constant(x) for x in per_rank[rank]])
    assert len(outs) == len(specs)
    for i, (dtype, shape) in enumerate(specs):
        assert tuple(outs[i].shape) == shape and outs[i].dtype == dtype
        assert_same(outs[i].numpy(), reduce_reference([p[i] for p in per_rank], "Sum", dtype))


def test_grouped_allreduce_average_and_empty(world):
    rank, size = world
    outs = kr.grouped_allreduce([tf.fill([4], float(rank)), tf.fill([2], 2.0 * rank)], op=kr.Average)
    mean = sum(range(size)) / size
    np.testing.assert_array_equal(outs[0].numpy(), np.full(4, mean, np.float32))
    np.testing.assert_array_equal(outs[1].numpy(), np.full(2, 2 * mean, np.float32))
    assert kr.grouped_allreduce([]) == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GATHER_DTYPES, ids=lambda d: d.name)
def test_allgather_varying_first_dimension(world, dtype, mode):
    rank, size = world
    inputs = [rank_input(dtype, (r % 3, 2, 3), r, seed=21) for r in range(size)]  # rank 0: 0 rows
    fn = _maybe_function(lambda x: kr.allgather(x, name="gather"), mode)
    out = fn(tf.constant(inputs[rank]))
    assert out.dtype == dtype
    assert_same(out.numpy(), np.concatenate(inputs, axis=0))


def test_allgather_large_and_scalar(world):
    rank, size = world
    big = [np.full((100_000 + r, 3), r, np.float32) for r in range(size)]
    assert_same(kr.allgather(tf.constant(big[rank])).numpy(), np.concatenate(big))
    out = kr.allgather(tf.constant(rank * 10, tf.int64))
    assert_same(out.numpy(), np.arange(size, dtype=np.int64) * 10)


def test_allgather_shape_function():
    spec = tf.TensorSpec([None, 3, 4], tf.float32)
    concrete = tf.function(lambda x: kr.allgather(x)).get_concrete_function(spec)
    assert concrete.structured_outputs.shape.as_list() == [None, 3, 4]
    concrete = tf.function(lambda x: kr.allreduce(x)).get_concrete_function(tf.TensorSpec([2, 5], tf.float32))
    assert concrete.structured_outputs.shape.as_list() == [2, 5]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GATHER_DTYPES, ids=lambda d: d.name)
def test_broadcast_from_every_root(world, dtype, mode):
    rank, size = world
    for root in range(size):
        inputs = [rank_input(dtype, (4, 3), r, seed=31 + root) for r in range(size)]
        fn = _maybe_function(lambda x: kr.broadcast(x, root_rank=root, name="bcast"), mode)
        assert_same(fn(tf.constant(inputs[rank])).numpy(), inputs[root])


def test_broadcast_large_and_empty(world):
    rank, size = world
    x = np.full(1_500_000, rank, np.float32)
    assert_same(kr.broadcast(tf.constant(x), root_rank=size - 1).numpy(), np.full(1_500_000, size - 1, np.float32))
    assert kr.broadcast(tf.zeros([0, 7]), root_rank=0).shape == (0, 7)


def test_broadcast_variables(world):
    rank, size = world
    tf_var = tf.Variable(tf.fill([3], float(rank)))
    import keras

    keras_var = keras.Variable(np.full((2, 2), rank, np.float32))
    kr.broadcast_variables([tf_var, keras_var], root_rank=size - 1)
    assert_same(tf_var.numpy(), np.full(3, size - 1, np.float32))
    assert_same(np.asarray(keras_var.numpy()), np.full((2, 2), size - 1, np.float32))


def test_objects(world):
    rank, size = world
    obj = {"rank": rank, "payload": list(range(rank * 100))}
    assert kr.broadcast_object(obj, root_rank=size - 1) == {"rank": size - 1, "payload": list(range((size - 1) * 100))}
    assert kr.allgather_object(("r", rank)) == [("r", r) for r in range(size)]
    bcast = kr.broadcast_object_fn(root_rank=size - 1, name="fn")
    assert [bcast(("call", i, rank)) for i in range(2)] == [("call", i, size - 1) for i in range(2)]
    kr.barrier()


@pytest.mark.parametrize("what", ["broadcast_object", "allgather_object"])
def test_an_unpicklable_object_fails_on_every_rank_naming_its_rank(world, what):
    """Only the last rank's object cannot be pickled: every rank raises the same error, which
    names that rank and what pickle said, and the ranks stay in step."""
    import threading

    rank, size = world
    last = size - 1
    obj = threading.Lock() if rank == last else {"rank": rank}
    call = (lambda o: kr.broadcast_object(o, root_rank=last, name="objs")) \
        if what == "broadcast_object" else (lambda o: kr.allgather_object(o, name="objs"))
    with pytest.raises(kr.CollectiveArgumentError,
                       match=rf"{what} 'objs': the object of rank {last} \(TypeError: "
                             r".*'_thread.lock' object\) cannot be pickled") as caught:
        call(obj)
    assert (caught.value.rank, caught.value.collective) == (last, f"{what} 'objs'")
    assert kr.allgather_object(rank) == list(range(size))  # still in step


def _refuse_to_unpickle():
    raise ValueError("this object does not unpickle")


class _Unpicklable:
    """Pickles, but fails as it unpickles (a class missing or of another version there)."""

    def __reduce__(self):
        return _refuse_to_unpickle, ()


@pytest.mark.parametrize("what", ["broadcast_object", "allgather_object"])
def test_an_object_that_does_not_unpickle_is_named_with_its_sender(world, what):
    rank, size = world
    obj = _Unpicklable() if rank == 0 else rank
    call = (lambda o: kr.broadcast_object(o, root_rank=0, name="objs")) \
        if what == "broadcast_object" else (lambda o: kr.allgather_object(o, name="objs"))
    if what == "broadcast_object" and rank == 0:
        assert call(obj) is obj  # the root unpickles nothing
    else:
        with pytest.raises(kr.CollectiveArgumentError,
                           match=rf"{what} 'objs': the object rank 0 sent cannot be unpickled on "
                                 r"this rank \(ValueError: this object does not unpickle\)"):
            call(obj)
    assert kr.allgather_object(rank) == list(range(size))  # still in step


@pytest.mark.parametrize("what", ["broadcast_object", "allgather_object"])
def test_object_collectives_refuse_to_be_traced_on_every_rank(world, what):
    # Traced, the root's graph would hold broadcasts that the other ranks never run.
    call = getattr(kr, what)
    with pytest.raises(RuntimeError, match=f"{what} runs eagerly only.*returns Python objects"):
        tf.function(lambda: call({"epoch": 3}))()
    assert call({"epoch": 3}) in ({"epoch": 3}, [{"epoch": 3}] * world[1])  # still in step


@pytest.mark.parametrize("what", ["barrier", "join"])
def test_barrier_and_join_refuse_to_be_traced_on_every_rank(world, what):
    # Traced, they ran once at trace time and never when the function was called: a
    # barrier that does not wait, a join that leaves the other ranks' allreduces waiting.
    with pytest.raises(RuntimeError, match=f"{what} runs eagerly only.*run once, as the "
                                           "function is traced"):
        tf.function(getattr(kr, what))()
    assert kr.allgather_object(world[0]) == list(range(world[1]))  # still in step


def test_a_collective_first_traced_in_a_retrace(world, monkeypatch):
    # Horovod's elastic example traces its step without a collective, then with one: the
    # variable that orders a function's collectives was made in that retrace, which
    # tf.function refuses ("Creating variables on a non-first call").
    monkeypatch.setattr(wrappers, "_ORDER", [])  # as in a process that traced none yet
    total = tf.Variable(0.0)

    @tf.function
    def step(x, reduce=True):
        if reduce:
            x = kr.allreduce(x, op=kr.Sum)
        total.assign_add(x)

    step(tf.constant(1.0), reduce=False)
    step(tf.constant(1.0))
    assert float(total.numpy()) == 1.0 + kr.size()


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_eager_names_that_change_every_call_keep_no_memory(world):
    # A collective's name was an attr of its op, and TensorFlow's eager runtime keeps one
    # kernel per set of attrs for ever: a name that changed with every call
    # (name=f"loss{step}") grew each process by ~37 KB a call, 54 MiB in 1,500 calls. The
    # name is an input of the op now.
    x = tf.ones([4])

    def calls(prefix: str) -> None:
        for i in range(1500):
            kr.allreduce(x, name=f"{prefix}{i}")

    calls("warm")  # the allocator's first growth, and the cache of name tensors filled
    before = _resident_mib()
    calls("step")
    grown = _resident_mib() - before
    assert grown < 20, f"{grown:.1f} MiB more after 1,500 eager collectives named apart"
