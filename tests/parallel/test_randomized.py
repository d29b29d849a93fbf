"""Randomised sequences of collectives, and randomised single-rank divergences in them.

Hypothesis draws the same examples in the same order on every rank: the seed changes from
run to run (rank 0 draws it, every rank uses it; KERAS_RING_TEST_SEED replays a run, and
every failure message names the seed), and there is no database, no shrinking and no
timing-based health check, so the ranks run the same program; every example is checked to be
the same on every rank before it runs.
Every rank computes every rank's input from seeds (tests/reference.py), so each checks its
results against numpy locally. Verdicts are agreed collectively (an allgather of per-rank
flags) before anything raises, so all ranks fail or pass together and stay in step.

Divergences: one rank changes the shape, dtype, reduce op, scale, root or name of one
collective, names an out-of-range root, skips a collective, or runs an extra one. That
collective must raise on every rank, never return a result; afterwards the ranks are back in
step (see ``_plan``) and the rest of the sequence must give correct results again.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import zlib

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, Phase, event, given, seed, settings
from hypothesis import strategies as st

import keras_ring as kr
from tests.reference import (GATHER_DTYPES, OP_NAMES, REDUCE_DTYPES, assert_same, rank_input,
                             reduce_reference)

# Examples draw per-rank values (allgather rows, roots, the diverging rank) for this many
# ranks: at least 4, so that a seed replays the same examples at 2 and 4 ranks.
MAX_RANKS = max(4, kr.size())


def _run_seed() -> int:
    """This run's seed: KERAS_RING_TEST_SEED, else drawn by rank 0; the same on every rank.
    (A collective at import: every rank imports this module at the same point.)"""
    chosen = os.environ.get("KERAS_RING_TEST_SEED", "").strip()
    seed = int(chosen) if chosen else (secrets.randbits(32) if kr.rank() == 0 else None)
    return int(kr.broadcast_object(seed, root_rank=0))


RUN_SEED = _run_seed()
print(f"\ntest_randomized: seed {RUN_SEED} (replay with KERAS_RING_TEST_SEED={RUN_SEED})")
SETTINGS = dict(
    derandomize=False, database=None, deadline=None, print_blob=False,
    phases=(Phase.explicit, Phase.generate),  # shrinking could run rank-specific examples
    suppress_health_check=list(HealthCheck),  # health checks depend on timing
)
SCALES = [1.0, 0.5, 2.0]
# What moves inside the signature exchange instead of through the ring (signature.h).
INLINE_BYTES = 4608 - 288  # kSlotBytes - sizeof(Signature)
# Large tensors span this many bytes: past the inline limit for every dtype, through the
# fast agreement's ride limits (8 and 32 KiB: riding, recursive doubling, the ring), and
# across ring segments where the run sets small ones (make test runs this suite with 8 KiB
# segments).
LARGE_BYTES = (INLINE_BYTES + 1, 96 << 10)


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # allreduce | grouped_allreduce | allgather | broadcast
    name: str | None
    dtypes: tuple  # one per tensor (several only for grouped_allreduce)
    shapes: tuple  # one per tensor; for allgather the first dimension is rows[rank]
    rows: tuple = (0,) * MAX_RANKS
    op: str = "Sum"
    root: int = 0  # taken modulo the world size, unless raw_root
    raw_root: bool = False
    prescale: float = 1.0
    postscale: float = 1.0
    seed: int = 0


_small = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


def _large(dtype: tf.DType):
    """A shape of LARGE_BYTES for ``dtype``: one dimension or rows of 5 (odd sizes)."""
    lo, hi = (b // dtype.size for b in LARGE_BYTES)
    return st.one_of(st.tuples(st.integers(lo, hi)),
                     st.tuples(st.integers(lo // 5 + 1, hi // 5), st.just(5)))


def _shape(dtype: tf.DType):
    return st.one_of(_small, _small, _small, _large(dtype))


@st.composite
def ops(draw, name: str | None):
    kind = draw(st.sampled_from(["allreduce", "grouped_allreduce", "allgather", "broadcast"]))
    seed = draw(st.integers(0, 2**31 - 1))
    if kind in ("allreduce", "grouped_allreduce"):
        n = 1 if kind == "allreduce" else draw(st.integers(1, 4))
        dtypes = tuple(draw(st.sampled_from(REDUCE_DTYPES)) for _ in range(n))
        shapes = tuple(draw(_shape(d)) for d in dtypes)
        return Op(kind, name, dtypes, shapes, op=draw(st.sampled_from(OP_NAMES)),
                  prescale=draw(st.sampled_from(SCALES)), postscale=draw(st.sampled_from(SCALES)),
                  seed=seed)
    dtype = draw(st.sampled_from(GATHER_DTYPES))
    if kind == "allgather":
        row = draw(st.lists(st.integers(1, 4), max_size=2).map(tuple))
        rows = tuple(draw(st.lists(st.integers(0, 6), min_size=MAX_RANKS, max_size=MAX_RANKS)))
        if draw(st.booleans()) and not row:  # sometimes many rows: the ring path
            rows = tuple(r * (LARGE_BYTES[0] // dtype.size // 4 + 1) for r in rows)
        return Op(kind, name, (dtype,), ((0, *row),), rows=rows, seed=seed)
    return Op(kind, name, (dtype,), (draw(_shape(dtype)),),
              root=draw(st.integers(0, MAX_RANKS - 1)), seed=seed)


@st.composite
def sequences(draw, min_size=20, max_size=50, always_named=False):
    n = draw(st.integers(min_size, max_size))
    named = [always_named or draw(st.integers(0, 4)) > 0 for _ in range(n)]
    return [draw(ops(f"r{i}" if named[i] else None)) for i in range(n)]


# --- running an op and its numpy reference ---------------------------------------------------

def _shapes_for(op: Op, rank: int) -> list[tuple]:
    if op.kind == "allgather":
        return [(op.rows[rank], *op.shapes[0][1:])]
    return list(op.shapes)


def _inputs(op: Op, rank: int) -> list[np.ndarray]:
    return [rank_input(dtype, shape, rank, seed=op.seed + j, op=op.op)
            for j, (dtype, shape) in enumerate(zip(op.dtypes, _shapes_for(op, rank)))]


def _run(op: Op, rank: int, size: int) -> list[np.ndarray]:
    xs = [tf.constant(x) for x in _inputs(op, rank)]
    if op.kind == "allreduce":
        out = [kr.allreduce(xs[0], op=getattr(kr, op.op), name=op.name,
                            prescale_factor=op.prescale, postscale_factor=op.postscale)]
    elif op.kind == "grouped_allreduce":
        out = kr.grouped_allreduce(xs, op=getattr(kr, op.op), name=op.name,
                                   prescale_factor=op.prescale, postscale_factor=op.postscale)
    elif op.kind == "allgather":
        out = [kr.allgather(xs[0], name=op.name)]
    else:
        root = op.root if op.raw_root else op.root % size
        out = [kr.broadcast(xs[0], root_rank=root, name=op.name)]
    return [t.numpy() for t in out]


def _expected(op: Op, size: int) -> list[np.ndarray]:
    per_rank = [_inputs(op, r) for r in range(size)]
    if op.kind in ("allreduce", "grouped_allreduce"):
        return [reduce_reference([per_rank[r][j] for r in range(size)], op.op, dtype,
                                 op.prescale, op.postscale)
                for j, dtype in enumerate(op.dtypes)]
    if op.kind == "allgather":
        return [np.concatenate([per_rank[r][0] for r in range(size)], axis=0)]
    return [per_rank[op.root % size][0]]


def _check(op: Op, rank: int, size: int) -> str | None:
    """Runs ``op``; returns None if its result is right, else what went wrong."""
    try:
        got = _run(op, rank, size)
    except Exception as e:  # noqa: BLE001 - reported through the collective verdict
        return f"{op}: raised {type(e).__name__}: {e}"
    try:
        want = _expected(op, size)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    except AssertionError as e:
        return f"{op}: wrong result: {e}"
    return None


def _agree(problems: list[str], what: str) -> None:
    """Raises on every rank if any rank saw a problem (all ranks call this at the same point)."""
    flags = kr.allgather(tf.constant([len(problems)], tf.int32), name=f"verdict.{what}").numpy()
    if flags.any():
        bad = [r for r, f in enumerate(flags) if f]
        raise AssertionError(f"{what}: problems on ranks {bad} (seed {RUN_SEED}: replay with "
                             f"KERAS_RING_TEST_SEED={RUN_SEED}); here (rank {kr.rank()}):\n"
                             + "\n".join(problems[:5]))


def _same_example_everywhere(example) -> None:
    """Guards the premise: every rank is running the same hypothesis example."""
    digest = zlib.crc32(repr(example).encode())
    seen = kr.allgather(tf.constant([digest], tf.int64), name="example_digest").numpy()
    assert (seen == digest).all(), f"ranks draw different examples: {seen}"


# --- 1. random sequences ---------------------------------------------------------------------

@seed(RUN_SEED)
@settings(max_examples=30, **SETTINGS)
@given(seq=sequences())
def test_random_sequences_match_numpy(seq):
    rank, size = kr.rank(), kr.size()
    _same_example_everywhere(seq)
    problems = [p for p in (_check(op, rank, size) for op in seq) if p]
    _agree(problems, "sequence")


# --- 2. random single-rank divergences -------------------------------------------------------

MUTATIONS = {
    "shape": lambda op: True,
    "dtype": lambda op: True,
    "op": lambda op: op.kind in ("allreduce", "grouped_allreduce"),
    "scale": lambda op: op.kind in ("allreduce", "grouped_allreduce"),
    "root": lambda op: op.kind == "broadcast",
    "root_range": lambda op: op.kind == "broadcast",
    "name": lambda op: True,
    "skip": lambda op: True,
    "extra": lambda op: True,
}


@dataclasses.dataclass(frozen=True)
class Divergence:
    rank: int  # taken modulo the world size
    at: int    # index of the collective that diverges
    how: str


@st.composite
def divergent_sequences(draw):
    seq = draw(sequences(always_named=True))
    how = draw(st.sampled_from(sorted(MUTATIONS)))
    # Not the last collective: a "skip" needs one after it.
    candidates = [i for i in range(len(seq) - 1) if MUTATIONS[how](seq[i])]
    if not candidates:  # e.g. a root divergence but no broadcast: make one
        candidates = [draw(st.integers(0, len(seq) - 2))]
        seq[candidates[0]] = Op("broadcast", seq[candidates[0]].name, (tf.float32,), ((3,),),
                                root=draw(st.integers(0, MAX_RANKS - 1)))
    at = draw(st.sampled_from(candidates))
    return seq, Divergence(draw(st.integers(0, MAX_RANKS - 1)), at, how)


def _mutate(op: Op, how: str, size: int) -> Op:
    if how == "shape":
        shape = op.shapes[0]
        if op.kind == "allgather":  # rows may differ; the rest of the shape may not
            shape = shape + (1,) if len(shape) == 1 else (shape[0], shape[1] + 1, *shape[2:])
        else:
            shape = (shape[0] + 1, *shape[1:]) if shape else (1,)
        return dataclasses.replace(op, shapes=(shape, *op.shapes[1:]))
    if how == "dtype":
        allowed = REDUCE_DTYPES if op.kind in ("allreduce", "grouped_allreduce") else GATHER_DTYPES
        other = allowed[(allowed.index(op.dtypes[0]) + 1) % len(allowed)]
        return dataclasses.replace(op, dtypes=(other, *op.dtypes[1:]))
    if how == "op":
        return dataclasses.replace(op, op=OP_NAMES[(OP_NAMES.index(op.op) + 1) % len(OP_NAMES)])
    if how == "scale":
        return dataclasses.replace(op, prescale=op.prescale * 3)
    if how == "root":
        return dataclasses.replace(op, root=(op.root % size + 1) % size)
    if how == "root_range":
        return dataclasses.replace(op, root=size, raw_root=True)
    if how == "name":
        return dataclasses.replace(op, name=op.name + "~")
    raise AssertionError(how)


EXTRA = Op("allreduce", "extra_collective", (tf.float32,), ((3,),))


def _plan(seq: list[Op], d: Divergence, rank: int, size: int):
    """What this rank runs: (ops before, the op that must fail here, where to resume).

    skip:  the divergent rank runs seq[at+1] where the others run seq[at]; both fail, and
           every rank resumes at at+2.
    extra: the divergent rank runs EXTRA where the others run seq[at]; both fail, and every
           rank resumes at at+1 (the divergent rank's seq[at] is dropped with its extra).
    other: the divergent rank runs a changed seq[at]; every rank resumes at at+1.
    """
    diverges = rank == d.rank % size
    if d.how == "skip":
        return seq[d.at + 1] if diverges else seq[d.at], d.at + 2
    if d.how == "extra":
        return EXTRA if diverges else seq[d.at], d.at + 1
    return _mutate(seq[d.at], d.how, size) if diverges else seq[d.at], d.at + 1


def _must_fail(op: Op, d: Divergence, rank: int, size: int) -> list[str]:
    """Runs the divergent collective: it must raise the error for its kind, never return."""
    expected = kr.CollectiveArgumentError if d.how == "root_range" else kr.CollectiveMismatchError
    try:
        result = _run(op, rank, size)
    except expected as e:
        if d.how != "root_range" and "mismatch" not in str(e):
            return [f"{d}: the error does not say what diverged: {e}"]
        return []
    except Exception as e:  # noqa: BLE001
        return [f"{d}: {op} raised {type(e).__name__}, not {expected.__name__}: {e}"]
    return [f"{d}: {op} returned a result instead of failing: {result}"]


@seed(RUN_SEED)
@settings(max_examples=60, **SETTINGS)
@given(example=divergent_sequences())
def test_random_divergence_fails_on_every_rank(example):
    seq, d = example
    event(f"divergence: {d.how} in {seq[d.at].kind}")
    rank, size = kr.rank(), kr.size()
    _same_example_everywhere(example)
    failing, resume = _plan(seq, d, rank, size)
    problems = [p for p in (_check(op, rank, size) for op in seq[:d.at]) if p]
    _agree(problems, "before the divergence")

    _agree(_must_fail(failing, d, rank, size), f"at the divergence {d}")

    # Back in step: the rest of the sequence gives correct results again.
    problems = [p for p in (_check(op, rank, size) for op in seq[resume:]) if p]
    _agree(problems, f"after the divergence {d}")


@pytest.mark.parametrize("how", sorted(MUTATIONS))
def test_each_divergence_kind_once(world, how):
    """Every kind of divergence on a fixed, named sequence, whatever hypothesis draws."""
    rank, size = world
    seq = [Op("allreduce", "a0", (tf.float32,), ((5,),), op="Sum"),
           Op("broadcast", "b1", (tf.int32,), ((4, 2),), root=1),
           Op("grouped_allreduce", "g2", (tf.float64, tf.int8), ((3,), (2, 2)), op="Max"),
           Op("allgather", "c3", (tf.float16,), ((0, 3),),
              rows=(1, 0, 2, 3) + (2,) * (MAX_RANKS - 4)),
           Op("allreduce", "a4", (tf.int64,), ((2,),), op="Min")]
    at = 1 if how in ("root", "root_range") else 0
    d = Divergence(size - 1, at, how)
    failing, resume = _plan(seq, d, rank, size)
    _agree(_must_fail(failing, d, rank, size), f"at {d}")
    problems = [p for p in (_check(op, rank, size) for op in seq[resume:]) if p]
    _agree(problems, f"after {d}")


# --- NaN and Inf across ranks ------------------------------------------------------------------

def _specials(rank: int, size: int) -> np.ndarray:
    """Per column: where NaN and infinities appear on some ranks only."""
    last = rank == size - 1
    first = rank == 0
    return np.array([
        np.nan if first else 1.0,                      # NaN on one rank
        np.nan if last else -3.0,                      # ... on another
        np.inf if first else 1.0,                      # +inf on one rank
        -np.inf if first else 1.0,                     # -inf on one rank
        np.inf if first else (-np.inf if last else 0),  # +inf meets -inf: NaN for sums
        -np.inf if last else 2.0,
        2.0 + rank,                                    # ordinary
    ])


@pytest.mark.parametrize("repeat", [1, 1000], ids=["inline", "ring"])
@pytest.mark.parametrize("op", OP_NAMES)
@pytest.mark.parametrize("dtype", [d for d in REDUCE_DTYPES if d.is_floating], ids=lambda d: d.name)
def test_nan_and_inf_propagate_across_ranks(world, dtype, op, repeat):
    """Like numpy: a NaN on any rank gives NaN (Min and Max too), inf + -inf gives NaN."""
    rank, size = world
    inputs = [np.tile(_specials(r, size), repeat).astype(dtype.as_numpy_dtype) for r in range(size)]
    with np.errstate(invalid="ignore"):
        want = reduce_reference(inputs, op, dtype)
    got = kr.allreduce(tf.constant(inputs[rank]), op=getattr(kr, op), name=f"special.{op}")
    assert_same(got.numpy(), want)
