"""Collectives of Python objects: ``broadcast_object``, ``broadcast_object_fn`` and
``allgather_object``, pickled into uint8 tensors and moved by the tensor collectives.

An object that cannot be pickled fails on every rank, not only on the one that holds it: the
rank sends its error in place of the pickle (a negative length says which), so the others
raise it too instead of waiting for data that never comes.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from keras_ring.collectives import _check_name, allgather, broadcast, check_eager
from keras_ring.errors import CollectiveArgumentError
from keras_ring.process_sets import ProcessSet, global_process_set, resolve
from keras_ring.runtime import RUNTIME


# Traced, the root would put broadcasts in its graph while the others fail on .numpy(): the
# ranks' sequences of collectives would part.
_TRACED = ("it returns Python objects; call it outside the function, or broadcast/allgather "
           "tensors there")


def _pickle(obj: Any) -> tuple[bytes, BaseException | None]:
    """``(pickle, None)``, or ``(the error's text, the error)`` where ``obj`` cannot be
    pickled."""
    buf = io.BytesIO()
    try:
        pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # PicklingError, TypeError, AttributeError, RecursionError ...
        return f"{type(e).__name__}: {e}".encode(errors="replace"), e
    return buf.getvalue(), None


def _check_session(session: Any, what: str) -> None:
    # Horovod's TF1 session sits where a name might be expected: a string there is a name
    # passed positionally in keras_ring's old order, which now must be a keyword.
    if session is not None:
        raise ValueError(f"keras_ring.{what} takes no TF1 session (keras_ring's object "
                         f"collectives run eagerly), got session={session!r}; a name goes "
                         "in name=")


def _as_tensor(data: bytes) -> tf.Tensor:
    return tf.constant(np.frombuffer(data, dtype=np.uint8))


def _unpickle(data: bytes, what: str, name: str, rank: int) -> Any:
    """``data`` as the object ``rank`` sent, or an error that names the collective and the
    sender (a class missing here, or pickled by another version of it)."""
    try:
        return pickle.loads(data)
    except Exception as e:  # UnpicklingError, AttributeError, ModuleNotFoundError, ValueError ...
        reason = (f"the object rank {rank} sent cannot be unpickled on this rank "
                  f"({type(e).__name__}: {e}); every rank needs its class, from the same "
                  "code and versions")
        error = CollectiveArgumentError(None, None, f"keras_ring: {what} '{name}': {reason}")
        error.collective, error.rank, error.reason = f"{what} '{name}'", rank, reason
        raise error from e


def _unpicklable(what: str, name: str, failed: dict[int, str],
                 cause: BaseException | None) -> CollectiveArgumentError:
    ranks = ", ".join(f"rank {r} ({text})" for r, text in sorted(failed.items()))
    reason = (f"the object of {ranks} cannot be pickled, so no rank received anything; "
              "send picklable data (e.g. the state of an object rather than the object)")
    error = CollectiveArgumentError(None, None, f"keras_ring: {what} '{name}': {reason}")
    error.collective, error.rank, error.reason = f"{what} '{name}'", min(failed), reason
    error.__cause__ = cause
    return error


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Returns the root rank's ``obj`` (any picklable object) on every rank. Eager only.

    Args:
        obj: the object to send (on the root; ignored elsewhere).
        root_rank: the global rank whose object every rank receives.
        session: Horovod's TF1 session, in Horovod's place; only None is accepted.
        name: a name shared by all ranks, used in errors.
        process_set: the ranks that take part; all by default.

    Raises:
        CollectiveArgumentError: on every rank, where the root's object cannot be pickled.

    Example:

    ```python
    config = keras_ring.broadcast_object(config if keras_ring.rank() == 0 else None)
    ```
    """
    check_eager("broadcast_object", _TRACED)
    _check_session(session, "broadcast_object")
    resolve(process_set, "broadcast_object")
    base = _check_name(name) or "broadcast_object"
    mine = RUNTIME.topology().rank == root_rank
    data, error = _pickle(obj) if mine else (b"", None)
    header = -len(data) if error else len(data)
    length = int(broadcast(tf.constant([header], tf.int64), root_rank, name=f"{base}.length",
                           process_set=process_set)[0])
    payload = _as_tensor(data) if mine else tf.zeros([abs(length)], tf.uint8)
    received = broadcast(payload, root_rank, name=f"{base}.data",
                         process_set=process_set).numpy().tobytes()
    if length < 0:
        raise _unpicklable("broadcast_object", base,
                           {root_rank: received.decode(errors="replace")}, error)
    return obj if mine else _unpickle(received, "broadcast_object", base, root_rank)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set,
                        ) -> Callable[[Any], Any]:
    """Horovod's ``broadcast_object_fn``: a function that broadcasts one object per call from
    ``root_rank``, as :func:`broadcast_object` does. Eager only.

    Args:
        root_rank: the global rank whose object every rank receives.
        session: Horovod's TF1 session; only None is accepted (keras_ring runs eagerly).
        name: a name shared by all ranks, used in errors.
        process_set: the ranks that take part; all by default.

    Example:

    ```python
    bcast = keras_ring.broadcast_object_fn(root_rank=0)
    state = bcast(state)
    ```
    """
    _check_session(session, "broadcast_object_fn")
    base = _check_name(name) or "broadcast_object_fn"
    return lambda obj: broadcast_object(obj, root_rank, name=base, process_set=process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Returns a list with every rank's ``obj`` (any picklable object), in rank order. Eager
    only. ``session`` is Horovod's TF1 session, in Horovod's place: only None is accepted.

    Raises:
        CollectiveArgumentError: on every rank, where some rank's object cannot be pickled
            (the error names those ranks and why).

    Example:

    ```python
    losses = keras_ring.allgather_object(float(loss))
    ```
    """
    check_eager("allgather_object", _TRACED)
    _check_session(session, "allgather_object")
    resolve(process_set, "allgather_object")
    base = _check_name(name) or "allgather_object"
    data, error = _pickle(obj)
    header = -len(data) if error else len(data)
    lengths = allgather(tf.constant([header], tf.int64), name=f"{base}.lengths",
                        process_set=process_set).numpy()
    some_failed = bool((lengths < 0).any())
    if some_failed and not error:  # every rank knows: all send only the errors' texts
        data = b""
    gathered = allgather(_as_tensor(data), name=f"{base}.data",
                         process_set=process_set).numpy().tobytes()
    out, failed, offset = [], {}, 0
    for rank, n in zip(process_set.ranks, (int(n) for n in lengths)):
        if some_failed and n >= 0:
            continue  # sent nothing
        chunk = gathered[offset:offset + abs(n)]
        offset += abs(n)
        if n < 0:
            failed[rank] = chunk.decode(errors="replace")
        else:
            out.append(_unpickle(chunk, "allgather_object", base, rank))
    if failed:
        raise _unpicklable("allgather_object", base, failed, error)
    return out
