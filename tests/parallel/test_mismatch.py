"""Divergent programs end in an error on every rank, never a hang or a wrong result,
and the runtime keeps working afterwards."""

import numpy as np
import pytest
import tensorflow as tf

import keras_ring as kr


def _expect_on_every_rank(fn, error_class, *fragments):
    with pytest.raises(error_class) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    # Still usable: a correct collective right after the failed one.
    out = kr.allreduce(tf.constant([1.0]), op=kr.Sum).numpy()
    assert out[0] == kr.size()
    return info.value


def test_shape_mismatch(world):
    rank, size = world
    err = _expect_on_every_rank(
        lambda: kr.allreduce(tf.ones([17 + (rank == size - 1)]), name="grad_dense_1"),
        kr.CollectiveMismatchError,
        "allreduce 'grad_dense_1' shape mismatch", "rank 0 has shape [17] (17 elements)",
        f"rank {size - 1} has shape [18] (18 elements)",
    )
    assert isinstance(err, tf.errors.FailedPreconditionError)
    assert err.collective == "allreduce 'grad_dense_1'"


def test_same_count_different_shape(world):
    rank, size = world
    shape = [2, 3] if rank == 0 else [3, 2]
    _expect_on_every_rank(lambda: kr.allreduce(tf.ones(shape)), kr.CollectiveMismatchError,
                          "shape mismatch", "[2, 3]", "[3, 2]")


def test_dtype_mismatch(world):
    rank, size = world
    dtype = tf.float32 if rank == 0 else tf.float64
    _expect_on_every_rank(lambda: kr.allreduce(tf.ones([4], dtype), name="d"), kr.CollectiveMismatchError,
                          "dtype mismatch", "float32", "float64")


def test_op_mismatch(world):
    rank, size = world
    op = kr.Sum if rank == 0 else kr.Max
    _expect_on_every_rank(lambda: kr.allreduce(tf.ones([4]), op=op), kr.CollectiveMismatchError,
                          "reduce op mismatch", "Sum", "Max")


def test_scale_mismatch(world):
    rank, size = world
    _expect_on_every_rank(lambda: kr.allreduce(tf.ones([4]), prescale_factor=1.0 + rank),
                          kr.CollectiveMismatchError, "prescale factor mismatch")


def test_root_mismatch(world):
    rank, size = world
    _expect_on_every_rank(lambda: kr.broadcast(tf.ones([4]), root_rank=0 if rank == 0 else 1),
                          kr.CollectiveMismatchError, "root rank mismatch", "root 0", "root 1")


def test_root_out_of_range_on_one_rank(world):
    rank, size = world
    root = size if rank == size - 1 else 0
    err = _expect_on_every_rank(lambda: kr.broadcast(tf.ones([4]), root_rank=root, name="w"),
                                kr.CollectiveArgumentError, f"root_rank {size}",
                                f"out of range for {size} ranks")
    assert err.rank == size - 1


def test_name_mismatch(world):
    rank, size = world
    _expect_on_every_rank(lambda: kr.allreduce(tf.ones([2]), name=f"t{rank % 2}"),
                          kr.CollectiveMismatchError, "name mismatch", "'t0'", "'t1'")


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_long_non_ascii_names_that_differ_are_a_mismatch_saying_so(world, traced):
    # 141 bytes of UTF-8 were cut inside a character to fit the signature's field: the
    # mismatch reached Python as a UnicodeDecodeError, which no keras_ring handler catches.
    rank, size = world
    name = "\u00e9" * 70 + str(rank)
    call = (lambda: kr.allreduce(tf.ones([2]), name=name))
    err = _expect_on_every_rank(tf.function(call) if traced else call,
                                kr.CollectiveMismatchError, "\u00e9" * 40)
    assert "name" in str(err), err


def test_a_name_on_one_rank_only_is_a_mismatch(world):
    rank, _ = world
    _expect_on_every_rank(lambda: kr.allreduce(tf.ones([2]), name="grad_w" if rank == 0 else None),
                          kr.CollectiveMismatchError, "name mismatch", "'grad_w'", "no name")


def test_different_collectives(world):
    rank, size = world

    def diverge():
        x = tf.ones([3])
        return kr.allreduce(x, name="a") if rank == 0 else kr.allgather(x, name="b")

    _expect_on_every_rank(diverge, kr.CollectiveMismatchError, "operation mismatch",
                          "rank 0 has allreduce", "allgather 'b'")


def test_allgather_row_shape_mismatch(world):
    rank, size = world
    _expect_on_every_rank(lambda: kr.allgather(tf.ones([2, 3 + (rank == size - 1)])),
                          kr.CollectiveMismatchError, "allgather", "shape mismatch")


def test_grouped_layout_mismatch(world):
    rank, size = world
    tensors = [tf.ones([3]), tf.ones([2])] if rank == 0 else [tf.ones([2]), tf.ones([3])]
    _expect_on_every_rank(lambda: kr.grouped_allreduce(tensors, name="g"),
                          kr.CollectiveMismatchError, "grouped_allreduce 'g' dtype/shape mismatch",
                          "tensor 0 has 3 elements on rank 0 and 2 on rank 1")


def test_grouped_dtype_mismatch_names_the_tensor(world):
    rank, size = world
    dtype = tf.float64 if rank == size - 1 else tf.float32
    _expect_on_every_rank(lambda: kr.grouped_allreduce([tf.ones([3]), tf.ones([2], dtype)], name="g"),
                          kr.CollectiveMismatchError, "grouped_allreduce 'g' dtype/shape mismatch",
                          f"tensor 1 is float32 on rank 0 and float64 on rank {size - 1}")


def test_mismatch_inside_tf_function(world):
    rank, size = world

    @tf.function
    def step(x):
        return kr.allreduce(x, name="in_function")

    with pytest.raises(tf.errors.FailedPreconditionError, match="in_function' shape mismatch"):
        step(tf.ones([5 + rank]))
    assert step(tf.ones([5])).numpy().tolist() == [1.0] * 5


# Unnamed collectives of one kind, dtype and shape in a function's loop and after it: where
# the loop ran more times on one rank, its next loop collective met the others' next one and
# paired with it, silently (a probe: every rank exited 0 with different sums).
def test_a_loop_that_runs_more_times_on_one_rank_fails_on_every_rank_saying_where(world):
    rank, size = world

    @tf.function
    def step(x, iterations):
        i = tf.constant(0)
        while i < iterations:  # autograph: a tf.while_loop
            x = kr.allreduce(x, op=kr.Sum)
            i += 1
        return kr.allreduce(x * 10, op=kr.Sum)

    assert step(tf.ones([3]), tf.constant(2)).numpy().tolist() == [10.0 * size ** 3] * 3
    _expect_on_every_rank(lambda: step(tf.ones([3]), tf.constant(1 + (rank == 0))),
                          kr.CollectiveMismatchError, "name mismatch",
                          "'(in tf.while_loop body, unnamed collective 1)'",
                          "'(in tf.function, unnamed collective 2)'", "ran more times")


# Unnamed collectives of two loops in a row: where the first ran more times on one rank, its
# collective met the others' second loop's and paired silently (the place was the same).
def test_the_first_of_two_loops_running_more_times_on_one_rank_fails_on_every_rank(world):
    rank, size = world

    @tf.function
    def step(x, iterations):
        for _ in tf.range(iterations):
            x = kr.allreduce(x, op=kr.Sum)
        for _ in tf.range(2):
            x = kr.allreduce(x * 10, op=kr.Sum)
        return x

    assert step(tf.ones([3]), tf.constant(1)).numpy().tolist() == [100.0 * size ** 3] * 3
    _expect_on_every_rank(lambda: step(tf.ones([3]), tf.constant(1 + (rank == 0))),
                          kr.CollectiveMismatchError, "name mismatch",
                          "'(in tf.while_loop body, unnamed collective 1)'",
                          "'(in tf.while_loop body, unnamed collective 2)'", "a loop before")


# Unnamed collectives in a function's own graph were told apart by kind, dtype and shape
# alone: where a run of the function failed on one rank between two of them and the program
# caught the error (a bad batch skipped), that rank's next run paired its first collective
# with the others' second, silently and for ever (a probe: wrong sums on every rank, ranks
# disagreeing, until a PeerFailureError at exit).
def test_a_run_that_failed_between_collectives_on_one_rank_is_a_mismatch_not_a_shift(world):
    rank, size = world

    @tf.function
    def step(x, scale):
        a = kr.allreduce(x, op=kr.Sum)
        checked = tf.debugging.check_numerics(scale, "bad batch") + 0 * a[0]
        return a, kr.allreduce(x * checked, op=kr.Sum)

    x = tf.constant([float(rank + 1)])
    assert [t.numpy().tolist() for t in step(x, tf.constant(10.0))] == [
        [size * (size + 1) / 2], [10 * size * (size + 1) / 2]]

    def skip_a_bad_batch_then_go_on():
        try:
            step(x, tf.constant(np.nan if rank == size - 1 else 10.0))
        except tf.errors.InvalidArgumentError as error:
            if isinstance(error, kr.KerasRingError):
                raise
        step(x, tf.constant(10.0))

    _expect_on_every_rank(skip_a_bad_batch_then_go_on, kr.CollectiveMismatchError,
                          "name mismatch", "'(in tf.function, unnamed collective 1)'",
                          "'(in tf.function, unnamed collective 2)'", "caught the error")


def _nested_function_in_a_loop(rank):
    @tf.function
    def inner(x):
        return kr.allreduce(x, op=kr.Sum)

    @tf.function
    def step(x, iterations):
        for _ in tf.range(iterations):
            x = inner(x)
        return kr.allreduce(x * 10, op=kr.Sum)

    return lambda: step(tf.ones([3]), tf.constant(1 + (rank == 0))), "tf.while_loop body"


def _loop_over_a_dataset(rank):
    @tf.function
    def step(x, dataset):
        for batch in dataset:  # autograph: a scan over the dataset
            x = kr.allreduce(x + batch, op=kr.Sum)
        return kr.allreduce(x * 10, op=kr.Sum)

    rows = tf.data.Dataset.from_tensor_slices(tf.zeros([1 + (rank == 0), 3]))
    return lambda: step(tf.ones([3]), rows), "tf.data scan function"


def _gradients_of_a_branch_taken_by_data(rank):
    # A custom gradient that synchronises in each branch: the branches' gradients are
    # bodies of their own, told apart as the branches are.
    def synced(scale):
        @tf.custom_gradient
        def f(a):
            return a * scale, lambda dy: kr.allreduce(dy * scale, op=kr.Sum)
        return f

    @tf.function
    def step(v, take_first):
        with tf.GradientTape() as tape:
            tape.watch(v)
            y = tf.cond(take_first, lambda: synced(2.0)(v), lambda: synced(3.0)(v))
        return tape.gradient(y, v)

    return (lambda: step(tf.ones([3]), tf.constant(rank == 0)),
            "tf.cond true branch (gradient)")


# Places outside a plain loop body: a nested tf.function called in the loop (it counts where it
# was traced), autograph's `for x in dataset:`, and a branch's gradient. A probe found each
# pairing silently.
@pytest.mark.parametrize("program", [_nested_function_in_a_loop, _loop_over_a_dataset,
                                     _gradients_of_a_branch_taken_by_data],
                         ids=["nested_function", "dataset", "branch_gradient"])
def test_divergent_places_beyond_a_loop_body_fail_on_every_rank(world, program):
    rank, _ = world
    run, place = program(rank)
    _expect_on_every_rank(run, kr.CollectiveMismatchError, "name mismatch",
                          f"(in {place}, unnamed collective ")


def test_a_branch_taken_by_data_fails_on_every_rank_naming_both_branches(world):
    rank, size = world

    @tf.function
    def step(x):
        return tf.cond(tf.reduce_sum(x) > 0, lambda: kr.allreduce(x, op=kr.Sum),
                       lambda: kr.allreduce(-x, op=kr.Sum))

    # Every rank in one branch: as before.
    assert step(tf.ones([2])).numpy().tolist() == [float(size)] * 2
    assert step(-tf.ones([2])).numpy().tolist() == [float(size)] * 2
    _expect_on_every_rank(lambda: step(tf.ones([2]) * (1 if rank == 0 else -1)),
                          kr.CollectiveMismatchError, "name mismatch",
                          "'(in tf.cond true branch, unnamed collective 1)'",
                          "'(in tf.cond false branch, unnamed collective 2)'")


def test_tapes_in_branches_taken_by_data_fail_instead_of_averaging_different_variables(world):
    # A multi-task step: each branch reduces its own head's gradient, and both heads have
    # one shape. Ranks in different branches averaged one head's gradient with the other's.
    rank, size = world
    heads = [tf.Variable(tf.ones([3])), tf.Variable(tf.ones([3]) * 2)]

    @tf.function
    def step(task):
        def train(head):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(head * head)
            return kr.DistributedGradientTape(tape).gradient(loss, [head])[0]
        return tf.cond(task == 0, lambda: train(heads[0]), lambda: train(heads[1]))

    assert step(tf.constant(1)).numpy().tolist() == [4.0] * 3
    _expect_on_every_rank(lambda: step(tf.constant(0 if rank == 0 else 1)),
                          kr.CollectiveMismatchError, "name mismatch",
                          "(in tf.cond true branch)", "(in tf.cond false branch)")


@pytest.mark.parametrize("shapes", [((2, 3), (3, 2)), ((6, 0, 1), (6, 0, 2))], ids=["transposed", "empty"])
def test_grouped_shapes_that_differ_at_equal_sizes_are_a_mismatch(world, shapes):
    # A single allreduce compares the whole shape; a grouped one must too, even when the
    # element counts agree (and when there are no elements at all).
    rank, size = world
    mine = shapes[rank == size - 1]
    with pytest.raises(kr.CollectiveMismatchError,
                       match="dtype/shape mismatch: tensor 1 has the same dtype and "
                             "element count in another shape"):
        kr.grouped_allreduce([tf.ones([1]), tf.zeros(mine)], name="grouped_shapes")
    assert kr.allreduce(tf.ones([1]), op=kr.Sum).numpy().tolist() == [size]


@pytest.mark.parametrize("differs", ["op", "prescale", "postscale", "dense_shape"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_sparse_allreduces_that_differ_fail_on_every_rank(world, differs, traced):
    # IndexedSlices are allgathered; op, factors and dense shape must still agree, or each
    # rank would scale (or shape) the same rows differently.
    rank, size = world
    odd = rank == size - 1
    rows = 3 + (differs == "dense_shape" and odd)
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([0, 2]),
                              dense_shape=tf.constant([rows, 2]))
    kwargs = {"op": kr.Average if differs == "op" and odd else kr.Sum,
              "prescale_factor": 2.0 if differs == "prescale" and odd else 1.0,
              "postscale_factor": 0.5 if differs == "postscale" and odd else 1.0}
    call = (tf.function(lambda: kr.allreduce(slices, **kwargs)) if traced
            else lambda: kr.allreduce(slices, **kwargs))
    _expect_on_every_rank(lambda: tf.convert_to_tensor(call()), kr.CollectiveMismatchError,
                          "name mismatch", ".values [")


def test_sparse_allreduces_that_agree_name_nothing_of_their_own(world):
    rank, size = world
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([rank]),
                              dense_shape=tf.constant([size, 2]))
    out = tf.convert_to_tensor(kr.allreduce(slices, op=kr.Sum, name="emb")).numpy()
    np.testing.assert_array_equal(out, np.tile([[1.0, 2.0]], (size, 1)))


def test_broadcast_variables_of_lists_that_differ_in_length_fail_at_the_first_saying_both(world):
    # An optimizer built on some ranks only: its slots make the lists differ in length.
    rank, size = world
    variables = [tf.Variable(tf.ones([2])) for _ in range(2 + (rank == size - 1))]
    _expect_on_every_rank(lambda: kr.broadcast_variables(variables, root_rank=0),
                          kr.CollectiveMismatchError, "name mismatch",
                          "'broadcast_variables.0 of 2'", "'broadcast_variables.0 of 3'")
