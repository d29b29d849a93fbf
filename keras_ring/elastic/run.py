"""``keras_ring.elastic.run``: runs a training function again in every new world."""

from __future__ import annotations

import functools
import gc
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf

from keras_ring import _accumulation, _bucket_tuning, errors
from keras_ring.basics import init, rank, size
from keras_ring.elastic.client import RendezvousError
from keras_ring.elastic.state import HostsUpdatedInterrupt, State
from keras_ring.runtime import RUNTIME

F = TypeVar("F", bound=Callable[..., Any])

# What ends a world without being the program's own fault: a peer died or stalled, or the
# runtime was aborted because of that. A mismatch or a bad argument is a bug of the program
# and ends the job as in a job that is not elastic.
_WORLD_ENDED = (errors.PeerFailureError, errors.CollectiveTimeoutError,
                errors.CollectiveAbortedError)


def run(func: F) -> F:
    """Makes ``func(state, ...)`` survive changes of the world.

    Before every (re)start the state is synchronised from rank 0. When a peer fails, every
    surviving rank restores the last commit, the survivors form a new world (with new ranks
    and size; the state's reset callbacks run), sync and call ``func`` again; when new workers
    wait at a commit (``HostsUpdatedInterrupt``), the same happens without the restore and
    with the newcomers. A job that falls below ``--min-np`` fails after a bounded wait.

    Args:
        func: the training function; its first argument is the ``State``.

    Example:

    ```python
    @keras_ring.elastic.run
    def train(state):
        model.fit(x, y, initial_epoch=state.epoch, epochs=10, callbacks=callbacks)

    train(keras_ring.elastic.KerasState(model, epoch=0, batch=0))
    ```
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"keras_ring.elastic.run: the first argument of "
                            f"{getattr(func, '__name__', func)!r} must be a "
                            f"keras_ring.elastic State, got {type(state).__name__}")
        if not RUNTIME.initialized:
            init()
        if RUNTIME.elastic is None:  # not started as an elastic job: one world, as usual
            state.sync()
            return func(state, *args, **kwargs)
        kept = None  # the bucket plan, carried from world to world
        while True:
            try:
                _bucket_tuning.MEASURED.agree(kept)
                _accumulation.drop_pending_passes()  # not part of any state: alike now
                state.sync()
                RUNTIME.elastic.synced()
                result = func(state, *args, **kwargs)
                RUNTIME.elastic.finished()
                return result
            except HostsUpdatedInterrupt:
                pass  # committed just now: nothing to restore
            except tf.errors.OpError as e:
                error = errors.translate(e)
                if not isinstance(error, _WORLD_ENDED):
                    if isinstance(error, errors.KerasRingError):  # not, say, one host's OOM
                        _end_the_job(error)
                    raise
                _say(f"the world of {size()} broke ({type(error).__name__}); restoring the "
                     "last commit")
                state.restore()
            except errors.KerasRingError as e:  # a mismatch found in Python (weights, rates)
                if not isinstance(e, _WORLD_ENDED):
                    _end_the_job(e)
                raise
            kept = _bucket_tuning.MEASURED.kept() or kept
            _next_world(state)

    return wrapper  # type: ignore[return-value]


def _end_the_job(error: Exception) -> None:
    """Tells the rendezvous that this program's own error (a mismatch, a bad argument) ends
    the job: a new world would meet it again. Best effort: the error is raised anyway."""
    try:
        RUNTIME.elastic.failed(f"{type(error).__name__}: {error}")
    except Exception:  # noqa: BLE001 - the rendezvous may be gone; the error says enough
        pass


def _next_world(state: State) -> None:
    """Leaves the current world and joins the next one (``shutdown`` + ``init``); a world
    that breaks while it connects (a member died meanwhile) is left for the next one, up to
    the job's elastic timeout."""
    started = time.monotonic()
    client = RUNTIME.elastic
    # An exception out of fit leaves its data iterator (and the iterator's threads) in a
    # reference cycle with the traceback: collect it now, not after many resets.
    gc.collect()
    while True:
        RUNTIME.shutdown()
        try:
            init()
            break
        except RendezvousError:
            raise  # the job cannot go on (the message says why)
        except errors.InitError as e:
            if time.monotonic() - started > client.elastic_timeout:
                raise
            _say(f"world {client.generation} broke while connecting ({e}); joining the next")
    state.on_reset()
    _say(f"rank {rank()} of {size()} in world {RUNTIME.elastic.generation} after "
         f"{time.monotonic() - started:.2f} s")


def _say(message: str) -> None:
    print(f"keras_ring.elastic: {message}", file=sys.stderr, flush=True)
