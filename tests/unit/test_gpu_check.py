"""The pure logic of benchmarks/gpu_check.py (the GPU machine runs the rest): reference
results, dtype handling, the benchmark plan and the table. A wrong reference there would
make a correct GPU run fail, or a wrong one pass."""

import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)


def test_bfloat16_bits_round_to_nearest_even():
    values = np.array([1.0, -2.5, 3.0e-3, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8], np.float32)
    bits = gc.bf16_bits(values)
    assert bits[0] == 0x3F80 and bits[1] == 0xC020
    assert gc.bf16_values(bits[3:]).tolist() == [1.0, 1.0 + 2 ** -6]  # ties to even
    assert abs(gc.bf16_values(bits[2:3])[0] - 3.0e-3) < 3.0e-3 * 2 ** -8


@pytest.mark.parametrize("name", list(gc.DTYPES))
def test_inputs_are_deterministic_and_in_their_storage_type(name):
    a = gc.rank_input(name, "Sum", 1000, rank=1)
    assert a.dtype == gc.storage_dtype(name)
    assert np.array_equal(a, gc.rank_input(name, "Sum", 1000, rank=1))
    assert not np.array_equal(a, gc.rank_input(name, "Sum", 1000, rank=0))


def test_integer_average_truncates_toward_zero_and_sums_wrap():
    inputs = [np.array([-3, 3, 7, -7], np.int32), np.array([0, 0, 0, 0], np.int32)]
    assert gc.reference_allreduce("int32", "Average", inputs).tolist() == [-1, 1, 3, -3]
    u = [np.array([200], np.uint8), np.array([100], np.uint8)]
    assert gc.reference_allreduce("uint8", "Sum", u).tolist() == [44]


def test_float_reference_applies_scale_factors_around_the_reduction():
    inputs = [np.array([2.0, -4.0]), np.array([3.0, -4.0])]
    got = gc.reference_allreduce("float64", "Average", inputs, prescale=0.5, postscale=3.0)
    assert got.tolist() == [3.75, -6.0]
    assert gc.reference_allreduce("float64", "Max", inputs).tolist() == [3.0, -4.0]
    bf = [gc.bf16_bits(np.array([1.5], np.float32)), gc.bf16_bits(np.array([2.0], np.float32))]
    assert gc.bf16_values(gc.reference_allreduce("bfloat16", "Sum", bf)).tolist() == [3.5]


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "int8", "uint8", "int64"])
@pytest.mark.parametrize("op", list(gc.OPS))
def test_references_of_generated_inputs_are_exact_where_the_gpu_must_be(name, op):
    # Small integers (and products of halves and ones) stay exact in every dtype, so the
    # tolerances only absorb NCCL's own rounding of Average's 1/n.
    inputs = [gc.rank_input(name, op, 4096, r) for r in range(2)]
    want = gc.reference_allreduce(name, op, inputs)
    exact = np.stack([gc.as_float64(name, x) for x in inputs])
    exact = {"Sum": exact.sum(0), "Average": exact.sum(0) / 2, "Min": exact.min(0),
             "Max": exact.max(0), "Product": exact.prod(0)}[op]
    if name in gc.RTOL or op != "Average":
        assert np.array_equal(gc.as_float64(name, want), exact)
    else:  # integer Average truncates toward zero, which the exact mean shows where it may
        assert np.array_equal(gc.as_float64(name, want), np.trunc(exact))
    # close() accepts the reference and refuses it one unit (or more than RTOL) away.
    assert gc.close(name, want, want)
    bumped = gc.as_float64(name, want) + np.maximum(1.0, np.abs(gc.as_float64(name, want)) * 0.5)
    bumped = (gc.bf16_bits(bumped.astype(np.float32)) if name == "bfloat16"
              else bumped.astype(gc.storage_dtype(name)))
    assert not gc.close(name, want, bumped)


def test_close_is_exact_for_integers_and_relative_for_floats():
    assert not gc.close("int32", np.array([1]), np.array([2]))
    assert gc.close("float32", np.array([1.0], np.float32), np.array([1.0 + 1e-7], np.float32))
    assert not gc.close("float32", np.array([1.0], np.float32), np.array([1.001], np.float32))
    assert not gc.close("float32", np.zeros(2, np.float32), np.zeros(3, np.float32))


def test_benchmark_plan_is_the_same_everywhere_and_bounded():
    sizes = gc.bench_sizes(1 << 28)
    assert sizes[0] == 8 and sizes[-1] <= 1 << 28 and len(sizes) == 13
    iters = [gc.iterations(s) for s in sizes]
    assert iters == sorted(iters, reverse=True) and iters[0] == 200 and iters[-1] == 5
    # Worst case on a slow link (10 GB/s): the timed loops stay well under a minute.
    assert sum(i * max(s, 1 << 16) / 10e9 for i, s in zip(iters, sizes)) < 30


def test_bus_bandwidth_is_nccl_tests_definition():
    assert gc.bandwidths(1_000_000_000, 1.0, 2) == (1.0, 1.0)
    assert gc.bandwidths(1_000_000_000, 0.5, 4) == (2.0, 3.0)


def test_table_shows_both_implementations_or_only_keras_ring():
    rows = [{"bytes": 1024, "kr_us": 12.5, "kr_algbw": 0.08, "kr_busbw": 0.08,
             "torch_us": 10.0, "torch_algbw": 0.1, "torch_busbw": 0.1}]
    text = gc.table(rows, 2, "torch 2.5 nccl 2.21.5")
    assert "keras_ring us" in text and "torch 2.5 nccl 2.21.5 us" in text and "12.5" in text
    assert "torch" not in gc.table(rows, 2, None)


def test_version_strings():
    assert gc.nccl_version_string(23004) == "2.30.4"
    assert gc.nccl_version_string(2804) == "2.8.4"


def test_the_shell_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)
