"""horovodrun's flags in ``keras-ring-run``: a Horovod job's launch line runs unchanged.

Each flag of horovodrun is one of three things here:

- **translated**: keras_ring has the same setting as an environment variable, which the
  launcher sets for every rank (``--fusion-threshold-mb 64`` is
  ``KERAS_RING_BUCKET_BYTES=67108864``);
- **without effect**: a knob of Horovod's own machinery that keras_ring does not have
  (``--cycle-time-ms``, ``--autotune``); accepted, and one line says why it does nothing;
- **refused**: a flag whose absence would change what the job does (``--output-filename``,
  ``--ssh-port``); the error says what to do instead.

``--mpi-args`` passes its words to mpirun, as horovodrun did.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field

MIB = 1 << 20


def _bucket_bytes(value: str) -> str:
    mb = _number(value, "--fusion-threshold-mb", integer=True)
    # Horovod's 0 turns fusion off; keras_ring's smallest bucket is one byte: every gradient
    # then goes alone (but for the first bucket, see wrap's first_bucket_bytes).
    return str(max(int(mb) * MIB, 1))


def _seconds(flag: str):
    def convert(value: str) -> str:
        return repr(_number(value, flag))
    return convert


def _interfaces(values: list[str]) -> str:
    names = [n for value in values for n in value.split(",") if n]
    return "=" + ",".join(names)  # NCCL's syntax: exactly these names


def _number(value: str, flag: str, integer: bool = False) -> float:
    try:
        number = int(value) if integer else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} takes a number, got {value!r}") from None
    if number < 0 or (not integer and number == 0):
        raise argparse.ArgumentTypeError(f"{flag} must be positive, got {value!r}")
    return number


# flag -> (environment variable, conversion of the flag's value or values)
TRANSLATED = {
    "--fusion-threshold-mb": ("KERAS_RING_BUCKET_BYTES", _bucket_bytes),
    "--timeline-filename": ("KERAS_RING_TIMELINE", str),
    "--stall-check-warning-time-seconds": (
        "KERAS_RING_STALL_WARNING_SECONDS", _seconds("--stall-check-warning-time-seconds")),
    "--stall-check-shutdown-time-seconds": (
        "KERAS_RING_TIMEOUT_SECONDS", _seconds("--stall-check-shutdown-time-seconds")),
    "--gloo-timeout-seconds": ("KERAS_RING_TIMEOUT_SECONDS", _seconds("--gloo-timeout-seconds")),
    "--elastic-timeout": ("KERAS_RING_ELASTIC_TIMEOUT_SECONDS", _seconds("--elastic-timeout")),
    "--network-interfaces": ("KERAS_RING_SOCKET_IFNAME", _interfaces),
    "--tcp": ("KERAS_RING_SHM", lambda _: "0"),
}
_REPEATED = {"--network-interfaces"}  # also given as --network-interface, once per name
# Translated flags whose 0 is Horovod's "never" (its default), which keras_ring has not.
_ZERO_IS_NEVER = {
    "--stall-check-shutdown-time-seconds": "keras_ring's waits always end, after "
                                           "KERAS_RING_TIMEOUT_SECONDS (300 s by default)"}

# flag -> (takes a value, why it does nothing here)
WITHOUT_EFFECT = {
    "--verbose": (False, "keras-ring-run has no extra messages to print"),
    "--disable-cache": (False, "keras-ring-run runs no start-up checks to cache"),
    "--mpi": (False, "keras-ring-run always starts the ranks through mpirun"),
    "--start-timeout": (True, "ranks wait for each other at init() for up to "
                              "KERAS_RING_TIMEOUT_SECONDS (300 s by default)"),
    "--cycle-time-ms": (True, "keras_ring has no background cycle: a bucket starts as soon "
                              "as its gradients exist"),
    "--cache-capacity": (True, "keras_ring's signature agreement needs no response cache"),
    "--hierarchical-allreduce": (False, "keras_ring's ring already uses shared memory "
                                        "within a host and TCP between hosts"),
    "--no-hierarchical-allreduce": (False, "keras_ring has no hierarchical allreduce"),
    "--hierarchical-allgather": (False, "keras_ring has no hierarchical allgather"),
    "--no-hierarchical-allgather": (False, "keras_ring has no hierarchical allgather"),
    "--autotune": (False, "keras_ring measures its bucket size once at the start of "
                          "training (KERAS_RING_BUCKET_BYTES sets it)"),
    "--no-autotune": (False, "keras_ring has no autotuner (KERAS_RING_BUCKET_BYTES fixes the "
                             "bucket size it measures)"),
    "--torus-allreduce": (False, "keras_ring has no torus allreduce"),
    "--no-torus-allreduce": (False, "keras_ring has no torus allreduce"),
    "--stall-check": (False, "keras_ring's stall warning and timeout are always on"),
    "--autotune-log-file": (True, "keras_ring has no autotuner"),
    "--autotune-warmup-samples": (True, "keras_ring has no autotuner"),
    "--autotune-steps-per-sample": (True, "keras_ring has no autotuner"),
    "--autotune-bayes-opt-max-samples": (True, "keras_ring has no autotuner"),
    "--autotune-gaussian-process-noise": (True, "keras_ring has no autotuner"),
    "--timeline-mark-cycles": (False, "keras_ring has no cycles to mark"),
    "--no-timeline-mark-cycles": (False, "keras_ring has no cycles to mark"),
    "--num-nccl-streams": (True, "keras_ring runs NCCL on one stream per process set"),
    "--thread-affinity": (True, "keras_ring's runtime thread is not pinned"),
    "--mpi-threads-disable": (False, "keras_ring uses MPI only to find its peers"),
    "--no-mpi-threads-disable": (False, "keras_ring uses MPI only to find its peers"),
    "--log-level": (True, "keras_ring prints only warnings and errors"),
    "--log-with-timestamp": (False, "keras_ring's messages carry no timestamps"),
    "--log-without-timestamp": (False, "keras_ring's messages carry no timestamps"),
    "--log-hide-timestamp": (False, "keras_ring's messages carry no timestamps"),
    "--no-log-hide-timestamp": (False, "keras_ring's messages carry no timestamps"),
}

# flag -> what to do instead
REFUSED = {
    "--ssh-port": "put a 'Host' entry with its 'Port' in ~/.ssh/config (mpirun starts remote "
                  "ranks through ssh)",
    "--ssh-identity-file": "put a 'Host' entry with its 'IdentityFile' in ~/.ssh/config",
    "--output-filename": "redirect keras-ring-run's output (each line starts with its rank) "
                         "or write files from the program",
    "--config-file": "give the settings as flags or KERAS_RING_* environment variables (see "
                     "the README's 'Environment variables')",
    "--gloo": "keras-ring-run starts ranks through mpirun; without MPI, launch as the "
              "README's 'Launching without mpirun' says, or use the elastic flags",
    "--jsrun": "start the ranks with jsrun yourself: keras_ring.init() finds its peers "
               "through MPI under any launcher",
    "--binding-args": "pass mpirun's binding options with --mpi-args",
    "--check-build": "ask keras_ring: python -c 'import keras_ring as k; print(k.nccl_built(), "
                     "k.cuda_built(), k.mpi_built())'",
    "--slots-per-host": "have the discovery script print 'host:slots' lines",
    "--reset-limit": "keras_ring's elastic jobs have no reset limit",
    "--blacklist-cooldown-range": "keras_ring blacklists a host for the rest of the job "
                                  "after --blacklist-after failures",
    "--no-stall-check": "keras_ring's waits always end (KERAS_RING_TIMEOUT_SECONDS); "
                        "KERAS_RING_STALL_WARNING_SECONDS delays the warning",
    "--prefix-output-with-timestamp": "pipe the output through a timestamping tool (ts)",
}
_SHORT = {"--ssh-port": "-p", "--ssh-identity-file": "-i", "--check-build": "-cb",
          "--prefix-output-with-timestamp": "-prefix-timestamp"}
# The refused flags that take a value (the rest are switches).
_REFUSED_WITH_VALUE = {"--ssh-port", "--ssh-identity-file", "--output-filename",
                       "--config-file", "--binding-args", "--slots-per-host", "--reset-limit"}


@dataclass
class Settings:
    """What horovodrun's flags asked for: variables for every rank, words for mpirun."""

    env: dict[str, str] = field(default_factory=dict)
    mpi_args: list[str] = field(default_factory=list)


def add_to(parser: argparse.ArgumentParser) -> None:
    """Adds horovodrun's flags to ``parser``, in a group of their own."""
    group = parser.add_argument_group(
        "horovodrun's flags", "accepted so that a Horovod job's launch line runs unchanged: "
        "each either sets keras_ring's variable for it, does nothing (saying why), or is "
        "refused saying what to do instead")
    for flag in TRANSLATED:
        if flag == "--tcp":
            group.add_argument(flag, action="store_true", help="sets KERAS_RING_SHM=0")
        elif flag in _REPEATED:
            group.add_argument(flag, "--network-interface", action="append", metavar="NICS",
                               help="sets KERAS_RING_SOCKET_IFNAME to exactly these names")
        else:
            unit = "MB" if flag.endswith("-mb") else "FILE" if "filename" in flag else "SECONDS"
            group.add_argument(flag, metavar=unit, help=f"sets {TRANSLATED[flag][0]}")
    group.add_argument("--mpi-args", metavar="ARGS", default=None,
                       help="more arguments for mpirun, e.g. --mpi-args='-bind-to none'")
    for flag, (takes_value, _) in WITHOUT_EFFECT.items():
        group.add_argument(flag, **(dict(metavar="VALUE") if takes_value else
                                    dict(action="store_true")), help=argparse.SUPPRESS)
    for flag in REFUSED:
        names = [_SHORT[flag], flag] if flag in _SHORT else [flag]
        group.add_argument(*names, help=argparse.SUPPRESS,
                           **({"metavar": "VALUE"} if flag in _REFUSED_WITH_VALUE else
                              {"action": "store_true"}))


def _given(args: argparse.Namespace, flag: str):
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    return None if value is None or value is False else value


def settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    """The settings horovodrun's flags in ``args`` ask for; refused flags end in
    ``parser.error``; flags without effect print one line each to stderr."""
    for flag, instead in REFUSED.items():
        if _given(args, flag) is not None:
            shown = f"{_SHORT[flag]}/{flag}" if flag in _SHORT else flag
            parser.error(f"{shown} is horovodrun's and has no equivalent here: {instead}")
    result = Settings()
    for flag, (variable, convert) in TRANSLATED.items():
        value = _given(args, flag)
        if flag in _ZERO_IS_NEVER and value is not None and value.strip() in ("0", "0.0"):
            print(f"keras-ring-run: {flag} 0 (horovodrun's 'never') has no effect: "
                  f"{_ZERO_IS_NEVER[flag]}", file=sys.stderr)
            continue
        if value is not None:
            try:
                result.env[variable] = convert(value)
            except argparse.ArgumentTypeError as e:
                parser.error(str(e))
    for flag, (_, why) in WITHOUT_EFFECT.items():
        if _given(args, flag) is not None:
            print(f"keras-ring-run: {flag} (horovodrun's) has no effect: {why}",
                  file=sys.stderr)
    if args.mpi_args:
        result.mpi_args = shlex.split(args.mpi_args)
    return result
