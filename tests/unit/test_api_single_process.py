"""The whole Python API in a world of one (no MPI launcher, no MPI import)."""

import re
import subprocess
import sys

import numpy as np
import pytest
import keras
import tensorflow as tf

import keras_ring as kr
from tests.reference import GATHER_DTYPES, OP_NAMES, REDUCE_DTYPES, assert_same, rank_input, reduce_reference

CALLS_BEFORE_INIT = [
    ("rank", lambda: kr.rank()),
    ("size", lambda: kr.size()),
    ("local_rank", lambda: kr.local_rank()),
    ("local_size", lambda: kr.local_size()),
    ("cross_rank", lambda: kr.cross_rank()),
    ("cross_size", lambda: kr.cross_size()),
    ("allreduce", lambda: kr.allreduce(tf.ones([2]))),
    ("grouped_allreduce", lambda: kr.grouped_allreduce([tf.ones([2])])),
    ("allgather", lambda: kr.allgather(tf.ones([2]))),
    ("broadcast", lambda: kr.broadcast(tf.ones([2]), 0)),
    ("broadcast_variables", lambda: kr.broadcast_variables([tf.Variable(1.0)], 0)),
    ("broadcast_object", lambda: kr.broadcast_object(1, 0)),
    ("allgather_object", lambda: kr.allgather_object(1)),
    ("barrier", lambda: kr.barrier()),
    ("reducescatter", lambda: kr.reducescatter(tf.ones([2]))),
    ("grouped_reducescatter", lambda: kr.grouped_reducescatter([tf.ones([2])])),
    ("alltoall", lambda: kr.alltoall(tf.ones([2]))),
    ("grouped_allgather", lambda: kr.grouped_allgather([tf.ones([2])])),
    ("broadcast_", lambda: kr.broadcast_([tf.Variable(1.0)], 0)),
    ("rank_op", lambda: kr.rank_op()),
    ("mpi_enabled", lambda: kr.mpi_enabled()),
]


@pytest.fixture
def initialized():
    kr.init()
    yield
    kr.shutdown()


@pytest.fixture
def not_initialized():
    # A module that ran before this one on the same pytest-xdist worker may have left a
    # world of one running; shutdown() is what a program calls to leave it.
    kr.shutdown()
    assert not kr.is_initialized()


@pytest.mark.parametrize("name,call", CALLS_BEFORE_INIT, ids=[c[0] for c in CALLS_BEFORE_INIT])
def test_every_call_before_init_says_to_call_init(name, call, not_initialized):
    with pytest.raises(kr.NotInitializedError, match=r"call keras_ring.init\(\)"):
        call()


def test_a_call_before_init_in_a_traced_function_is_the_same_error(not_initialized):
    # autograph rebuilt errors from converted code out of their message: a StagingError,
    # without the class or its attributes.
    @tf.function
    def step(x):
        if x > 0:  # autograph converts the function
            x = kr.allreduce(x)
        return x

    with pytest.raises(kr.NotInitializedError, match=r"call keras_ring.init\(\)"):
        step(tf.constant(1.0))


@pytest.mark.parametrize("how", ["fit", "fit with the broadcast", "train_on_batch"])
def test_training_before_init_says_what_needed_it(how, not_initialized):
    # The error said "call keras_ring.init() before this function", naming nothing the user
    # had called.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    wrapped = how != "fit with the broadcast"
    model.compile(optimizer=kr.wrap(keras.optimizers.SGD(0.1)) if wrapped else "sgd",
                  loss="mse")
    x, y = np.zeros((4, 2), np.float32), np.zeros((4, 1), np.float32)
    expected = {"fit": "Model.fit() with a keras_ring optimizer",
                "fit with the broadcast": "fit() with BroadcastGlobalVariablesCallback",
                "train_on_batch": "training with a keras_ring optimizer"}[how]
    with pytest.raises(kr.NotInitializedError, match=re.escape(
            f"call keras_ring.init() before {expected}")):
        if how == "train_on_batch":
            model.train_on_batch(x, y)
        else:
            model.fit(x, y, verbose=0, callbacks=None if wrapped else [
                kr.callbacks.BroadcastGlobalVariablesCallback(0)])


@pytest.mark.parametrize("name,call", CALLS_BEFORE_INIT[:8], ids=[c[0] for c in CALLS_BEFORE_INIT[:8]])
def test_calls_after_shutdown_say_to_call_init(name, call):
    kr.init()
    kr.shutdown()
    with pytest.raises(kr.NotInitializedError):
        call()


def test_init_twice_shutdown_and_init_again():
    kr.init()
    kr.init()
    assert kr.is_initialized()
    assert (kr.rank(), kr.size(), kr.local_rank(), kr.local_size(), kr.cross_rank(), kr.cross_size()) == (0, 1, 0, 1, 0, 1)
    kr.shutdown()
    kr.shutdown()
    assert not kr.is_initialized()
    kr.init()
    assert kr.allreduce(tf.constant([2.0]), op=kr.Sum).numpy().tolist() == [2.0]
    kr.shutdown()


def test_single_process_needs_no_mpi():
    code = "import sys, keras_ring as kr; kr.init(); assert kr.size() == 1; print('mpi4py.MPI' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_the_timeline_module_is_reached_from_the_package_as_documented():
    # keras_ring.timeline.record(True) raised AttributeError after a plain import keras_ring
    # (a fresh process: no test has imported the submodule there).
    code = ("import keras_ring as kr, tensorflow as tf; kr.init(); kr.timeline.record(True); "
            "kr.allreduce(tf.constant([1.0]), name='seen'); "
            "print([e['label'] for e in kr.timeline.recorded()])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[\"allreduce 'seen'\"]"


@pytest.mark.parametrize("op", OP_NAMES)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: d.name)
def test_allreduce_world_of_one(initialized, dtype, op):
    x = rank_input(dtype, (2, 3), 0, seed=1, op=op)
    out = kr.allreduce(tf.constant(x), op=getattr(kr, op), postscale_factor=2.0)
    assert_same(out.numpy(), reduce_reference([x], op, dtype, postscale=2.0))


@pytest.mark.parametrize("dtype", GATHER_DTYPES, ids=lambda d: d.name)
def test_allgather_and_broadcast_world_of_one(initialized, dtype):
    x = rank_input(dtype, (3, 2), 0, seed=2)
    assert_same(kr.allgather(tf.constant(x)).numpy(), x)
    assert_same(kr.broadcast(tf.constant(x), root_rank=0).numpy(), x)


def test_scalars_and_empty_tensors(initialized):
    assert kr.allreduce(tf.constant(3.0)).shape == ()
    assert kr.allreduce(tf.zeros([0, 4])).shape == (0, 4)
    assert kr.allgather(tf.constant(5)).numpy().tolist() == [5]
    assert kr.allgather(tf.zeros([0, 4])).shape == (0, 4)
    assert kr.broadcast(tf.constant(True), 0).numpy()
    assert [t.shape for t in kr.grouped_allreduce([tf.constant(1.0), tf.zeros([0])])] == [(), (0,)]


def test_tf_function_and_variables(initialized):
    v = tf.Variable([1.0, 2.0])
    f = tf.function(lambda: kr.allreduce(v, op=kr.Sum) + kr.allgather(v) + kr.broadcast(v, 0))
    assert f().numpy().tolist() == [3.0, 6.0]


@pytest.mark.parametrize("sync", ["1", "0"])
def test_graph_collectives_as_synchronous_and_asynchronous_kernels(monkeypatch, sync):
    # KERAS_RING_SYNC_GRAPH_KERNELS picks the CPU kernels' kind in graphs (TensorFlow runs a
    # synchronous one's successor on its thread); both must give the same results and errors.
    monkeypatch.setenv("KERAS_RING_SYNC_GRAPH_KERNELS", sync)
    kr.init()
    try:
        from keras_ring import runtime

        assert runtime.RUNTIME.config.sync_graph_kernels is (sync == "1")
        v = tf.Variable(tf.range(6, dtype=tf.float32))

        @tf.function
        def chain():
            out = v
            for _ in range(4):  # chained: each waits for the one before
                out = kr.allreduce(out, op=kr.Sum) + 1.0
            return out, kr.grouped_allreduce([out, 2.0 * out]), kr.broadcast(out, 0)

        out, grouped, broadcast = chain()
        assert out.numpy().tolist() == [x + 4.0 for x in range(6)]
        assert grouped[1].numpy().tolist() == [2.0 * (x + 4.0) for x in range(6)]
        assert broadcast.numpy().tolist() == out.numpy().tolist()
        from keras_ring.errors import CollectiveArgumentError

        with pytest.raises(CollectiveArgumentError, match="root_rank 3 on rank 0 is out of range"):
            tf.function(lambda: kr.broadcast(v, root_rank=3))()
    finally:
        kr.shutdown()
    monkeypatch.setenv("KERAS_RING_SYNC_GRAPH_KERNELS", "maybe")
    with pytest.raises(ValueError, match="KERAS_RING_SYNC_GRAPH_KERNELS must be 1 or 0"):
        kr.init()


def test_objects_and_barrier(initialized):
    assert kr.broadcast_object({"a": [1, 2]}, root_rank=0) == {"a": [1, 2]}
    assert kr.allgather_object("x") == ["x"]
    # Horovod's positional order, session=None and ignore_name_scope included.
    assert kr.broadcast_object({"a": 1}, 0, None, "named") == {"a": 1}
    assert kr.allgather_object("y", None, "named") == ["y"]
    assert kr.allgather(tf.constant([3]), "g", False, kr.global_process_set).numpy().tolist() == [3]
    assert kr.broadcast(tf.constant([4]), 0, "b", True).numpy().tolist() == [4]
    assert [t.numpy().tolist() for t in kr.grouped_allgather([tf.constant([5])], "gg", False)] == [[5]]
    variable = tf.Variable(6.0)
    kr.broadcast_variables([variable], 0, kr.global_process_set, True)  # Horovod's inplace
    assert variable.numpy() == 6.0
    kr.barrier()


UNSUPPORTED = {
    "string": lambda: tf.constant(["a", "b"]),
    "complex64": lambda: tf.zeros([2], tf.complex64),
    "uint32": lambda: tf.zeros([2], tf.uint32),
    "uint64": lambda: tf.zeros([2], tf.uint64),
}


@pytest.mark.parametrize("dtype", sorted(UNSUPPORTED))
def test_unsupported_dtypes_are_type_errors(initialized, dtype):
    x = UNSUPPORTED[dtype]()
    calls = {"allreduce": kr.allreduce, "allgather": kr.allgather, "broadcast": lambda t: kr.broadcast(t, 0),
             "grouped_allreduce": lambda t: kr.grouped_allreduce([tf.ones([1]), t])}
    for what, call in calls.items():
        with pytest.raises(TypeError, match=f"keras_ring.{what} does not support dtype {dtype}"):
            call(x)


def test_bool_is_not_reducible(initialized):
    with pytest.raises(TypeError, match="does not support dtype bool"):
        kr.allreduce(tf.constant([True]))


def test_invalid_arguments(initialized):
    with pytest.raises(ValueError, match="op must be one of"):
        kr.allreduce(tf.ones([2]), op=7)
    with pytest.raises(TypeError, match="needs a tensor"):
        kr.allreduce(object())
    with pytest.raises(TypeError, match="list of tensors"):
        kr.grouped_allreduce(tf.ones([2]))
    with pytest.raises(TypeError, match="root_rank must be an int"):
        kr.broadcast(tf.ones([2]), root_rank="0")
    with pytest.raises(kr.CollectiveArgumentError, match="root_rank 1 on rank 0 is out of range for 1 ranks"):
        kr.broadcast(tf.ones([2]), root_rank=1)
    # The runtime stays usable after argument errors.
    assert kr.allreduce(tf.ones([2]), op=kr.Sum).numpy().tolist() == [1.0, 1.0]


def test_indexed_slices(initialized):
    slices = tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([3]), dense_shape=tf.constant([5, 2]))
    out = kr.allreduce(slices, op=kr.Average)
    assert isinstance(out, tf.IndexedSlices)
    assert out.values.numpy().tolist() == [[1.0, 2.0]] and out.indices.numpy().tolist() == [3]


def test_bad_environment_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("KERAS_RING_TIMEOUT_SECONDS", "soon")
    with pytest.raises(ValueError, match="KERAS_RING_TIMEOUT_SECONDS must be a number"):
        kr.init()
    assert not kr.is_initialized()


# Every wait is bounded, and the C++ core turns these into integer deadlines: inf, nan and
# values past a week are refused (1e300 used to reach undefined float-to-int conversions).
SECONDS_VARIABLES = ["KERAS_RING_TIMEOUT_SECONDS", "KERAS_RING_STALL_WARNING_SECONDS",
                     "KERAS_RING_FAILURE_EXIT_SECONDS"]


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "1e300", "604801"])
@pytest.mark.parametrize("variable", SECONDS_VARIABLES)
def test_seconds_variables_refuse_unbounded_values(monkeypatch, variable, raw):
    from keras_ring.config import Config

    monkeypatch.setenv(variable, raw)
    with pytest.raises(ValueError, match=rf"{variable} must be .* at most 604800 .*got '{raw}'"):
        Config.from_env()
    try:
        with pytest.raises(ValueError, match=variable):
            kr.init()
    finally:
        if kr.is_initialized():  # a failed test must not leave its runtime to the next one
            kr.shutdown()


@pytest.mark.parametrize("raw", ["inf", "nan", "1e300"])
@pytest.mark.parametrize("variable", ["KERAS_RING_START_TIMEOUT_SECONDS",
                                      "KERAS_RING_ELASTIC_TIMEOUT_SECONDS",
                                      "KERAS_RING_ELASTIC_JOIN_SECONDS"])
def test_launch_seconds_variables_refuse_unbounded_values(monkeypatch, variable, raw):
    from keras_ring.config import seconds_from_env  # what the rendezvous and elastic read with

    monkeypatch.setenv(variable, raw)
    with pytest.raises(ValueError, match=rf"{variable} must be .* at most 604800 .*got '{raw}'"):
        seconds_from_env(variable, 60.0)


def test_seconds_variables_take_up_to_a_week_and_failure_exit_takes_zero(monkeypatch):
    from keras_ring.config import Config

    monkeypatch.setenv("KERAS_RING_TIMEOUT_SECONDS", "604800")
    monkeypatch.setenv("KERAS_RING_STALL_WARNING_SECONDS", "0.5")
    monkeypatch.setenv("KERAS_RING_FAILURE_EXIT_SECONDS", "0")  # 0: never ends the process
    config = Config.from_env()
    assert (config.timeout_seconds, config.stall_warning_seconds,
            config.failure_exit_seconds) == (604800.0, 0.5, 0.0)


def test_thread_default_respects_the_users_choice(monkeypatch):
    from keras_ring import threads

    assert threads.default_intra_op_threads(4, cores=2) == 1
    assert threads.default_intra_op_threads(2, cores=16) == 8
    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "3")
    assert threads.configure(local_size=4, requested=None) is None
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS")
    assert threads.configure(local_size=4, requested=0) is None
    # One rank per host keeps TensorFlow's own default.
    assert threads.configure(local_size=1, requested=None) is None


@pytest.mark.parametrize("message, rank", [
    # The reporting rank prefixes the message; the rank at fault is the one the cause names.
    ("rank 0: keras_ring.init() could not connect the ranks: could not connect to rank 2 at "
     "any address it offered: 10.0.0.3:4000 (Connection refused)", 2),
    ("rank 1 on host h0 reached the rendezvous at a loopback address", 1),
    ("ranks 0 and 3 both claim host 'node' but run on different machines", None),
])
def test_init_error_names_the_rank_at_fault(message, rank):
    assert kr.InitError(message).rank == rank
    assert kr.InitError(message, rank=5).rank == 5  # a structured rank wins


def test_errors_of_a_graph_keep_keras_ring_classes_when_tensorflow_replaced_the_code():
    from keras_ring import errors

    raw = tf.errors.InternalError(
        None, None, "Graph execution error:\n\nDetected at node X defined at:\n  File "
        "\"/x/keras_ring/optimizer.py\", line 1\n\nkeras_ring: grouped_allreduce 'g' failed "
        "on rank 0: lost rank 1: its process exited\n\t [[{{node X}}]]\nExecuting "
        "non-communication op <X> originally returned UnavailableError, and was replaced by "
        "InternalError to avoid invoking TF network error handling logic. [Op:__inference_f]")
    ours = errors.translate(raw)
    assert isinstance(ours, kr.PeerFailureError) and isinstance(ours, tf.errors.UnavailableError)
    assert ours.rank == 1 and ours.collective == "grouped_allreduce 'g'"
    assert str(ours).startswith("keras_ring: grouped_allreduce 'g' failed on rank 0: lost rank 1")
    assert "[[{{node" not in str(ours) and "[Op:" not in str(ours)


def test_a_traced_steps_weight_check_becomes_a_weight_mismatch_error():
    from keras_ring import errors

    # What TensorFlow's Assert makes of keras_ring._step_check's message: bracketed, the
    # quotes escaped, the node appended.
    raw = tf.errors.InvalidArgumentError(
        None, None, "assertion failed: [keras_ring: the ranks are training different models: "
        "in keras_ring.DistributedGradientTape.gradient, 1 of 2 trainable weights (\\'d/k\\') "
        "differ between rank 0 and rank(s) 3, 5, also after the first step. More.]\n\t "
        "[[{{function_node cond_false_6}}{{node cond/Assert/Assert}}]]")
    ours = errors.translate(raw)
    assert isinstance(ours, kr.WeightMismatchError) and isinstance(ours, ValueError)
    assert str(ours) == (
        "keras_ring: the ranks are training different models: in "
        "keras_ring.DistributedGradientTape.gradient, 1 of 2 trainable weights ('d/k') differ "
        "between rank 0 and rank(s) 3, 5, also after the first step. More.")
    assert ours.rank == 3 and ours.reason == str(ours).removeprefix("keras_ring: ")


@pytest.mark.parametrize("env, expected", [
    ({"KERAS_RING_INTRA_OP_THREADS": "3"}, 3),
    ({"KERAS_RING_INTRA_OP_THREADS": "0"}, 0),  # 0: TensorFlow's own default
    ({"TF_NUM_INTRAOP_THREADS": "2"}, 0),  # TensorFlow's variable wins; init() leaves it
    ({}, 0),  # a world of one has the cores to itself
])
def test_intra_op_threads_follow_the_variables(clean_env, env, expected):
    code = ("import tensorflow as tf, keras_ring\n"
            "keras_ring.init()\n"
            "print('THREADS', tf.config.threading.get_intra_op_parallelism_threads())\n")
    child = {k: v for k, v in clean_env.items()
             if k not in ("KERAS_RING_INTRA_OP_THREADS", "TF_NUM_INTRAOP_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=dict(child, **env),
                         capture_output=True, text=True, timeout=300)
    assert f"THREADS {expected}" in out.stdout, out.stdout + out.stderr[-2000:]


def test_intra_op_threads_asked_for_too_late_are_named_in_a_warning(clean_env):
    code = ("import tensorflow as tf, keras_ring\n"
            "tf.constant(1.0) + 1.0  # TensorFlow starts its pools here\n"
            "keras_ring.init()\n"
            "print('THREADS', tf.config.threading.get_intra_op_parallelism_threads())\n")
    child = {k: v for k, v in clean_env.items() if k != "TF_NUM_INTRAOP_THREADS"}
    out = subprocess.run([sys.executable, "-c", code],
                         env=dict(child, KERAS_RING_INTRA_OP_THREADS="3"),
                         capture_output=True, text=True, timeout=300)
    assert "THREADS 0" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "KERAS_RING_INTRA_OP_THREADS=3 was ignored" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("op", OP_NAMES)
def test_reducescatter_and_alltoall_world_of_one(initialized, op):
    x = rank_input(tf.float32, (5, 2), 0, seed=1, op=op)
    assert_same(kr.reducescatter(tf.constant(x), op=getattr(kr, op)).numpy(),
                reduce_reference([x], op, tf.float32))
    out, received = kr.alltoall(tf.constant(x), splits=[5])
    assert_same(out.numpy(), x)
    assert received.numpy().tolist() == [5]
    assert_same(kr.alltoall(tf.constant(x)).numpy(), x)
    assert int(kr.rank_op()) == 0 and int(kr.size_op()) == 1
    assert kr.mpi_enabled() is False  # a plain python process found no peers through MPI


_HUGE_PAGES_CHILD = """
import os, sys
import numpy as np, tensorflow as tf, keras_ring as kr

def vm_flags_at(address):  # the kernel's VmFlags of the mapping holding address
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(v, 16) for v in head.split("-"))
                inside = low <= address < high
            elif head == "VmFlags:" and inside:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")

def advised(tensor, offset=4 << 20):  # numpy shares a CPU tensor's memory
    return "hg" in vm_flags_at(np.asarray(tensor).__array_interface__["data"][0] + offset)

for threshold in sys.argv[1:]:
    os.environ.pop("KERAS_RING_HUGE_PAGE_BYTES", None)
    if threshold != "default":
        os.environ["KERAS_RING_HUGE_PAGE_BYTES"] = threshold
    kr.init()
    x = tf.fill([40 << 18], 2.0)  # 40 MiB of float32
    eager = kr.allreduce(x, op=kr.Sum)
    gathered = tf.function(lambda: kr.allgather(x))()  # allocated once the rows are known
    values = [np.asarray(t)[[0, -1]].tolist() for t in (eager, gathered)]
    small = kr.allreduce(tf.fill([1 << 20], 2.0))  # 4 MiB: below the default threshold
    print("CASE", threshold, advised(eager), advised(gathered), advised(small, 2 << 20),
          values == [[2.0, 2.0]] * 2, flush=True)
    del eager, gathered, small
    kr.shutdown()
"""


def test_a_function_calling_the_collectives_has_autograph_convert_none_of_keras_ring(initialized):
    # autograph converted some thirty of keras_ring's functions the first time a user's
    # tf.function called a collective: seconds of tracing (4-7 s for the first allreduce).
    converted, variable = set(), tf.Variable(tf.zeros([4]))

    def record(frame, event, arg):
        code = frame.f_code  # a converted function `f` runs as `tf__f` in a generated file
        if (event == "call" and "__autograph_generated_file" in code.co_filename
                and code.co_name.startswith("tf__")):
            converted.add(code.co_name)

    @tf.function
    def step(x):
        if x[0] > 0:  # autograph converts this function itself
            x = x + 1.0
        return (kr.allreduce(x), kr.grouped_allreduce([x]), kr.allgather(x), kr.broadcast(x, 0),
                kr.grouped_allgather([x]), kr.reducescatter(x), kr.grouped_reducescatter([x]),
                kr.alltoall(x), kr.rank_op(), kr.size_op(), kr.local_rank_op(),
                kr.local_size_op(), kr.process_set_included_op(),
                kr.broadcast_variables([variable], 0))

    sys.setprofile(record)
    try:
        step.get_concrete_function(tf.TensorSpec([4]))
    finally:
        sys.setprofile(None)
    assert converted == {"tf__step"}


def test_large_fresh_outputs_are_advised_to_use_huge_pages(clean_env):
    # An output the collective writes into fresh memory (its input is still referenced, so
    # it cannot be forwarded) from KERAS_RING_HUGE_PAGE_BYTES up (32 MiB by default) is
    # advised to use transparent huge pages ("hg" in its mapping's VmFlags): page faults cost
    # more than the transfer there. Below the threshold, or with 0, nothing is advised.
    # A process of its own, the unadvised cases first: memory freed after an advice keeps
    # it when the allocator hands it out again.
    out = subprocess.run([sys.executable, "-c", _HUGE_PAGES_CHILD, "0", "64000000", "default"],
                         env=clean_env, capture_output=True, text=True, timeout=300)
    cases = {line.split()[1]: line.split()[2:] for line in out.stdout.splitlines()
             if line.startswith("CASE ")}
    assert cases == {"0": ["False", "False", "False", "True"],
                     "64000000": ["False", "False", "False", "True"],
                     "default": ["True", "True", "False", "True"]}, out.stdout + out.stderr[-3000:]


def test_a_tf1_graph_runs_collectives_in_conditionals_and_functions_and_leaves_eager_alone(
        initialized):
    # Inside a TF1 graph keras_ring keeps no order variable (no automatic control
    # dependencies there to order): made there, it belonged to that graph, and every eager
    # function holding a collective failed afterwards ("out of scope").
    with tf.Graph().as_default() as graph:
        x = tf.constant([1.0, 2.0])
        chosen = tf.cond(tf.constant(True), lambda: kr.allreduce(x, op=kr.Sum),
                         lambda: x)
        called = tf.function(lambda v: kr.allreduce(v, op=kr.Sum))(x)
        with tf.compat.v1.Session(graph=graph) as session:
            assert [a.tolist() for a in session.run([chosen, called])] == [[1.0, 2.0]] * 2

    @tf.function
    def eager_traced(v):
        return kr.allreduce(v, op=kr.Sum)

    assert eager_traced(tf.constant([3.0])).numpy().tolist() == [3.0]


def _raised(inner: BaseException, chain: str) -> BaseException:
    """A RuntimeError raised while handling ``inner``, from it or not."""
    try:
        try:
            raise inner
        except BaseException as caught:
            if chain == "from":
                raise RuntimeError("the step failed") from caught
            raise RuntimeError("the step failed")  # noqa: B904 - the chain under test
    except RuntimeError as e:
        return e


@pytest.mark.parametrize("chain", ["from", "while handling"])
def test_an_error_raised_after_a_peers_failure_follows_it(chain):
    # keras-ring-run reports the exit code of the rank at fault; a rank whose program
    # re-raises a PeerFailureError as its own error is still not that rank.
    from keras_ring.runtime import _follows_a_peer

    peer = kr.PeerFailureError(None, None, "keras_ring: allreduce failed: rank 1 is gone")
    assert _follows_a_peer(_raised(peer, chain))
    assert not _follows_a_peer(_raised(ValueError("a bad record"), chain))


def test_not_initialized_errors_keep_their_message_through_pickling():
    # A data loader's worker sends its exception pickled: the fork's message came back inside
    # "call keras_ring.init() before ...", and then as the generic message.
    import pickle

    for error in (kr.NotInitializedError("keras_ring.rank()"),
                  kr.NotInitializedError(message="keras_ring: this process was forked")):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is kr.NotInitializedError and str(again) == str(error)


def test_a_forks_message_survives_translation():
    from keras_ring import errors

    text = ("keras_ring has not been initialized: call keras_ring.init() before keras_ring: this "
            f"process (pid 7) was forked from rank 0's process (pid 6) {errors.FORKED}")
    ours = errors.translate(tf.errors.UnknownError(None, None, text))
    assert isinstance(ours, kr.NotInitializedError) and errors.FORKED in str(ours), ours
