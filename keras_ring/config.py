"""Environment variables that configure keras_ring, read in one place with clear errors.

Also the names of the variables launchers set: the bootstrap, the rendezvous, the Spark
launcher and the tests read them from here. This module imports nothing of keras_ring, so
every layer may use it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

DEFAULT_TIMEOUT_SECONDS = 300.0
# How long a process of a failed job may run on before keras_ring ends it (see README).
DEFAULT_FAILURE_EXIT_SECONDS = 5.0

# The launch without MPI (keras_ring.rendezvous): this process's rank, the number of ranks,
# rank 0's rendezvous address, and how long the whole exchange may take.
RANK_VARIABLE = "KERAS_RING_RANK"
SIZE_VARIABLE = "KERAS_RING_SIZE"
RENDEZVOUS_VARIABLE = "KERAS_RING_RENDEZVOUS"
START_TIMEOUT_VARIABLE = "KERAS_RING_START_TIMEOUT_SECONDS"

# Elastic jobs (keras_ring.elastic): where the elastic rendezvous listens, this worker's id
# (unique in the job; the driver sets it), the job's secret, how long a job may stay below
# --min-np, and how long forming a world waits for a silent worker.
ELASTIC_RENDEZVOUS_VARIABLE = "KERAS_RING_ELASTIC_RENDEZVOUS"
ELASTIC_WORKER_VARIABLE = "KERAS_RING_ELASTIC_WORKER"
ELASTIC_SECRET_VARIABLE = "KERAS_RING_ELASTIC_SECRET"
ELASTIC_TIMEOUT_VARIABLE = "KERAS_RING_ELASTIC_TIMEOUT_SECONDS"
ELASTIC_JOIN_VARIABLE = "KERAS_RING_ELASTIC_JOIN_SECONDS"
DEFAULT_ELASTIC_TIMEOUT_SECONDS = 600.0

# Variables that MPI launchers (MPICH/Hydra, Open MPI, Intel MPI, Slurm's PMI) set in ranks:
# any of them means an MPI launcher started this process.
MPI_LAUNCHER_VARIABLES = (
    "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
    "HYDRA_CONTROL_FD", "PMI_FD",
)
# The prefixes of every variable those launchers set: a child process started without them
# is no MPI rank (it covers MPI_LAUNCHER_VARIABLES).
MPI_VARIABLE_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_")
# Where a rank of any launcher finds its rank, first match wins. keras-ring-run's per-rank
# wrapper keeps a copy (it runs as a stdlib-only script); a unit test checks that they agree.
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", RANK_VARIABLE, "SLURM_PROCID")


# The longest any seconds variable may ask for. Every wait must end (KERAS_RING_TIMEOUT_SECONDS
# bounds them all), so inf is no "never"; and the C++ core turns these values into nanosecond
# deadlines (int64: ~292 years from the clock's epoch) and prints them as int, where a value
# too large is undefined behaviour. A week is far longer than any wait a job means and far
# below those limits. Larger values are refused, not clamped: a clamp would quietly run with a
# bound the user never chose.
MAX_SECONDS = 7 * 24 * 3600.0


def seconds_from_env(name: str, default: float, minimum: float = 0.0) -> float:
    """Variable ``name`` as seconds greater than ``minimum``, at most ``MAX_SECONDS``;
    ``default`` when unset or empty.

    Raises:
        ValueError: the value is no number or out of range; the message names the variable.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not minimum < value <= MAX_SECONDS:  # also refuses nan and inf
        raise ValueError(f"{name} must be a number of seconds greater than {minimum:g} and at "
                         f"most {MAX_SECONDS:g} (a week), got {raw!r}")
    return value


def _seconds_or_off(name: str, default: float) -> float:
    """Seconds in [0, MAX_SECONDS], where 0 switches the behaviour off."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds (0: off), got {raw!r}") from None
    if not 0 <= value <= MAX_SECONDS:  # also refuses nan and inf
        raise ValueError(f"{name} must be 0 (off) or a number of seconds of at most "
                         f"{MAX_SECONDS:g} (a week), got {raw!r}")
    return value


def int_from_env(name: str, default: int, minimum: int = 1) -> int:
    """Variable ``name`` as an integer of at least ``minimum``; ``default`` when unset or empty.

    Raises:
        ValueError: the value is no integer or too small; the message names the variable.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {raw!r}")
    return value


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1 or 0 (true/false), got {raw!r}")


def _bytes_or_auto(name: str) -> int | None:
    """A positive byte count; None when unset, empty or "auto"."""
    raw = os.environ.get(name, "").strip()
    if raw.lower() in ("", "auto"):
        return None
    return int_from_env(name, 0, minimum=1)


def _power_of_two(name: str, default: int) -> int:
    value = int_from_env(name, default, minimum=4096)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


def _absolute_or_none(name: str) -> str | None:
    raw = os.environ.get(name)
    return os.path.abspath(raw) if raw else None


def check_timeline_path(path: str) -> None:
    """Raises ValueError unless this process can write the timeline at ``path``.

    Run by init() before the ranks connect: found only at shutdown(), a bad path used to cost
    the whole run's trace, and the write failing there must not keep the runtime up. The
    writer (keras_ring.timeline) creates a file beside ``path`` and renames it to ``path``
    (or, where a peer is gone, to ``<path less .json>.rank<N>.json``), on any rank: so every
    rank checks that it can create a file in that directory, and that ``path`` is no directory.
    """
    if os.path.isdir(path):
        raise ValueError(f"KERAS_RING_TIMELINE={path!r} is a directory; it must name the file "
                         "the trace is written to at shutdown()")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        # A name of its own: the ranks of a host check the same directory at once.
        fd, probe = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".check",
                                     dir=directory)
    except OSError as e:
        raise ValueError(f"KERAS_RING_TIMELINE={path!r}: the trace (written at shutdown()) "
                         f"cannot be written: cannot create a file in {directory!r}: "
                         f"{e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


@dataclass(frozen=True)
class Config:
    """What the environment asks for; see the README's table of variables."""

    timeout_seconds: float
    stall_warning_seconds: float
    failure_exit_seconds: float  # 0: a failed process is never ended by keras_ring
    segment_bytes: int
    host_id: str | None
    advertise_address: str | None
    socket_ifname: str | None
    use_shm: bool
    shm_channel_bytes: int
    timeline_path: str | None
    timeline_memory_events: int  # held before the runtime writes them to a temp file
    intra_op_threads: int | None  # None: automatic; 0: leave TensorFlow's default
    bucket_bytes: int | None  # gradient buckets (wrap/tape bucket_bytes="auto"); None: measure
    fast_agree: bool = True  # collectives open with the O(log n) fast agreement
    doubling_max_bytes: int = 32 << 10  # allreduces up to this size: recursive doubling
    device_max_in_flight: int = 64  # NCCL collectives launched and not yet complete
    sync_graph_kernels: bool = True  # CPU collectives in graphs run as synchronous kernels
    huge_page_output_bytes: int = 32 << 20  # fresh CPU outputs from this size: huge pages
    check_weights: bool = True  # fit checks that the ranks' weights agree as training starts

    @classmethod
    def from_env(cls) -> "Config":
        return cls(
            timeout_seconds=seconds_from_env("KERAS_RING_TIMEOUT_SECONDS",
                                             DEFAULT_TIMEOUT_SECONDS),
            stall_warning_seconds=seconds_from_env("KERAS_RING_STALL_WARNING_SECONDS", 60.0),
            failure_exit_seconds=_seconds_or_off("KERAS_RING_FAILURE_EXIT_SECONDS",
                                                 DEFAULT_FAILURE_EXIT_SECONDS),
            segment_bytes=int_from_env("KERAS_RING_SEGMENT_BYTES", 1 << 20, minimum=64),
            host_id=os.environ.get("KERAS_RING_HOST_ID") or None,
            advertise_address=os.environ.get("KERAS_RING_ADVERTISE_ADDRESS", "").strip() or None,
            socket_ifname=os.environ.get("KERAS_RING_SOCKET_IFNAME", "").strip() or None,
            use_shm=_bool("KERAS_RING_SHM", True),
            shm_channel_bytes=_power_of_two("KERAS_RING_SHM_CHANNEL_BYTES", 1 << 20),
            # Absolute: the trace goes where the path pointed at init() (where it was
            # checked), even if the program changes its working directory later.
            timeline_path=_absolute_or_none("KERAS_RING_TIMELINE"),
            timeline_memory_events=int_from_env("KERAS_RING_TIMELINE_MEMORY_EVENTS", 10_000,
                                                minimum=1),
            intra_op_threads=(
                int_from_env("KERAS_RING_INTRA_OP_THREADS", 0, minimum=0)
                if os.environ.get("KERAS_RING_INTRA_OP_THREADS", "").strip() else None
            ),
            bucket_bytes=_bytes_or_auto("KERAS_RING_BUCKET_BYTES"),
            fast_agree=_bool("KERAS_RING_FAST_AGREE", True),
            doubling_max_bytes=int_from_env("KERAS_RING_DOUBLING_MAX_BYTES", 32 << 10,
                                            minimum=0),
            device_max_in_flight=int_from_env("KERAS_RING_DEVICE_MAX_IN_FLIGHT", 64),
            sync_graph_kernels=_bool("KERAS_RING_SYNC_GRAPH_KERNELS", True),
            huge_page_output_bytes=int_from_env("KERAS_RING_HUGE_PAGE_BYTES", 32 << 20,
                                                minimum=0),
            check_weights=_bool("KERAS_RING_CHECK_WEIGHTS", True),
        )


# Settings that change what a rank sends or which collectives it runs: ranks that differ in
# them cannot talk (a lost connection, or mismatches that name nothing of the cause), so the
# bootstrap compares them first.
_MUST_AGREE = (("KERAS_RING_SHM", "use_shm"), ("KERAS_RING_FAST_AGREE", "fast_agree"),
               ("KERAS_RING_SHM_CHANNEL_BYTES", "shm_channel_bytes"),
               ("KERAS_RING_SEGMENT_BYTES", "segment_bytes"),
               ("KERAS_RING_DOUBLING_MAX_BYTES", "doubling_max_bytes"),
               ("KERAS_RING_BUCKET_BYTES", "bucket_bytes"),
               ("KERAS_RING_CHECK_WEIGHTS", "check_weights"))


def must_agree(config: Config) -> tuple:
    """This rank's values of the settings every rank must share."""
    return tuple(getattr(config, field) for _, field in _MUST_AGREE)


def disagreement(per_rank: list[tuple]) -> str | None:
    """What differs among the ranks' ``must_agree`` values (in rank order), or None. Ranks
    that told none (an empty list: an exchange's tests, a hand-made offer) are not compared."""
    per_rank = [list(mine) for mine in per_rank]
    if any(len(mine) != len(_MUST_AGREE) for mine in per_rank):
        return None
    for i, (variable, _) in enumerate(_MUST_AGREE):
        values = [mine[i] for mine in per_rank]
        odd = [r for r, v in enumerate(values) if v != values[0]]
        if odd:
            return (f"{variable} differs between ranks: rank 0 runs with {values[0]!r}, rank "
                    f"{odd[0]} with {values[odd[0]]!r}; set it alike for every rank (or not at "
                    "all)")
    return None

