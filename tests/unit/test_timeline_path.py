"""A KERAS_RING_TIMELINE that cannot be written fails init() on the rank that has it, and a
shutdown whose timeline (or any other step before it) fails still shuts the runtime down."""

import contextlib
import json
import subprocess
import sys
import tempfile

import pytest
import tensorflow as tf

import keras_ring as kr
from keras_ring import _lifecycle


@pytest.fixture(autouse=True)
def _shut_down_around():
    # init() of a running runtime returns at once, before any check: start from none (an
    # earlier module may leave its runtime up), and leave none to the next test.
    _shut_down()
    yield
    _shut_down()


def _shut_down():
    if kr.is_initialized():
        with contextlib.suppress(Exception):
            kr.shutdown()


@pytest.mark.parametrize("where, reason", [
    ("missing/dir/trace.json", "No such file or directory"),
    ("file/trace.json", "Not a directory"),  # its directory is a file
], ids=["missing_directory", "directory_is_a_file"])
def test_init_refuses_a_timeline_path_it_cannot_write(tmp_path, monkeypatch, where, reason):
    (tmp_path / "file").write_text("")
    path = str(tmp_path / where)
    monkeypatch.setenv("KERAS_RING_TIMELINE", path)
    with pytest.raises(ValueError, match=rf"KERAS_RING_TIMELINE='{path}'.*: {reason}"):
        kr.init()
    assert not kr.is_initialized()


def test_init_refuses_a_timeline_path_that_is_a_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_RING_TIMELINE", str(tmp_path))
    with pytest.raises(ValueError, match=r"KERAS_RING_TIMELINE=.* is a directory"):
        kr.init()
    assert not kr.is_initialized()


def test_the_init_check_leaves_no_file_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_RING_TIMELINE", str(tmp_path / "trace.json"))
    kr.init()
    try:
        assert list(tmp_path.iterdir()) == []  # the trace comes at shutdown, nothing before
    finally:
        kr.shutdown()
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_a_relative_path_is_where_it_pointed_at_init(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KERAS_RING_TIMELINE", "trace.json")
    kr.init()
    monkeypatch.chdir(tmp_path / "elsewhere")
    kr.shutdown()
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_failing_shutdown_step_still_shuts_down_and_warns(monkeypatch):
    def failing(config, topology, lib, leaving_with_error):
        raise OSError("disk full")

    ran = []
    monkeypatch.setattr(_lifecycle, "BEFORE_SHUTDOWN",
                        [failing, lambda *args: ran.append(True)])
    kr.init()
    with pytest.warns(RuntimeWarning, match=r"keras_ring.shutdown\(\): OSError: disk full"):
        kr.shutdown()
    assert not kr.is_initialized()
    assert ran == [True]  # the steps after the failing one ran too
    kr.init()  # a fresh start, not the half-stopped runtime
    assert kr.allreduce(tf.constant(2.0), op=kr.Sum).numpy() == 2.0
    kr.shutdown()


def test_a_timeline_directory_removed_after_init_goes_to_the_temp_directory(tmp_path,
                                                                            monkeypatch):
    directory = tmp_path / "out"
    directory.mkdir()
    fallback = tmp_path / "tmp"
    fallback.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(fallback))
    monkeypatch.setenv("KERAS_RING_TIMELINE", str(directory / "trace.json"))
    kr.init()
    kr.allreduce(tf.constant(1.0), name="before_removal")
    directory.rmdir()
    with pytest.warns(RuntimeWarning, match=r"could not be written to .*out/trace.json' "
                                            r"\(No such file or directory\); it was written "
                                            r"to .*tmp/trace\..*\.json' instead"):
        kr.shutdown()
    assert not kr.is_initialized()
    [written] = fallback.iterdir()
    events = json.loads(written.read_text())["traceEvents"]
    assert any(e["args"].get("collective") == "allreduce 'before_removal'" for e in events)


RANK0_BAD = """
import os, time
if os.environ.get("PMI_RANK", os.environ.get("KERAS_RING_RANK")) == "0":
    os.environ["KERAS_RING_TIMELINE"] = "/nonexistent-keras-ring-dir/trace.json"
import keras_ring as kr
start = time.monotonic()
try:
    kr.init()
except Exception as e:
    print(f"rank-error {type(e).__name__}: {e}", flush=True)
    print(f"after {time.monotonic() - start:.0f} s", flush=True)
    raise
"""


def test_a_bad_path_on_one_rank_fails_that_rank_clearly_and_the_job_in_bounded_time(
        tmp_path, mpirun, clean_env):
    script = tmp_path / "job.py"
    script.write_text(RANK0_BAD)
    env = dict(clean_env, KERAS_RING_TIMEOUT_SECONDS="20")
    env.pop("KERAS_RING_TIMELINE", None)
    proc = subprocess.run([mpirun, "-np", "2", sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert ("rank-error ValueError: KERAS_RING_TIMELINE='/nonexistent-keras-ring-dir/"
            "trace.json'") in out, out[-3000:]
    assert "No such file or directory" in out


def test_a_trace_that_cannot_be_written_anywhere_is_named_lost_and_shutdown_completes(
        tmp_path, monkeypatch):
    directory = tmp_path / "out"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))
    monkeypatch.setenv("KERAS_RING_TIMELINE", str(directory / "trace.json"))
    kr.init()
    directory.rmdir()
    with pytest.warns(RuntimeWarning, match=r"keras_ring.shutdown\(\): OSError: "
                                            r"KERAS_RING_TIMELINE: .* nor to the temp "
                                            r"directory \(No such file or directory\); it is lost"):
        kr.shutdown()
    assert not kr.is_initialized()
    assert list(tmp_path.iterdir()) == []  # no partial file left anywhere



def test_a_later_init_writes_a_trace_of_its_own(tmp_path, monkeypatch):
    # An elastic job's next world (and any later init()) would else overwrite the earlier
    # world's trace at its shutdown, losing it without a word.
    monkeypatch.setenv("KERAS_RING_TIMELINE", str(tmp_path / "trace.json"))
    texts = []
    for name in ("first_world", "second_world", "third_world"):
        kr.init()
        kr.allreduce(tf.ones([4]), name=name)
        kr.shutdown()
        texts.append({p.name: p.read_text() for p in tmp_path.iterdir()})
    first, second, third = (set(t) for t in texts)
    assert first == {"trace.json"}
    (later,) = second - first
    (last,) = third - second
    assert later.startswith("trace.world") and last.startswith("trace.world"), (later, last)
    # Each world's trace holds its own collectives, and the earlier ones stay as written.
    assert "first_world" in texts[2]["trace.json"] and "second_world" not in texts[2]["trace.json"]
    assert "second_world" in texts[2][later] and "first_world" not in texts[2][later]
    assert "third_world" in texts[2][last]
    assert texts[2]["trace.json"] == texts[0]["trace.json"]
