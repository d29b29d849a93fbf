"""Thin calls of the generated ops, and the gradients TensorFlow uses for them.

Everything here assumes validated inputs; keras_ring.collectives does the checking, and
registers the gradients (:func:`register_gradients`), since two of them need this process's
rank, which only the runtime above this layer knows.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import weakref
from collections.abc import Callable

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context  # the eager device scope: no public name
# A function's graph and the bodies of tf.cond and tf.while_loop: no public names.
from tensorflow.python.framework.func_graph import FuncGraph
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.ops.control_flow_v2_func_graphs import (ControlFlowFuncGraph,
                                                                 WhileBodyFuncGraph,
                                                                 WhileCondFuncGraph)

from keras_ring.ops.loader import library
from keras_ring.ops.xla import check_not_xla_compiled
from keras_ring.ops.reduce_op import ReduceOp

_NODE_NAME = re.compile(r"[^A-Za-z0-9_.\-/]")


def _node_name(kind: str, tensor_name: str) -> str:
    return _NODE_NAME.sub("_", f"KerasRing{kind}_{tensor_name}" if tensor_name else f"KerasRing{kind}")


def _factor_attr(factor: float) -> str:
    # Scale factors travel as exact decimal strings: TensorFlow's float attrs are 32-bit.
    return "1.0" if factor == 1.0 else repr(float(factor))


def _factor(op, attr: str) -> float:
    value = op.get_attr(attr)
    return float(value.decode() if isinstance(value, bytes) else value)


# Inside tf.function every rank must run its collectives in program order. Automatic control
# dependencies chain the stateful ops that take no resource (the collectives themselves), but
# a conditional, loop or nested function whose body runs a collective (a custom step's weight
# check, an accumulated update, a user's `if first_batch: broadcast_variables(...)`) also reads
# variables, and TensorFlow orders an op with resource inputs only against those resources'
# other users: such an op ran before or after its neighbours, differently on each rank, and
# collectives paired with the wrong ones. So each collective in a function writes one
# process-wide variable just before and just after it: writes to one resource run in program
# order, and a body that runs a collective makes its If, While or call op a writer too.
# (A function that holds a collective therefore captures a variable that no user's object
# tracks, and tf.saved_model.save refuses it; a handle made inside each function instead
# could not order a nested function's call, whose function may be called from anywhere.)
_ORDER: list[tf.Variable] = []
_ORDER_NAME = "keras_ring_collective_order"
_ORDER_LOCK = threading.Lock()  # functions traced on two threads share the one variable


def _bodies() -> list[tf.Graph] | None:
    """The graphs from the one being built (a body of tf.cond or tf.while_loop, or a
    function's) up to its function's, innermost first; None where the functions are not
    traced from eager code (inside a TF1 graph: no automatic control dependencies there, and
    the variable would be that graph's) or where a registered gradient is built into a
    function's backward function (see _unordered)."""
    bodies = [tf.compat.v1.get_default_graph()]
    while isinstance(bodies[-1], ControlFlowFuncGraph) and bodies[-1].outer_graph is not None:
        bodies.append(bodies[-1].outer_graph)
    if not isinstance(bodies[-1], FuncGraph) or (
            getattr(_IN_GRADIENT, "depth", 0) and bodies[-1].name.startswith("__backward_")):
        return None
    with tf.init_scope():  # the outermost context: eager, unless inside a TF1 graph
        from_eager = tf.executing_eagerly()
    return bodies if from_eager else None


def _order_handle(bodies: list[tf.Graph]) -> tf.Tensor:
    """The variable's handle as the innermost of ``bodies`` sees it."""
    with _ORDER_LOCK, tf.init_scope(), tf.device("/CPU:0"):
        if not _ORDER:
            # ResourceVariable itself, not tf.Variable: tf.function's variable creator scope
            # refuses a variable made while it traces again, and the first collective may be
            # in a retrace (Horovod's elastic example traces its step without a collective,
            # then with one). Made inside init_scope, it belongs to no function.
            _ORDER.append(resource_variable_ops.ResourceVariable(
                0, dtype=tf.int64, trainable=False, name=_ORDER_NAME))
    # The function (also a nested one) captures the variable itself, so its call op writes it
    # wherever it is called from; then each body takes it from the graph just outside (cond's
    # gradient expects captures from there, never from further out).
    handle = bodies[-1].capture(_ORDER[0].handle)
    for body in reversed(bodies[:-1]):
        handle = body.capture(handle)
    return handle


def _order_write(bodies: list[tf.Graph]) -> tf.Operation:
    return tf.raw_ops.AssignAddVariableOp(resource=_order_handle(bodies),
                                          value=tf.constant(1, tf.int64))


_MADE = threading.local()  # count: collective ops this thread ran or put into a graph


def collectives_made() -> int:
    """How many collective ops this thread has run eagerly or made in a graph so far: a
    training step traced between two readings communicates where they differ."""
    return getattr(_MADE, "count", 0)


def note_collective() -> None:
    """Counts a collective that the caller will make, though not now (an eager pass whose
    gradients a later one averages)."""
    _MADE.count = getattr(_MADE, "count", 0) + 1


def _call(op: Callable, *args, **attrs):
    """``op(*args, **attrs)``: a collective op, run eagerly (in program order anyway) or, in a
    function, made in order with every other collective made there, also where it or they
    run inside a conditional or a loop."""
    note_collective()
    bodies = None if attrs["eager"] or not tf.inside_function() else _bodies()
    if bodies is None:  # eager (program order anyway), a TF1 graph, a backward function
        return op(*args, **attrs)
    with tf.control_dependencies([_order_write(bodies)]):
        out = op(*args, **attrs)
    with tf.control_dependencies(tf.nest.flatten(out)):
        _order_write(bodies)
    return out


_IN_GRADIENT = threading.local()  # depth: registered gradients being built on this thread


def _unordered(gradient: Callable) -> Callable:
    """A registered gradient, marked while it is built: in a function's backward function
    (TensorFlow's ``__backward_*``, made where a tape differentiates a call of a function)
    its collectives take no part in the order variable, since a write of the captured
    variable there trips TensorFlow inside a loop's gradient (while_v2 finds a capture it did
    not make). They stay stateful ops of that graph, chained there in program order.
    Gradients built in the step's own graph and its conditionals' gradient bodies keep it."""
    @functools.wraps(gradient)
    def build(*args, **kwargs):
        _IN_GRADIENT.depth = getattr(_IN_GRADIENT, "depth", 0) + 1
        try:
            return gradient(*args, **kwargs)
        finally:
            _IN_GRADIENT.depth -= 1

    return build


# Where in a function's control flow a collective was built: the kinds of the bodies around
# it (never their names, whose name scopes and ids may differ by rank), outermost first.
_BRANCH = re.compile(r"(?:^|_)(true|false)_\d+(?:_rewritten)?(?:_grad_\d+)?$"
                     r"|branch(\d+)_\d+(?:_rewritten)?(?:_grad_\d+)?$")
_GRADIENT = re.compile(r"_grad_\d+$")
_PLACE = re.compile(r" \(in tf\.[^()]*(?:\([^()]*\)[^()]*)*\)$")


def _body_kind(graph: tf.Graph) -> str | None:
    """What kind of body ``graph`` is; None for a function's own graph."""
    if isinstance(graph, WhileBodyFuncGraph):
        kind = "tf.while_loop body"
    elif isinstance(graph, WhileCondFuncGraph):
        kind = "tf.while_loop condition"
    elif isinstance(graph, ControlFlowFuncGraph):
        branch = _BRANCH.search(graph.name)
        if branch is None:
            kind = "tf.cond branch"
        elif branch[1]:
            kind = f"tf.cond {branch[1]} branch"
        else:
            kind = f"tf.switch_case branch {branch[2]}"
    elif graph.name.startswith("Dataset_"):
        # A tf.data function: autograph's `for x in dataset:` is a scan over the dataset.
        kind = f"tf.data {graph.name.split('_')[1]} function"
    else:
        return None
    return f"{kind} (gradient)" if _GRADIENT.search(graph.name) else kind


# How many unnamed collectives of each process set each function's graph has built so far.
# Not the graph's collections: a branch's or a body's graph starts with a copy of its outer
# graph's.
_UNNAMED_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _place(unnamed: bool, process_set_id: int) -> str:
    """`` (in tf.while_loop body > tf.cond true branch)`` for a collective being built in
    those bodies, else "". It joins the collective's name, so the signature check tells apart
    collectives that ranks reached in different places of a function: a loop that ran more
    times on one rank, a branch taken by data. Unnamed, such collectives were told apart by
    kind, dtype and shape alone, and one rank's loop collective paired silently with the
    other's next. A nested tf.function counts where it was traced (its graph's outer
    graph), which is the same on every rank that runs the same program.

    An unnamed collective's place also says which of its function's unnamed collectives (of
    its process set, in the order the function built them, its bodies' included) it is:
    `` (in tf.function, unnamed collective 2)``. A run of a function that failed on one rank
    between two of them, caught there, left that rank one behind, and its next run's first
    collective paired silently with the others' second; so did the first of two loops in a
    row that ran more times on one rank."""
    graph = tf.compat.v1.get_default_graph()
    kinds, function = [], None
    while isinstance(graph, FuncGraph):
        kind = _body_kind(graph)
        if kind is not None:
            kinds.append(kind)
        elif function is None:
            function = graph  # the innermost function's own graph: where positions count
        graph = graph.outer_graph
    where = " > ".join(reversed(kinds))
    if not unnamed:
        return f" (in {where})" if where else ""
    function = graph if function is None else function  # else a TF1 tf.Graph's
    counts = _UNNAMED_BUILT.setdefault(function, {})
    counts[process_set_id] = position = counts.get(process_set_id, 0) + 1
    default = "tf.function" if isinstance(function, FuncGraph) else "tf.Graph"
    return f" (in {where or default}, unnamed collective {position})"


def _common(kind: str, tensor_name: str, process_set_id: int) -> tuple:
    """(the name input, the attrs) of a collective op."""
    # `eager`: called eagerly, the waiting thread is the user's, so waits may yield the core
    # to the peers (the kernel's Request::may_yield); graphs' pool threads sleep at once.
    eager = tf.executing_eagerly()
    # keras_ring's own checks ("keras_ring.weight_check") are placeless: they pair by design
    # across places (a custom step's weight check runs as one rank traces its step and, on
    # another, inside the traced step's If).
    placed = not eager and not tensor_name.startswith("keras_ring.")
    name = (tensor_name + (_place(not tensor_name, process_set_id) if placed else "")).strip()
    return (_eager_name(name) if eager else name), _attrs(kind, tensor_name, process_set_id, eager)


@functools.lru_cache(maxsize=1024)  # the same few names, called eagerly again and again
def _eager_name(name: str) -> tf.Tensor:
    with tf.device("/CPU:0"):  # a host input on a GPU kernel too
        return tf.constant(name)


@functools.lru_cache(maxsize=4096)  # the attrs of the same few calls; read, never changed
def _attrs(kind: str, tensor_name: str, process_set_id: int, eager: bool) -> dict:
    return dict(eager=eager, process_set_id=process_set_id, name=_node_name(kind, tensor_name))


def _collective(op: Callable, kind: str, inputs: tuple, tensor_name: str, process_set_id: int,
                **attrs):
    """``op`` called on ``inputs`` and the name input, with the common attrs and ``attrs``."""
    name, common = _common(kind, tensor_name, process_set_id)
    if not common["eager"]:
        check_not_xla_compiled(f"the collective {kind}")
    pinned = common["eager"] and _small_host_ints(inputs)
    with tf.device("/CPU:0") if pinned else contextlib.nullcontext():
        return _call(op, *inputs, name, **common, **attrs)


_SMALL = 64  # elements: TensorFlow's bound for pinning an eager op to the CPU
_INTS = (tf.int32, tf.int64)


def _small_host_ints(inputs: tuple) -> bool:
    """Whether TensorFlow would run an eager op on these inputs on the CPU though a GPU is
    the default device: every input a host int32/int64 tensor of at most 64 elements, and
    no device asked for (its MaybePinSmallOpsToCpu). A string input (the name) rules every
    op out there, so the collectives apply the rule themselves: a step count or the weight
    check's row stays on the host path, as when the name was an attr, not NCCL's."""
    first = inputs[0][0] if isinstance(inputs[0], (list, tuple)) and inputs[0] else inputs[0]
    if getattr(first, "dtype", None) not in _INTS:
        return False  # floats, the usual case, leave at once
    tensors = [t for x in inputs for t in (x if isinstance(x, (list, tuple)) else (x,))]
    if not all(getattr(t, "dtype", None) in _INTS for t in tensors):
        return False
    if context.context().device_name:
        return False  # a device scope: TensorFlow pins nothing there either
    return all(t.shape.num_elements() is not None and t.shape.num_elements() <= _SMALL
               and "CPU" in getattr(t, "device", "") for t in tensors)


def _scales(prescale: float, postscale: float) -> dict:
    return dict(prescale_factor=_factor_attr(prescale), postscale_factor=_factor_attr(postscale))


def allreduce(tensor, reduce_op: int, prescale: float, postscale: float, tensor_name: str,
              process_set_id: int = 0):
    return _collective(library().ops.keras_ring_allreduce, "Allreduce", (tensor,), tensor_name,
                       process_set_id, reduce_op=reduce_op, **_scales(prescale, postscale))


def grouped_allreduce(tensors, reduce_op: int, prescale: float, postscale: float,
                      tensor_name: str, process_set_id: int = 0):
    return _collective(library().ops.keras_ring_grouped_allreduce, "GroupedAllreduce",
                       (tensors,), tensor_name, process_set_id, reduce_op=reduce_op,
                       **_scales(prescale, postscale))


def allgather(tensor, tensor_name: str, process_set_id: int = 0):
    return _collective(library().ops.keras_ring_allgather, "Allgather", (tensor,), tensor_name,
                       process_set_id)


def broadcast(tensor, root_rank: int, tensor_name: str, process_set_id: int = 0):
    """``root_rank`` is the root's rank within the process set."""
    return _collective(library().ops.keras_ring_broadcast, "Broadcast", (tensor,), tensor_name,
                       process_set_id, root_rank=root_rank)


def reducescatter(tensor, reduce_op: int, prescale: float, postscale: float, tensor_name: str,
                  process_set_id: int = 0):
    return _collective(library().ops.keras_ring_reducescatter, "Reducescatter", (tensor,),
                       tensor_name, process_set_id, reduce_op=reduce_op,
                       **_scales(prescale, postscale))


def alltoall(tensor, splits, tensor_name: str, process_set_id: int = 0):
    """(output, received_splits); ``splits`` an int32 vector, empty for equal parts."""
    return _collective(library().ops.keras_ring_alltoall, "Alltoall", (tensor, splits),
                       tensor_name, process_set_id)


def tensor_name(op) -> str:
    """The name a collective op was made with (its last input), with its place."""
    # bytes from an eager tensor, a 0-d array of them from a graph's constant
    name = np.asarray(tf.get_static_value(op.inputs[-1])).item()
    return name.decode() if isinstance(name, bytes) else str(name)


def _grad_name(op) -> str:
    name = _PLACE.sub("", tensor_name(op))
    if name.startswith("(in tf."):
        name = ""  # an unnamed one's place: the gradient's own place is added anew
    return f"{name}_grad" if name else ""


def _set(op) -> int:
    return op.get_attr("process_set_id")


def _allreduce_grad(op, grad):
    """The allreduce of the upstream gradient, with the same op and scale factors."""
    return [allreduce(
        grad, op.get_attr("reduce_op"), _factor(op, "prescale_factor"),
        _factor(op, "postscale_factor"), _grad_name(op), _set(op),
    ), None]


def _grouped_allreduce_grad(op, *grads):
    grads = [tf.zeros_like(x) if g is None else g for g, x in zip(grads, op.inputs)]
    return [*grouped_allreduce(
        grads, op.get_attr("reduce_op"), _factor(op, "prescale_factor"),
        _factor(op, "postscale_factor"), _grad_name(op), _set(op),
    ), None]


def _allgather_grad(op, grad, rank: Callable[[int], int]):
    """Average-allreduce of the upstream gradient, sliced to this rank's rows."""
    x = op.inputs[0]
    name = _grad_name(op)
    grad = allreduce(grad, int(ReduceOp.Average), 1.0, 1.0, name, _set(op))
    rows = tf.reshape(tf.shape(x, out_type=tf.int64)[:1], [-1]) if x.shape.rank != 0 else None
    if rows is None:  # a scalar contributed one row
        rows = tf.constant([1], tf.int64)
    all_rows = allgather(rows, f"{name}.rows" if name else "", _set(op))
    start = tf.reduce_sum(all_rows[: rank(_set(op))])
    mine = tf.slice(grad, tf.concat([[start], tf.zeros([tf.rank(grad) - 1], tf.int64)], 0),
                    tf.concat([rows, tf.fill([tf.rank(grad) - 1], tf.constant(-1, tf.int64))], 0))
    return [tf.reshape(mine, tf.shape(x)), None]


def _broadcast_grad(op, grad, rank: Callable[[int], int]):
    """Sum-allreduce of the upstream gradient on the root, zeros elsewhere."""
    summed = allreduce(grad, int(ReduceOp.Sum), 1.0, 1.0, _grad_name(op), _set(op))
    if rank(_set(op)) == op.get_attr("root_rank"):
        return [summed, None]
    return [tf.zeros_like(summed), None]


def _reducescatter_grad(op, grad, size: Callable[[int], int]):
    """The allgather of the upstream gradient, scaled as Horovod scales it: by the number
    of ranks for Sum (not for Average), and by both scale factors."""
    factor = _factor(op, "prescale_factor") * _factor(op, "postscale_factor")
    if op.get_attr("reduce_op") == int(ReduceOp.Sum):
        factor *= size(_set(op))
    if factor != 1.0:
        grad = grad * tf.cast(factor, grad.dtype)
    return [allgather(grad, _grad_name(op), _set(op)), None]


def _alltoall_grad(op, grad, _received_splits_grad):
    """Sends every row's gradient back where the row came from."""
    back, _ = alltoall(grad, op.outputs[1], _grad_name(op), _set(op))
    return [back, None, None]


_registered = False


def register_gradients(rank: Callable[[int], int], size: Callable[[int], int]) -> None:
    """Registers the ops' gradients with TensorFlow; later calls do nothing.

    Args:
        rank: this process's rank in a process set (by id), when a gradient is built (the
            allgather and broadcast gradients depend on it).
        size: the number of ranks of a process set, when a gradient is built (reducescatter's).
    """
    global _registered
    if _registered:
        return  # TensorFlow refuses a second gradient for an op type
    tf.RegisterGradient("KerasRingAllreduce")(_unordered(_allreduce_grad))
    tf.RegisterGradient("KerasRingGroupedAllreduce")(_unordered(_grouped_allreduce_grad))
    tf.RegisterGradient("KerasRingAllgather")(
        _unordered(functools.partial(_allgather_grad, rank=rank)))
    tf.RegisterGradient("KerasRingBroadcast")(
        _unordered(functools.partial(_broadcast_grad, rank=rank)))
    tf.RegisterGradient("KerasRingReducescatter")(
        _unordered(functools.partial(_reducescatter_grad, size=size)))
    tf.RegisterGradient("KerasRingAlltoall")(_unordered(_alltoall_grad))
    _registered = True
