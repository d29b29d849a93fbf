"""keras-ring-run takes horovodrun's flags: a Horovod job's launch line runs unchanged.

Before, `keras-ring-run -np 4 --fusion-threshold-mb 64 python train.py` stopped at
"unrecognized arguments". Each flag now sets keras_ring's variable for it, does nothing
saying why, or is refused saying what to do instead.
"""

import json
import subprocess
import sys

import pytest

from keras_ring import launcher

from tests.unit.launcher_support import GUARD, LAUNCHER, rank_program, run

SHOW_ENV = """
import json
print(json.dumps({k: v for k, v in os.environ.items() if k.startswith("KERAS_RING_")
                  and k not in ("KERAS_RING_RUN_TOKEN", "KERAS_RING_RUN_STATUS")}))
"""


def test_translated_flags_reach_every_rank_as_keras_ring_variables(mpirun, clean_env, tmp_path):
    script = rank_program(tmp_path, SHOW_ENV)
    timeline = str(tmp_path / "timeline.json")
    code, out, err = run(mpirun, [
        "-np", "2", "--fusion-threshold-mb", "64", "--timeline-filename", timeline, "--tcp",
        "--network-interface", "eth0", "--network-interface", "eth1",
        "--stall-check-warning-time-seconds", "30", "--stall-check-shutdown-time-seconds",
        "120", "--mpi-args=-bind-to none", sys.executable, script], clean_env)
    assert code == 0, err
    lines = sorted(out.splitlines())
    assert [line[:4] for line in lines] == ["[0] ", "[1] "], out
    expected = {
        "KERAS_RING_BUCKET_BYTES": str(64 << 20), "KERAS_RING_TIMELINE": timeline,
        "KERAS_RING_SHM": "0", "KERAS_RING_SOCKET_IFNAME": "=eth0,eth1",
        "KERAS_RING_STALL_WARNING_SECONDS": "30.0",
        "KERAS_RING_TIMEOUT_SECONDS": "120.0"}  # over make test's own 60
    for line in lines:
        seen = json.loads(line[4:])
        assert {k: seen.get(k) for k in expected} == expected, line
    assert "horovodrun" not in err  # nothing to say about translated flags


def test_flags_without_effect_run_the_job_and_say_why_once(mpirun, clean_env, tmp_path):
    script = rank_program(tmp_path, "print('ran')\n")
    code, out, err = run(mpirun, ["--num-proc", "2", "--autotune", "--cycle-time-ms", "5",
                                  "--verbose", "--start-timeout=100",
                                  "--stall-check-shutdown-time-seconds", "0",
                                  sys.executable, script], clean_env)
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[0] ran", "[1] ran"]
    for flag, why in [("--stall-check-shutdown-time-seconds 0", "waits always end"),
                      ("--autotune", "measures its bucket size"),
                      ("--cycle-time-ms", "no background cycle"),
                      ("--verbose", "no extra messages"),
                      ("--start-timeout", "KERAS_RING_TIMEOUT_SECONDS")]:
        notes = [line for line in err.splitlines()
                 if line.startswith(f"keras-ring-run: {flag} (horovodrun's")
                 and "has no effect" in line]
        assert len(notes) == 1 and why in notes[0], err


def test_a_program_keeps_its_own_flags_of_the_same_names(mpirun, clean_env, tmp_path):
    # After the command, --tcp and --verbose are the program's: nothing translated.
    script = rank_program(tmp_path, SHOW_ENV + "print(sys.argv[1:])\n")
    code, out, err = run(mpirun, ["-np", "1", sys.executable, script, "--tcp", "--verbose"],
                         clean_env)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and lines[1] == "[0] ['--tcp', '--verbose']", out
    assert "KERAS_RING_SHM" not in json.loads(lines[0][4:]), out


@pytest.mark.parametrize("args, message", [
    (["-p", "2222"], "-p/--ssh-port is horovodrun's and has no equivalent here: put a 'Host' "
                     "entry with its 'Port' in ~/.ssh/config"),
    (["--output-filename", "logs"], "--output-filename is horovodrun's"),
    (["--gloo"], "'Launching without mpirun'"),
    (["-cb"], "k.nccl_built()"),
    (["--fusion-threshold-mb", "x"], "--fusion-threshold-mb takes a number, got 'x'"),
    (["--stall-check-shutdown-time-seconds", "-1"],
     "--stall-check-shutdown-time-seconds must be positive, got '-1'"),
    (["--min-np", "1", "--max-np", "2", "--host-discovery-script", "/bin/true",
      "--mpi-args=-v"],
     "--mpi-args: an elastic job starts its workers without mpirun"),
])
def test_refused_flags_and_bad_values_say_what_to_do(clean_env, args, message):
    proc = subprocess.run([sys.executable, "-I", str(LAUNCHER), "-np", "2", *args, "python",
                           "x.py"], env=clean_env, capture_output=True, timeout=GUARD)
    assert proc.returncode == 2
    assert message in proc.stderr.decode(), proc.stderr.decode()


def test_fusion_off_is_the_smallest_bucket_and_open_mpi_is_told_each_variable():
    args = launcher.parse_args(["-np", "2", "--fusion-threshold-mb", "0", "--tcp",
                                "--mpi-args", "--map-by slot", "python", "t.py"])
    assert args.horovodrun.env == {"KERAS_RING_BUCKET_BYTES": "1", "KERAS_RING_SHM": "0"}
    ompi = launcher.mpirun_command("mpirun", "openmpi", 2, None, ["python", "t.py"],
                                   args.horovodrun.env, args.horovodrun.mpi_args)
    exported = [ompi[i + 1] for i, word in enumerate(ompi) if word == "-x"]
    assert exported[1:] == ["KERAS_RING_BUCKET_BYTES", "KERAS_RING_SHM"]
    wrapper = ompi.index(launcher._WRAPPER) - 2  # after sys.executable -I
    assert ompi[wrapper - 2:wrapper] == ["--map-by", "slot"]


# Every spelling of horovod/runner/launch.py (Horovod 0.28), with a value where it takes one.
HOROVODRUN_LINE = [
    ["--disable-cache"], ["--start-timeout", "30"], ["--network-interfaces", "eth0"],
    ["--network-interface", "eth0"], ["--output-filename", "out"], ["--verbose"],
    ["--config-file", "c.yaml"], ["-p", "22"], ["--ssh-port", "22"], ["-i", "id"],
    ["--ssh-identity-file", "id"], ["-cb"], ["--check-build"], ["--fusion-threshold-mb", "64"],
    ["--cycle-time-ms", "5"], ["--cache-capacity", "1024"], ["--hierarchical-allreduce"],
    ["--no-hierarchical-allreduce"], ["--hierarchical-allgather"],
    ["--no-hierarchical-allgather"], ["--torus-allreduce"], ["--no-torus-allreduce"],
    ["--autotune"], ["--no-autotune"], ["--autotune-log-file", "tune.csv"],
    ["--autotune-warmup-samples", "3"], ["--autotune-steps-per-sample", "10"],
    ["--autotune-bayes-opt-max-samples", "20"], ["--autotune-gaussian-process-noise", "0.8"],
    ["--min-np", "1", "--max-np", "2", "--host-discovery-script", "d.sh"],
    ["--min-num-proc", "1", "--max-num-proc", "2", "--host-discovery-script", "d.sh"],
    ["--slots-per-host", "2"], ["--elastic-timeout", "600"], ["--reset-limit", "3"],
    ["--blacklist-cooldown-range", "10", "20"], ["--timeline-filename", "t.json"],
    ["--timeline-mark-cycles"], ["--no-timeline-mark-cycles"], ["--no-stall-check"],
    ["--stall-check"], ["--stall-check-warning-time-seconds", "60"],
    ["--stall-check-shutdown-time-seconds", "120"], ["--mpi-threads-disable"],
    ["--no-mpi-threads-disable"], ["--mpi-args=-bind-to none"], ["--tcp"],
    ["--binding-args", "x"], ["--num-nccl-streams", "1"], ["--thread-affinity", "0"],
    ["--gloo-timeout-seconds", "30"], ["--log-level", "WARNING"], ["--log-with-timestamp"],
    ["--log-without-timestamp"], ["-prefix-timestamp"], ["--prefix-output-with-timestamp"],
    ["--log-hide-timestamp"], ["--no-log-hide-timestamp"], ["-H", "localhost:2"],
    ["--hosts", "localhost:2"], ["--gloo"], ["--mpi"], ["--jsrun"],
]


@pytest.mark.parametrize("flags", HOROVODRUN_LINE, ids=lambda flags: flags[0])
def test_every_horovodrun_flag_is_taken_or_refused_saying_why(flags, capsys):
    # Never argparse's bare "unrecognized arguments": the flag is translated, does nothing
    # (saying why) or is refused naming what to do instead.
    try:
        launcher.parse_args(["-np", "2", *flags, "python", "t.py"])
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2 and "is horovodrun's and has no equivalent here" in err, err
    else:
        assert "unrecognized" not in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["-v", "--version"])
def test_version_is_keras_rings(flag, capsys):
    with pytest.raises(SystemExit) as info:
        launcher.parse_args([flag])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("keras-ring-run (keras_ring ")
