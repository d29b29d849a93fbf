"""The Python side of the runtime: one object that owns this process's keras_ring state."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import warnings
from typing import Any

import tensorflow as tf

from keras_ring import _lifecycle, _rank_wrapper, errors, gpu, interfaces, rendezvous, threads
from keras_ring.bootstrap import bootstrap, launched_by_mpi
from keras_ring.mpi_exchange import comm_bootstrap, whole_world
from keras_ring.config import Config, check_timeline_path
from keras_ring.elastic import client as elastic_client
from keras_ring.errors import InitError, NotInitializedError
from keras_ring.ops.loader import Library, NativeConfig, library
from keras_ring.peer_table import PeerTable, Topology


class Runtime:
    """Holds the topology and the loaded library between ``init()`` and ``shutdown()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._topology: Topology | None = None
        self._config: Config | None = None
        # Bootstrapped once per process (MPI can be initialised only once); the listening
        # socket stays open so a later init() reconnects to the same addresses.
        self._table: PeerTable | None = None
        self._atexit_registered = False
        self._leaving_with: str | None = None  # an uncaught exception is ending the program
        self._peer_stalled = False  # ...one that a peer's stall caused (see _at_exit)
        self._via_mpi = False
        self._world_ranks: list[int] | None = None  # see PeerTable.world_ranks
        self._addresses: list[tuple[str, int]] = []  # every rank's, as the job connected
        self._job_token = 0
        # Process sets by id (0: all ranks): their ranks, and this rank's place in each it
        # belongs to (None where it does not).
        self._sets: dict[int, tuple[tuple[int, ...], Topology | None]] = {}
        # Ids are never reused in this process (not even after shutdown and init): a stale
        # ProcessSet object is refused, never taken for a newer set.
        self._last_set_id = 0
        # An elastic job's worker: its connection to the elastic rendezvous, opened at the
        # first init() and kept until exit; every init() then joins the next world through it.
        self._elastic: elastic_client.ElasticClient | None = None
        self._generation = 0  # counts init()s: what is checked once per job starts again
        self._pid = os.getpid()  # of the process whose runtime this is (init() sets it)
        # What a failed fit/evaluate/predict held (its tf.data iterators among it), kept so
        # that it is freed as the next such call starts (keras_ring._failed_calls).
        self.held_after_failure: list[object] = []

    @property
    def generation(self) -> int:
        """How many times ``init()`` started the runtime in this process."""
        return self._generation

    @property
    def initialized(self) -> bool:
        return self._topology is not None

    @property
    def forked(self) -> bool:
        """This process was forked from a rank after its init(): the runtime is the parent's."""
        return self._topology is not None and os.getpid() != self._pid

    def topology(self, what: str = "this function") -> Topology:
        topology = self._topology
        if topology is None:
            raise NotInitializedError(what)
        return topology

    @property
    def via_mpi(self) -> bool:
        """Whether the running job found its peers through MPI."""
        return self._via_mpi

    @property
    def world_ranks(self) -> list[int] | None:
        """Each rank's MPI_COMM_WORLD rank where ``init(comm=...)`` chose a communicator."""
        return self._world_ranks

    def library(self, what: str = "this function") -> Library:
        self.topology(what)
        return library()

    @property
    def config(self) -> Config:
        assert self._config is not None
        return self._config

    def init(self, table: PeerTable | None = None, failure_exit: bool = True,
             comm: Any = None) -> None:
        """Bootstraps (once per process) and starts the native runtime.

        Args:
            table: a peer table another launcher prepared (``keras_ring.spark``); used for
                this start only, not kept, and its owner closes it.
            comm: bootstrap over this mpi4py communicator, or these MPI_COMM_WORLD ranks
                (Horovod's ``init(comm=...)``), afresh; a later start without one is the
                launcher's whole job again.
            failure_exit: end this process ``KERAS_RING_FAILURE_EXIT_SECONDS`` after the job
                failed, if it is still running (off where the launcher ends failed jobs
                itself, as Spark's barrier stages do).
        """
        with self._lock:
            if self.forked:
                raise NotInitializedError(message=(
                    f"keras_ring: init() in this process (pid {os.getpid()}), which was forked "
                    f"from rank {self._topology.rank}'s process (pid {self._pid}) "
                    f"{errors.FORKED} or a data loader's workers with the 'fork' start method: "
                    "keras_ring's runtime and connections belong to that process, so "
                    "collectives (and init()) run only there. Run them in the process that "
                    "called init(), or start workers with the 'spawn' or 'forkserver' start "
                    "method"))
            if self._topology is not None:
                return
            config = Config.from_env()
            if config.timeline_path is not None:  # before any peer waits for this rank
                check_timeline_path(config.timeline_path)
            lib = library()
            world = None  # a table of one world of an elastic job, closed once connected
            if table is None and comm is not None:
                table = self._comm_table(config, comm)
            elif table is None:
                self._forget_communicator_job()
            if table is None:
                table = world = self._next_elastic_world(config)
            if table is None:
                table = self._bootstrapped(config)
            try:
                threads.configure(table.topology.local_size, config.intra_op_threads)
                gpu.configure(lib, table.topology)  # before TensorFlow starts its GPUs
                errors.install_tensorflow_hook()
                # An elastic job outlives failed worlds: the survivors go on in a new one.
                self._start_native(lib, table, config, failure_exit and world is None)
            finally:
                if world is not None:
                    world.close()
            self._topology = table.topology
            self._via_mpi = table.via_mpi
            self._world_ranks = table.world_ranks
            self._addresses = list(table.addresses)
            self._job_token = table.job_token
            self._sets = {0: (tuple(range(table.topology.size)), table.topology)}
            self._config = config
            self._leaving_with, self._peer_stalled = None, False
            self._generation += 1
            self._pid = os.getpid()
            if not self._atexit_registered:
                atexit.register(self._at_exit)
                _chain_excepthook(self)
                self._atexit_registered = True
        if table.late_claims is not None and table.late_claims.claimed is not None:
            self.fail_job(table.late_claims.claimed)  # claimed before the runtime could fail

    def _bootstrapped(self, config: Config) -> PeerTable:
        """This process's table from its launcher, bootstrapped once and kept."""
        if self._table is None:
            self._table = bootstrap(config)
            if self._table.late_claims is not None:
                self._table.late_claims.on_claim = self.fail_job
        return self._table

    def _comm_table(self, config: Config, comm: Any) -> PeerTable | None:
        """The table of ``init(comm=...)``'s job, bootstrapped afresh; None where ``comm`` is
        the launcher's whole job, which is then found as without it."""
        if whole_world(comm):
            self._forget_communicator_job()
            return None
        if not launched_by_mpi() and (rendezvous.requested() or elastic_client.requested()):
            raise InitError("init(comm=...): keras-ring-run started this process without MPI, "
                            "so its MPI_COMM_WORLD is itself alone and a communicator of it "
                            "would make a job of one; pass no comm (or MPI.COMM_WORLD), or "
                            "launch with mpirun")
        table = comm_bootstrap(config, comm)  # the old table stays if this fails
        if self._table is not None:
            self._table.close()
        self._table = table
        return table

    def _forget_communicator_job(self) -> None:
        """A later init() without a communicator is the launcher's whole job (Horovod's)."""
        if self._table is not None and self._table.world_ranks is not None:
            self._table.close()
            self._table = None

    def _next_elastic_world(self, config: Config) -> PeerTable | None:
        """This worker's table in the next world of its elastic job; None if not elastic."""
        if self._elastic is None:
            if not elastic_client.requested():
                return None
            self._elastic = elastic_client.ElasticClient(config)
        try:
            return self._elastic.next_world()
        except elastic_client.JobFinishedError as e:
            if self._generation > 0:
                raise
            # Started as training ended (discovery found a slot late): not a failure, and a
            # traceback under a job that succeeded would say it was.
            print(f"keras_ring.elastic: {e}: this worker, which never trained, exits",
                  file=sys.stderr, flush=True)
            raise SystemExit(0) from None

    @property
    def elastic(self) -> elastic_client.ElasticClient | None:
        """The elastic rendezvous connection of an elastic job's worker, else None."""
        return self._elastic

    # --- process sets: runtimes of their own among a subset of the ranks ------------------

    def process_set(self, set_id: int, what: str = "this function") -> tuple[tuple[int, ...], Topology | None]:
        """The ranks of a registered process set and this rank's place in it (None if not in)."""
        self.topology(what)
        entry = self._sets.get(set_id)
        if entry is None:
            raise ValueError(f"{what}: process set {set_id} is not registered (add it with "
                             "keras_ring.add_process_set, on every rank)")
        return entry

    def process_set_ids(self) -> dict[int, tuple[int, ...]]:
        return {i: ranks for i, (ranks, _) in self._sets.items()}

    def next_process_set_id(self) -> int:
        """The id the next added set gets (every rank adds sets in the same order)."""
        return self._last_set_id + 1

    def start_process_set(self, set_id: int, ranks: tuple[int, ...],
                          table: PeerTable | None) -> None:
        """Registers a process set; with ``table`` (a member's), starts its native runtime."""
        with self._lock:
            self._last_set_id = max(self._last_set_id, set_id)  # parts may come in any order
            if table is not None:
                self._start_native(library(), table, self.config, True, set_id)
            self._sets[set_id] = (ranks, None if table is None else table.topology)

    def stop_process_set(self, set_id: int) -> None:
        with self._lock:
            if self._sets.pop(set_id, None) is not None:
                library().c.keras_ring_shutdown_process_set(set_id)

    def member_address(self, rank: int) -> str:
        """The address other ranks reach ``rank`` at (its host's, as the job connected)."""
        return self._addresses[rank][0] if self._addresses else "127.0.0.1"

    @property
    def job_token(self) -> int:
        return self._job_token

    @staticmethod
    def _start_native(lib: Library, table: PeerTable, config: Config,
                      failure_exit: bool, process_set_id: int = 0) -> None:
        topo = table.topology
        n = topo.size
        host_names = list(dict.fromkeys(topo.host_ids))
        native = NativeConfig(
            rank=topo.rank,
            size=n,
            listen_fd=table.listener.fileno() if table.listener is not None else -1,
            hosts=(ctypes.c_char_p * n)(*[a.encode() for a, _ in table.addresses] or [b""] * n),
            ports=(ctypes.c_int * n)(*[p for _, p in table.addresses] or [0] * n),
            host_index=(ctypes.c_int * n)(*[host_names.index(h) for h in topo.host_ids]),
            job_token=table.job_token,
            timeout_seconds=config.timeout_seconds,
            stall_warning_seconds=config.stall_warning_seconds,
            segment_bytes=config.segment_bytes,
            use_shm=int(config.use_shm),
            shm_channel_bytes=config.shm_channel_bytes,
            timeline=int(config.timeline_path is not None and process_set_id == 0),
            failure_exit_seconds=config.failure_exit_seconds if failure_exit else 0.0,
            process_set_id=process_set_id,
            fast_agree=int(config.fast_agree),
            doubling_max_bytes=config.doubling_max_bytes,
            device_max_in_flight=config.device_max_in_flight,
            sync_graph_kernels=int(config.sync_graph_kernels),
            huge_page_output_bytes=config.huge_page_output_bytes,
        )
        err = ctypes.create_string_buffer(4096)
        rc = lib.c.keras_ring_init(ctypes.byref(native), err, len(err))
        if rc != 0:
            message = err.value.decode(errors="replace")
            info = errors.error_info(message)
            if len(set(topo.host_ids)) > 1:  # only other hosts use the advertised address
                message += interfaces.advertise_hint(config.advertise_address)
            raise InitError(f"rank {topo.rank}: {message}",
                            info=info if info is not None and info.rank >= 0 else None)
        for sig in _interrupting_signals():
            lib.c.keras_ring_install_signal_handler(int(sig))

    def shutdown(self, error: str | None = None) -> None:
        """Stops the native runtime.

        Args:
            error: the program is leaving with this error: peers learn it as this rank's
                failure and end instead of waiting for it (see the README's "When a rank
                fails"); None is a clean shutdown.
        """
        with self._lock:
            if self._topology is None:
                return
            if os.getpid() != self._pid:
                # A child forked from this rank (its exit runs atexit too): the runtime is the
                # parent's, and the core ignores it here; writing the parent's timeline or
                # telling peers anything from here would be wrong.
                self._topology, self._sets = None, {}
                return
            failed: list[str] = []
            try:
                if self._config is not None:
                    for step in _lifecycle.BEFORE_SHUTDOWN:  # the timeline's, say: see there
                        try:
                            step(self._config, self._topology, library(), error is not None)
                        except Exception as e:  # the other steps still run
                            failed.append(f"{type(e).__name__}: {e}")
            finally:
                # Whatever a step did, the runtime goes down: one left up (on this rank only)
                # fails the next init() and the peers with errors that name nothing of it.
                if error is None:
                    library().c.keras_ring_shutdown()  # process sets' runtimes too
                else:
                    library().c.keras_ring_shutdown_with_error(
                        error.encode(errors="replace")[:300])
                self._topology = None
                self._sets = {}
        for reason in failed:
            # A warning, not an exception: the steps only save diagnostics (the timeline)
            # or forget state, and raising here would cost the program what it does after
            # shutdown() (saving its model, say), or print as an ignored error at exit.
            warnings.warn(f"keras_ring.shutdown(): {reason}", RuntimeWarning, stacklevel=3)

    def fail_job(self, reason: str) -> None:
        """Fails the running job on every rank with ``reason``, from any thread: what runs
        ends now and every later collective raises it, here and on the peers."""
        if self._topology is None or self.forked:
            return
        for set_id in list(self._sets):
            library().c.keras_ring_fail_job(set_id, reason.encode(errors="replace"))

    def _at_exit(self) -> None:
        leaving_with = self._leaving_with
        grace = self._config.failure_exit_seconds if self._config is not None else 0.0
        # Read before shutdown: a timeout the program caught counts as much as one it did not.
        stalled = self._peer_stalled or (
            self._generation > 0 and os.getpid() == self._pid
            and library().c.keras_ring_peer_stalled() == 1)
        if stalled and launched_by_mpi():
            # A peer that cannot run (stopped, stuck in the kernel) never ends by itself, and
            # a finished rank tells MPICH's launcher nothing of it: it would wait for that
            # peer for ever, also where the program caught the timeout and ended normally.
            # The rank leaves with its own exit status but without finalizing PMI, which
            # makes mpirun stop the job; so does the abort it asks of mpirun (its launcher
            # socket), except under keras-ring-run, which learns it from the wrapper and
            # stops the job itself. First thing here: the rest of the exit (shutdown,
            # teardown) is bounded from now on.
            wrapped = _rank_wrapper.mark_stalled_peer()
            sys.stdout.flush()
            sys.stderr.flush()
            library().c.keras_ring_leave_unfinalized_at_exit(grace, 0 if wrapped else 1)
        elif self._generation > 0 and os.getpid() == self._pid:
            # The program's code is done: a failed job's teardown gets a grace of its own.
            library().c.keras_ring_bound_exit_after_failure(grace)
        self.shutdown(leaving_with)
        if self._elastic is not None:
            self._elastic.close()
        if leaving_with is not None:
            _abort_user_mpi()

    def note_uncaught(self, exc_type: type, exc: BaseException) -> None:
        """Records that the program is ending with an uncaught exception."""
        if self._topology is not None and self._topology.size > 1:
            self._leaving_with = f"{exc_type.__name__}: {_gist(exc)}"[:300]
            if _follows_a_peer(exc):
                _rank_wrapper.mark_follow_on()
            self._peer_stalled = _follows(exc, (errors.CollectiveTimeoutError,))


def _follows_a_peer(exc: BaseException | None) -> bool:
    """Whether ``exc`` is another rank's failure reaching this one: a peer that died, left
    or aborted."""
    return _follows(exc, (errors.PeerFailureError, errors.CollectiveAbortedError))


def _follows(exc: BaseException | None, following: tuple[type, ...]) -> bool:
    """Whether ``exc`` (or what it was raised from, or while handling: ``except
    PeerFailureError: raise RuntimeError(...)``) is one of ``following``, keras_ring's
    classes for another rank's failure reaching this one, as itself or TensorFlow's."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, following) or (isinstance(exc, tf.errors.OpError)
                                          and isinstance(errors.translate(exc), following)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _interrupting_signals() -> list[int]:
    """SIGINT and SIGTERM, except where the program handles one itself.

    A handler of the program's own (graceful preemption: set a flag, agree to stop, save)
    decides what the signal means, so the signal must not fail keras_ring's collectives;
    it did only where the handler came before ``init()``, since one installed after replaces
    keras_ring's. Python's Ctrl-C handler and the default action keep the interrupt, which
    ends a blocked collective at once. An ignored signal stays ignored.
    """
    return [sig for sig in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler, None)]


def _gist(exc: BaseException) -> str:
    """One line of an exception's message: keras_ring's own line where TensorFlow wrapped it,
    else the first line that says what went wrong."""
    raw = str(exc).strip().splitlines()  # raw[0]: the first line, where the header is
    lines = [line.strip() for line in raw if line.strip()]
    ours = [line for line in lines if line.startswith("keras_ring:")]
    if ours:
        return ours[0]
    if lines and lines[0] in ("Graph execution error:", "in user code:"):
        # TensorFlow's wrappers (running a graph; tracing one), then where the op was defined
        # and, for an error raised in a tf.data generator or py_function, the Python
        # traceback: none of it is the cause.
        lines = _without_tracebacks(raw) or lines
    return (lines or [""])[0]


def _without_tracebacks(raw: list[str]) -> list[str]:
    """The stripped lines of ``raw`` after its first, less traceback frames, the source lines
    they show and TensorFlow's boilerplate."""
    kept, frame_indent = [], None
    for line in raw[1:]:
        text, indent = line.strip(), len(line) - len(line.lstrip())
        # A frame shows its source line right below it, indented deeper; where TensorFlow
        # has no source to show, the next line is the message itself.
        source = frame_indent is not None and indent > frame_indent
        frame_indent = indent if text.startswith('File "') else None
        if not (frame_indent is not None or source
                or text.startswith(_TF_BOILERPLATE) or set(text) <= set("^~ ")):
            kept.append(text)
    return kept


_TF_BOILERPLATE = ("Detected at node", "<stack traces unavailable>",
                   "Traceback (most recent call last):", "[[", "Stack trace for op")


def _chain_excepthook(runtime: Runtime) -> None:
    """Lets ``runtime`` see an uncaught exception (it runs before atexit) and passes it on."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        runtime.note_uncaught(exc_type, exc)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _abort_user_mpi() -> None:
    """A program that brought up MPI itself would block at exit in MPI_Finalize (collective)
    while its peers are gone or stuck: abort the MPI job instead, which ends every rank."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    mpi.COMM_WORLD.Abort(1)


# The one runtime object of this process.
RUNTIME = Runtime()
