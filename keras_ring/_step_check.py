"""The weight check of custom training steps: ``DistributedGradientTape.gradient`` and a
wrapped optimizer's ``apply`` outside ``fit``.

``fit``'s check (``_weight_check``) runs in Python between steps. A custom loop's step is one
traced function that makes its tape anew on every call, and Horovod's examples broadcast the
weights inside its first call, after the update. A state variable, kept per list of
variables, says where the check stands. Eagerly, and while a step is traced, the weights are
compared at once; equal settles it and the traced step gets nothing. Where they differ as a
step is traced, the check goes into its graph: the step allgathers the fingerprints before
reducing the gradients, each time it runs until settled (reading the state costs an ``If``,
~15-35 us). A difference is tolerated in the first update (the broadcast after it mends
them; with accumulation, its passes), then it is an error on every rank, from the same
comparison. Ranks that compared equal are not compared again (the host remembers it, so a
settled eager step reads no variable).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_ring import _weight_check
from keras_ring._accumulation import SourcesState, state_for, state_variable
from keras_ring._grouping import is_variable, variable_keys
from keras_ring._weight_layout import SHOWN, Layout, label, row
from keras_ring.collectives import allgather
from keras_ring.process_sets import ProcessSet
from keras_ring.runtime import RUNTIME

_PASSED = -1  # else: how many comparisons differed so far

_ADVICE = ("call keras_ring.broadcast_variables(model.variables, root_rank=0) before the first "
           "step, or right after its update as Horovod's examples do (a model without an "
           "Input has no variables before it first runs: broadcast after that)")


class _Check(SourcesState):
    """Where one list of variables' check stands, in a variable that traced steps read."""

    def __init__(self, variables: Sequence[Any]) -> None:
        super().__init__(variables)
        self.generation = RUNTIME.generation
        # The host's copy of "state is _PASSED" (it never leaves that state but for a new
        # world): a settled eager step then reads no variable (~10-20 us a call).
        self.settled = False
        with tf.init_scope(), tf.device("/CPU:0"):
            self.state = state_variable(tf.constant(0, tf.int32), "keras_ring_weight_check")


# (tolerance, process set, ids of the variables) -> _Check
_CHECKS: dict[tuple, _Check] = {}
# Ids of variables an elastic state synced from rank 0 -> the world (generation) it did.
_SYNCED: dict[int, int] = {}


def note_synced(variables: Sequence[Any]) -> None:
    """The variables were just broadcast from rank 0 to every rank of this world (an elastic
    state's sync, on every rank at once), so they are equal: their checks settle without a
    comparison. A newcomer traces the survivors' step anew, and its comparison would be a
    collective that the survivors' step, traced and settled in an earlier world, never runs
    (Horovod's elastic examples do not trace it again)."""
    for variable in variables:
        for key in variable_keys(variable):
            _SYNCED[key] = RUNTIME.generation
    for key, check in _CHECKS.items():
        if check.alive() and _synced(key[2]):
            check.generation = RUNTIME.generation
            _settle(check)


def _synced(ids: tuple[int, ...]) -> bool:
    return all(_SYNCED.get(i) == RUNTIME.generation for i in ids)


def before_reduce(sources: Sequence[Any] | None, local: set[int], process_set: ProcessSet,
                  tolerance: int, where: str, partial: str) -> list[Any]:
    """Checks (eagerly) or adds to the step (traced) that every rank of ``process_set`` holds
    the same ``sources`` that are variables (except ``local`` ones). Returns what the
    reduction must wait for. ``tolerance``: the calls a difference may last (the passes of
    one update); ``where`` and ``partial`` go into the error (what reduces, and its form
    with local layers)."""
    if (sources is None or _weight_check.in_checked_fit_step()
            or not RUNTIME.config.check_weights):
        return []
    ranks = process_set.members()
    variables = [v for v in sources if is_variable(v) and not variable_keys(v) & local]
    if len(ranks) < 2 or not variables:
        return []
    check = state_for(_CHECKS, (tolerance, id(process_set), tuple(map(id, variables))),
                      variables, lambda: _Check(variables))
    if check.generation != RUNTIME.generation:  # a new world (elastic): compare anew
        check.generation = RUNTIME.generation
        check.settled = False
        with tf.init_scope():
            check.state.assign(0)
    if not check.settled and _synced(tuple(map(id, variables))):
        _settle(check)
    if check.settled:
        return []
    text = {"where": where, "advice": _ADVICE, "partial": partial}
    if tf.executing_eagerly():
        _compare_now(check, variables, process_set, tolerance, text)
        return []
    # Tracing (on every rank alike): weights equal now settle it, and the step gets nothing
    # (a program that broadcast before its loop; Horovod's step traced again after its
    # first call). Else the step compares each time it runs, until settled.
    with tf.init_scope():
        if int(check.state.numpy()) == _PASSED:
            check.settled = True
            return []
        mismatch = _weight_check.compare_variables(variables, text, process_set)
        if mismatch is None:
            _settle(check)
            return []
        if mismatch.layout:  # no broadcast mends it
            raise mismatch
    return [_compare_in_graph(check, variables, ranks, process_set, tolerance, text)]


def _compare_now(check: _Check, variables: list[Any], process_set: ProcessSet,
                 tolerance: int, text: dict[str, str]) -> None:
    state = int(check.state.numpy())
    if state == _PASSED:  # settled by a traced step
        check.settled = True
        return
    mismatch = _weight_check.compare_variables(variables, text, process_set)
    if mismatch is None:
        _settle(check)
    elif state >= tolerance or mismatch.layout:
        raise mismatch
    else:
        check.state.assign(state + 1)


def _settle(check: _Check) -> None:
    check.state.assign(_PASSED)
    check.settled = True


def _compare_in_graph(check: _Check, variables: list[Any], ranks: list[int],
                      process_set: ProcessSet, tolerance: int, text: dict[str, str]) -> tf.Tensor:
    layout = Layout(variables)
    width, head = 2 + len(layout.tags) + len(variables), 2 + len(layout.tags)
    # The rows every rank's eager comparison sends too: a rank that traces the step again
    # compares eagerly while the others run this.
    different = _weight_check.LAYOUT_TEMPLATE.format(
        where=text["where"], detail="a list of variables that differs in length, dtype or shape "
        "on some rank")

    def compare():
        state = check.state.read_value()
        sums = [_weight_check.fingerprint(_weight_check.value_of(v)) for v in variables]
        with tf.device("/CPU:0"):  # the sums, summed where the weights are, travel by host
            everyone = allgather(row(layout, sums), name=_weight_check.NAME,
                                 process_set=process_set)
            total = len(ranks) * width
            fits = tf.equal(tf.size(everyone), total)
            padded = tf.concat([everyone, tf.zeros([tf.maximum(total - tf.size(everyone), 0)],
                                                   tf.int64)], 0)[:total]
            table = tf.reshape(padded, [len(ranks), width])
        same = tf.logical_and(fits, tf.reduce_all(tf.equal(table[:, :head], table[0, :head])))
        with tf.control_dependencies([tf.debugging.Assert(same, [different], summarize=1)]):
            prints = tf.identity(table[:, head:])
        unequal = tf.not_equal(prints, prints[0])
        differs = tf.reduce_any(unequal, axis=0)
        any_differ = tf.reduce_any(differs)
        failed = tf.logical_and(any_differ, state >= tolerance)
        message = _message(variables, ranks, differs, tf.reduce_any(unequal, axis=1), text)
        assertion = tf.debugging.Assert(tf.logical_not(failed), [message], summarize=1)
        with tf.control_dependencies([assertion]):
            return check.state.assign(tf.where(any_differ, state + 1, _PASSED))

    return tf.cond(tf.equal(check.state.read_value(), _PASSED),
                   lambda: tf.constant(_PASSED), compare)


def _message(variables: list[Any], ranks: list[int], differs: tf.Tensor, odd_ranks: tf.Tensor,
             text: dict[str, str]) -> tf.Tensor:
    """``_weight_check.TEMPLATE`` as a string tensor: the counts, names and ranks are the
    step's."""
    names = tf.boolean_mask(tf.constant([label(v) for v in variables]), differs)
    first = tf.strings.reduce_join(names[:SHOWN], separator="', '")
    more = tf.where(tf.size(names) > SHOWN, ", ...", "")
    shown = tf.strings.join(["'", first, "'", more])
    odd = tf.strings.reduce_join(
        tf.strings.as_string(tf.boolean_mask(tf.constant(ranks), odd_ranks)), separator=", ")
    fields = {"count": tf.strings.as_string(tf.size(names)), "shown": shown, "odd": odd}
    template = _weight_check.TEMPLATE.format(
        total=len(variables), first=ranks[0], count="{count}", shown="{shown}", odd="{odd}",
        **{"kind": "trainable weights", **text})
    pieces = re.split(r"\{(count|shown|odd)\}", template)  # text, field, text, field, ...
    return tf.strings.join([fields[p] if i % 2 else p for i, p in enumerate(pieces)])
