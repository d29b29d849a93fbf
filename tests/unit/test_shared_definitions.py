"""Definitions that must agree where one copy cannot serve: the reduce-op numbering of Python
and C++, and the launcher variables of the package and of keras-ring-run's per-rank wrapper
(a stdlib-only script that cannot import keras_ring)."""

import re
from pathlib import Path

from keras_ring import _rank_wrapper, config
from keras_ring.ops.reduce_op import ReduceOp

ROOT = Path(__file__).resolve().parents[2]
COMMON_H = ROOT / "keras_ring" / "ops" / "cc" / "core" / "common.h"


def _cpp_enum(text: str, name: str) -> dict[str, int]:
    """``enum class <name>``'s enumerators and values, without the ``k`` prefix."""
    body = re.search(rf"enum class {name}\b[^{{]*\{{(?P<body>[^}}]*)\}}", text)
    assert body, f"no enum class {name} in {COMMON_H}"
    entries = [e.strip() for e in re.sub(r"//[^\n]*", "", body["body"]).split(",") if e.strip()]
    values = {}
    for entry in entries:
        m = re.fullmatch(r"k(?P<name>\w+)\s*=\s*(?P<value>-?\d+)", entry)
        assert m, f"{name} enumerator {entry!r} has no explicit value: compare it by hand"
        values[m["name"]] = int(m["value"])
    return values


def test_reduce_op_numbering_matches_the_cpp_enum():
    cpp = _cpp_enum(COMMON_H.read_text(), "ReduceOp")
    assert cpp == {op.name: op.value for op in ReduceOp}


def test_the_rank_wrapper_reads_the_same_rank_variables():
    assert _rank_wrapper.RANK_VARIABLES == config.RANK_VARIABLES


def test_a_child_without_mpi_prefixed_variables_is_no_mpi_rank():
    # The tests start children without these prefixes: bootstrap.launched_by_mpi() must be
    # False there.
    assert all(v.startswith(config.MPI_VARIABLE_PREFIXES) for v in config.MPI_LAUNCHER_VARIABLES)
