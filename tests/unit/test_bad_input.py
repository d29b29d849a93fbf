"""Bad inputs in one place, in a world of one (no launcher): each gives a clear error (or,
where the input is merely unusual, the right result), never a crash, and the runtime keeps
working afterwards.

Already covered by tests/unit/test_api_single_process.py and not repeated here: every API
call before init(), the first eight after shutdown(), string/complex64/uint32/uint64 tensors
in the four collectives, bool in allreduce, op=7, object() in allreduce, a lone tensor in
grouped_allreduce, root_rank="0" and root_rank=1, bad environment values.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import keras
import tensorflow as tf

import keras_ring as kr
from tests.reference import OP_NAMES, REDUCE_DTYPES, assert_same, reduce_reference

COLLECTIVES = {
    "allreduce": lambda x: kr.allreduce(x),
    "grouped_allreduce": lambda x: kr.grouped_allreduce([tf.ones([1]), x]),
    "allgather": lambda x: kr.allgather(x),
    "broadcast": lambda x: kr.broadcast(x, root_rank=0),
}
MORE_UNSUPPORTED = {
    "qint16": lambda: tf.cast(tf.zeros([2]), tf.qint16),
    "quint16": lambda: tf.cast(tf.zeros([2]), tf.quint16),
    "complex128": lambda: tf.zeros([2], tf.complex128),
    "qint8": lambda: tf.cast(tf.zeros([2]), tf.qint8),
    "bool-empty": lambda: tf.zeros([0], tf.bool),  # reducible dtypes only, even when empty
}


def _root_error(root):
    return (kr.CollectiveArgumentError, f"root_rank {root} on rank 0 is out of range for 1 ranks")


# id -> (call, expected exception class(es), regex the message must match)
BAD = {
    # Unsupported dtypes (more of them, and inside tf.function, where the check runs at trace).
    **{f"{what}-{dt}": (lambda call=call, make=make: call(make()), TypeError,
                        f"keras_ring.{what} does not support dtype {dt.split('-')[0]}")
       for what, call in COLLECTIVES.items() for dt, make in MORE_UNSUPPORTED.items()
       if not (dt == "bool-empty" and what in ("allgather", "broadcast"))},
    "allreduce-uint32-in-tf.function": (
        lambda: tf.function(lambda x: kr.allreduce(x))(tf.zeros([2], tf.uint32)),
        TypeError, "does not support dtype uint32"),
    # Not tensors.
    **{f"{what}-{kind}": (lambda call=call, value=value: call(value), TypeError,
                          f"keras_ring.{what} needs a tensor, got {type(value).__name__}")
       for what, call in [("allreduce", kr.allreduce), ("allgather", kr.allgather),
                          ("broadcast", lambda v: kr.broadcast(v, 0))]
       for kind, value in [("object", object()), ("dict", {"a": 1}), ("None", None),
                           ("ragged-list", [[1.0], [1.0, 2.0]])]},
    "allreduce-RaggedTensor": (lambda: kr.allreduce(tf.ragged.constant([[1.0], [1.0, 2.0]])),
                               TypeError, "needs a tensor, got RaggedTensor"),
    "allreduce-SparseTensor": (lambda: kr.allreduce(tf.sparse.from_dense(tf.ones([2, 2]))),
                               TypeError, "needs a tensor, got SparseTensor"),
    "grouped-None-entry": (lambda: kr.grouped_allreduce([tf.ones([1]), None]), TypeError,
                           "needs a tensor, got NoneType"),
    "grouped-object": (lambda: kr.grouped_allreduce(object()), TypeError,
                       "grouped_allreduce takes a list or tuple of tensors, got object"),
    "grouped-None": (lambda: kr.grouped_allreduce(None), TypeError,
                     "grouped_allreduce takes a list or tuple of tensors, got NoneType"),
    # A dict would be iterated by its keys: refused, with the way out.
    "grouped-dict": (lambda: kr.grouped_allreduce({"a": tf.ones([1])}), TypeError,
                     "list or tuple of tensors, got dict"),
    # Other arguments.
    "op-and-average": (lambda: kr.allreduce(tf.ones([1]), op=kr.Sum, average=True), ValueError,
                       "pass op or the older average, not both"),
    "op-string": (lambda: kr.allreduce(tf.ones([1]), op="Sum"), ValueError, "op must be one of"),
    "op-negative": (lambda: kr.allreduce(tf.ones([1]), op=-1), ValueError, "op must be one of"),
    # Numbers are refused even where they are keras_ring's own values: Horovod's 0 is
    # Average and its 1 Sum, so a number from a Horovod program would reduce with another op.
    "op-0": (lambda: kr.allreduce(tf.ones([1]), op=0), ValueError,
             "got 0 .a number: pass the op itself.*Horovod numbers its ops differently"),
    "op-numpy-1": (lambda: kr.grouped_allreduce([tf.ones([1])], op=np.int64(1)), ValueError,
                   "got np.int64.1. .a number"),
    "op-reducescatter-3": (lambda: kr.reducescatter(tf.ones([2]), op=3), ValueError,
                           "got 3 .a number"),
    # hvd.keras.reducescatter(value, name, op): the op lands where keras_ring's compression is.
    "reducescatter-keras-order": (lambda: kr.reducescatter(tf.ones([2]), "rs", kr.Sum), TypeError,
                                  "got the op Sum as compression.*pass name= and op= by keyword"),
    "reducescatter-compression-string": (lambda: kr.reducescatter(tf.ones([2]), "", "fp16"),
                                         TypeError, "compression must be one of"),
    # Horovod's string-free compressors; a string failed as an AttributeError on use.
    "allreduce-compression-string": (lambda: kr.allreduce(tf.ones([2]), compression="fp16"),
                                     TypeError, "allreduce: compression must be one of.*got 'fp16'"),
    # The sparse path ignores compression, but a wrong one is still refused there.
    "allreduce-sparse-compression-string": (
        lambda: kr.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), [3, 2]),
                             compression="fp16"), TypeError,
        "allreduce: compression must be one of.*got 'fp16'"),
    "grouped-compression-string": (
        lambda: kr.grouped_allreduce([tf.ones([2])], compression="bf16"), TypeError,
        "grouped_allreduce: compression must be one of.*got 'bf16'"),
    # One variable would be iterated by its rows (broadcast, then assign() on a row tensor).
    "broadcast_variables-one-variable": (
        lambda: kr.broadcast_variables(tf.Variable([1.0, 2.0]), 0), TypeError,
        r"broadcast_variables takes a list of variables, got one ResourceVariable; pass \[variable\]"),
    "broadcast_variables-keras-variable": (
        lambda: kr.broadcast_variables(keras.Variable([1.0, 2.0]), 0), TypeError,
        "broadcast_variables takes a list of variables, got one"),
    "broadcast_variables-dict": (lambda: kr.broadcast_variables({"a": tf.Variable([1.0])}, 0),
                                 TypeError, r"list or tuple of variables, got dict; pass list\(d.values\(\)\)"),
    "broadcast_-one-variable": (lambda: kr.broadcast_(tf.Variable([1.0]), 0), TypeError,
                                "broadcast_ takes a list of variables, got one"),
    "grouped-one-variable": (lambda: kr.grouped_allreduce(tf.Variable([1.0])), TypeError,
                             "grouped_allreduce takes a list of tensors, got one ResourceVariable; "
                             "use allreduce for one tensor"),
    # Explicit splits ride in the signature slot: a clear limit, not a bare "do not fit".
    "alltoall-splits-beyond-a-slot": (
        lambda: kr.alltoall(tf.ones([2]), splits=[2] + [0] * 600), kr.CollectiveArgumentError,
        r"rank 0 passed more than 539 splits.*one entry per rank \(1 here\).*explicit splits "
        "work up to 539 ranks"),
    # XLA has no kernel for the ops: said as they are traced, not as XLA's missing kernel.
    **{f"{what}-under-jit_compile": (
        lambda call=call: tf.function(call, jit_compile=True)(tf.ones([2])), ValueError,
        f"keras_ring: the collective {kind} inside an XLA-compiled function .jit_compile=True.")
       for what, call, kind in [
           ("allreduce", lambda x: kr.allreduce(x), "Allreduce"),
           ("grouped_allreduce", lambda x: kr.grouped_allreduce([x])[0], "GroupedAllreduce"),
           ("allgather", lambda x: kr.allgather(x), "Allgather"),
           ("broadcast", lambda x: kr.broadcast(x, 0), "Broadcast"),
           ("alltoall", lambda x: kr.alltoall(x), "Alltoall"),
           ("reducescatter", lambda x: kr.reducescatter(x), "Reducescatter")]},
    "op-wrap-1": (lambda: kr.wrap("sgd", op=1), ValueError,
                  "wrap: op must be keras_ring.Sum or keras_ring.Average, got 1 .a number"),
    # horovod.tensorflow.keras.allreduce(value, name): a name where keras_ring takes the op.
    "op-a-name": (lambda: kr.allreduce(tf.ones([1]), "loss"), ValueError,
                  "got 'loss' .a string: horovod.tensorflow.keras's allreduce takes the name "
                  "second.*pass name='loss'"),
    "op-a-name-of-an-op": (lambda: kr.allreduce(tf.ones([1]), "max"), ValueError,
                           "got 'max' .a string: pass keras_ring.Max"),
    "name-int": (lambda: kr.allreduce(tf.ones([1]), name=5), TypeError, "name must be a string"),
    "name-bytes": (lambda: kr.allgather(tf.ones([1]), name=b"x"), TypeError, "name must be a string"),
    "prescale-None": (lambda: kr.allreduce(tf.ones([1]), prescale_factor=None), TypeError,
                      "prescale_factor must be a number, got NoneType"),
    # float("2") would pass, and a bool is an int: both are caller bugs.
    "prescale-string": (lambda: kr.allreduce(tf.ones([1]), prescale_factor="2"), TypeError,
                        "prescale_factor must be a number, got str"),
    "postscale-bool": (lambda: kr.grouped_allreduce([tf.ones([1])], postscale_factor=True),
                       TypeError, "postscale_factor must be a number, got bool"),
    "postscale-nan": (lambda: kr.allreduce(tf.ones([1]), postscale_factor=float("nan")),
                      ValueError, "postscale_factor must be finite"),
    # root_rank out of range, of the wrong type, or beyond the op attribute's int32.
    "root-negative": (lambda: kr.broadcast(tf.ones([2]), root_rank=-1), *_root_error(-1)),
    "root-2**31": (lambda: kr.broadcast(tf.ones([2]), root_rank=2**31),
                   kr.CollectiveArgumentError, "out of range for 1 ranks"),
    "root-2**63": (lambda: kr.broadcast(tf.ones([2]), root_rank=2**63),
                   kr.CollectiveArgumentError, "out of range for 1 ranks"),
    "root--2**63": (lambda: kr.broadcast(tf.ones([2]), root_rank=-(2**63)),
                    kr.CollectiveArgumentError, "out of range for 1 ranks"),
    "root-bool": (lambda: kr.broadcast(tf.ones([2]), root_rank=True), TypeError, "root_rank must be an int"),
    "root-float": (lambda: kr.broadcast(tf.ones([2]), root_rank=0.0), TypeError, "root_rank must be an int"),
    "root-None": (lambda: kr.broadcast(tf.ones([2]), root_rank=None), TypeError, "root_rank must be an int"),
    "root-in-tf.function": (lambda: tf.function(lambda: kr.broadcast(tf.ones([2]), root_rank=3))(),
                            tf.errors.InvalidArgumentError, "root_rank 3 on rank 0 is out of range"),
    "broadcast_object-root": (lambda: kr.broadcast_object("x", root_rank=1), *_root_error(1)),
    "broadcast_variables-root": (lambda: kr.broadcast_variables([tf.Variable(1.0)], 5), *_root_error(5)),
    # Objects that cannot be pickled: an error (on every rank: tests/parallel/test_collectives.py)
    # that names the rank and what pickle said.
    "broadcast_object-unpicklable": (lambda: kr.broadcast_object(lambda: 1, root_rank=0),
                                     kr.CollectiveArgumentError,
                                     "broadcast_object 'broadcast_object': the object of rank 0 "
                                     r"\((PicklingError|AttributeError): .*lambda.*\) cannot be pickled"),
    "allgather_object-unpicklable": (lambda: kr.allgather_object(threading.Lock(), name="lock"),
                                     kr.CollectiveArgumentError,
                                     r"allgather_object 'lock': the object of rank 0 \(TypeError: "
                                     ".*pickle '_thread.lock' object\\) cannot be pickled"),
    "broadcast_object_fn-session": (lambda: kr.broadcast_object_fn(0, session=object()), ValueError,
                                    "takes no TF1 session"),
    # Horovod's order: the session comes third (second for allgather_object), the name after.
    "broadcast_object-name-in-session": (lambda: kr.broadcast_object(1, 0, "x"), ValueError,
                                         "broadcast_object takes no TF1 session.*name="),
    "allgather_object-name-in-session": (lambda: kr.allgather_object(1, "x"), ValueError,
                                         "allgather_object takes no TF1 session.*name="),
}


@pytest.fixture(scope="module", autouse=True)
def initialized():
    kr.init()
    yield
    kr.shutdown()


def _still_works():
    assert kr.allreduce(tf.constant([1.5, -2.0]), op=kr.Sum).numpy().tolist() == [1.5, -2.0]


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_clear_error(case):
    call, error, message = BAD[case]
    assert message, "every case says what its message must say"
    with pytest.raises(error, match=message):
        call()
    _still_works()


# Unusual but valid inputs: converted like tf.convert_to_tensor does, never refused.
ACCEPTED = {
    "python-list": (lambda: kr.allreduce([1.0, 2.0], op=kr.Sum), [1.0, 2.0]),
    "numpy-array": (lambda: kr.allgather(np.arange(3, dtype=np.int32)), [0, 1, 2]),
    "python-int": (lambda: kr.allreduce(3, op=kr.Max), 3),
    "numpy-root": (lambda: kr.broadcast(tf.constant([4]), root_rank=np.int64(0)), [4]),
    "variable": (lambda: kr.broadcast(tf.Variable([5.0]), root_rank=np.int32(0)), [5.0]),
    "grouped-generator": (lambda: kr.grouped_allreduce(t for t in [tf.constant([1.0])])[0], [1.0]),
    # A one-shot iterable is read once: broadcast_ returned [] after walking it to assign.
    "broadcast_-generator": (lambda: kr.broadcast_((v for v in [tf.Variable([6.0])]), 0)[0], [6.0]),
    "grouped-empty": (lambda: kr.grouped_allreduce([]), []),
    "long-name": (lambda: kr.allreduce(tf.constant([1.0]), name="n" * 500), [1.0]),
    "odd-name": (lambda: kr.allreduce(tf.constant([1.0]), name="a b/ü'\"\n#1"), [1.0]),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_unusual_valid_input(case):
    call, expected = ACCEPTED[case]
    out = call()
    out = out.numpy().tolist() if hasattr(out, "numpy") else out
    assert out == expected


def test_dtype_check_does_not_depend_on_interned_dtypes():
    # The check tests identity first (fast); a DType built by hand is equal but not the
    # interned object, and must be judged by value all the same.
    from keras_ring import collectives
    float32, string = (tf.dtypes.DType(d.as_datatype_enum) for d in (tf.float32, tf.string))
    assert float32 is not tf.float32
    assert float32 in collectives.REDUCE_DTYPES
    assert string not in collectives.GATHER_DTYPES
    assert tf.bool in collectives.GATHER_DTYPES and tf.bool not in collectives.REDUCE_DTYPES


@pytest.mark.parametrize("average, op", [(True, "Average"), (False, "Sum")])
@pytest.mark.parametrize("call", ["allreduce", "grouped_allreduce"])
def test_a_bool_second_is_horovods_average(call, average, op):
    """horovod.tensorflow.allreduce(tensor, average): a bool where keras_ring takes the op
    means what Horovod meant, read from the op the graph holds (a world of one reduces
    nothing, so the result could not tell)."""
    fn = getattr(kr, call)
    arg = tf.ones([2]) if call == "allreduce" else [tf.ones([2])]
    graph = tf.function(lambda: fn(arg, average)).get_concrete_function().graph
    ops = [o.get_attr("reduce_op") for o in graph.get_operations()
           if "reduce_op" in o.node_def.attr]
    assert ops == [int(getattr(kr, op))]


def test_traced_function_after_shutdown_and_init_again():
    """A tf.function traced while initialised fails clearly after shutdown(), works after init()."""
    step = tf.function(lambda x: kr.allreduce(x, op=kr.Sum, name="traced"))
    assert step(tf.constant([2.0])).numpy().tolist() == [2.0]
    kr.shutdown()
    try:
        # In a graph too: the same class as everywhere else (the graph raised a TensorFlow
        # FailedPreconditionError, which keras_ring translates).
        with pytest.raises(kr.NotInitializedError, match=r"call keras_ring.init\(\)"):
            step(tf.constant([2.0]))
        for call in (lambda: kr.broadcast_variables([tf.Variable(1.0)], 0),
                     lambda: kr.broadcast_object(1, 0), lambda: kr.allgather_object(1),
                     kr.barrier):
            with pytest.raises(kr.NotInitializedError):  # the rest of the API (see the docstring)
                call()
    finally:
        kr.init()
    assert step(tf.constant([2.0])).numpy().tolist() == [2.0]


# --- NaN and Inf -------------------------------------------------------------------------

FLOATS = [d for d in REDUCE_DTYPES if d.is_floating]
SPECIAL = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, -2.5, np.nan]


@pytest.mark.parametrize("op", OP_NAMES)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_nan_and_inf_pass_through_allreduce(dtype, op):
    x = np.array(SPECIAL).astype(dtype.as_numpy_dtype)
    for postscale in (1.0, 2.0):
        with np.errstate(invalid="ignore"):
            want = reduce_reference([x], op, dtype, postscale=postscale)
        got = kr.allreduce(tf.constant(x), op=getattr(kr, op), postscale_factor=postscale).numpy()
        assert_same(got, want)
        # In a world of one every op is the identity (then scaled): -0.0 stays -0.0, which
        # numpy's sum (starting from +0.0) would not keep.
        assert np.signbit(got[3:5]).tolist() == [True, False], got
        grouped = kr.grouped_allreduce([tf.constant(x), tf.ones([3], dtype)], op=getattr(kr, op),
                                       postscale_factor=postscale)
        assert_same(grouped[0].numpy(), want)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_nan_and_inf_pass_through_broadcast_and_allgather(dtype):
    x = np.array(SPECIAL).astype(dtype.as_numpy_dtype).reshape(4, 2)
    for out in (kr.broadcast(tf.constant(x), root_rank=0), kr.allgather(tf.constant(x))):
        got = out.numpy()
        assert_same(got, x)
        # Bit for bit: NaN payloads and the sign of zero are data too.
        assert got.view(f"u{x.itemsize}").tolist() == x.view(f"u{x.itemsize}").tolist()


# --- tensors over 2 GiB --------------------------------------------------------------------
# One large tensor and its result at a time (about 4.5 GiB). Fresh pages are zero, so a copy
# cut short at 2**31 bytes (or an element count that wrapped) shows up as a 0 in the result.

OVER_2GIB = 2**31 + 16


def _min_max(t: tf.Tensor) -> tuple:
    return float(tf.reduce_min(t)), float(tf.reduce_max(t))


def test_allreduce_over_2gib():
    x = tf.ones([OVER_2GIB], tf.uint8)  # more elements than an int32 can count
    y = kr.allreduce(x, op=kr.Sum)
    assert y.shape == (OVER_2GIB,) and y.dtype == tf.uint8
    assert _min_max(y) == (1.0, 1.0)
    del x, y
    x = tf.ones([OVER_2GIB // 4], tf.float32)  # the same bytes in fewer, wider elements
    y = kr.allreduce(x, op=kr.Average, postscale_factor=3.0)
    assert y.shape == (OVER_2GIB // 4,) and _min_max(y) == (3.0, 3.0)
    del x, y
    _still_works()


def test_allgather_and_broadcast_over_2gib():
    x = tf.ones([OVER_2GIB // 8, 8], tf.uint8)
    y = kr.allgather(x)
    assert y.shape == x.shape and _min_max(y) == (1.0, 1.0)
    del y
    y = kr.broadcast(x, root_rank=0)
    assert y.shape == x.shape and _min_max(y) == (1.0, 1.0)
    del x, y
    _still_works()
