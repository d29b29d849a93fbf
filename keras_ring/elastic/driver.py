"""``keras-ring-run --min-np N --max-np M --host-discovery-script SCRIPT``: the elastic driver.

It serves the job's elastic rendezvous (``keras_ring.elastic.server``) and manages the
workers: it runs the discovery script every ``--discovery-interval`` seconds (it prints
``host:slots`` lines, as Horovod's does), starts ``-np`` workers, then keeps starting workers
on discovered free slots up to ``--max-np`` (replacing failed ones: a newcomer joins at the
next commit), counts each host's failed workers and stops using a host after
``--blacklist-after`` of them, and ends the job when its workers have finished (exit code 0)
or when it cannot go on (below ``--min-np`` past ``KERAS_RING_ELASTIC_TIMEOUT_SECONDS``: exit
code 1 with a message saying so).

Workers on this machine (``localhost``, its name or addresses) are started directly; others
through ``--remote-shell`` (``ssh -o BatchMode=yes`` by default), which gets the host and one
command line, as ssh does. No MPI is involved. Every line a worker prints is prefixed with
``[worker id]``.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from keras_ring import interfaces
from keras_ring.config import (DEFAULT_ELASTIC_TIMEOUT_SECONDS, ELASTIC_JOIN_VARIABLE,
                               ELASTIC_RENDEZVOUS_VARIABLE, ELASTIC_SECRET_VARIABLE,
                               ELASTIC_TIMEOUT_VARIABLE, ELASTIC_WORKER_VARIABLE,
                               MPI_VARIABLE_PREFIXES, RANK_VARIABLE, RENDEZVOUS_VARIABLE,
                               SIZE_VARIABLE, seconds_from_env)
from keras_ring.elastic.server import WorldLimits, WorldServer
from keras_ring._launch_output import Renderer

_TICK_SECONDS = 0.1
_STOP_GRACE_SECONDS = 10.0
_DISCOVERY_SECONDS = 30.0  # a discovery script running longer is stopped
# Variables a remote worker gets from the driver's environment (ssh starts afresh).
_FORWARDED_PREFIXES = ("KERAS_RING_", "TF_", "NCCL_", "CUDA_", "PYTHON")


@dataclass
class ElasticOptions:
    """What ``keras-ring-run`` was asked for in elastic mode."""

    np: int
    min_np: int
    max_np: int
    discovery_script: str
    command: list[str]
    discovery_interval: float = 1.0
    blacklist_after: int = 2
    remote_shell: str = "ssh -o BatchMode=yes"
    rendezvous_address: str | None = None


@dataclass
class _Process:
    worker_id: str
    host: str
    proc: subprocess.Popen
    stopping: bool = False  # the driver stops it: its exit is no failure of its host...
    dropped: bool = False  # ...unless the rendezvous dropped it as stalled
    pumps: list[threading.Thread] = field(default_factory=list)


class ElasticDriver:
    """Runs one elastic job; ``run()`` returns its exit code."""

    def __init__(self, options: ElasticOptions) -> None:
        self.options = options
        limits = WorldLimits(options.min_np, options.max_np, options.np,
                             seconds_from_env(ELASTIC_JOIN_VARIABLE, 60.0),
                             seconds_from_env(ELASTIC_TIMEOUT_VARIABLE,
                                              DEFAULT_ELASTIC_TIMEOUT_SECONDS))
        self.limits = limits
        self.secret = secrets.token_hex(16)
        self._running: frozenset[str] = frozenset()  # read by the server's thread
        self.server = WorldServer(limits, self.secret, started=lambda: set(self._running),
                                  on_dropped=self._drop)
        self.processes: dict[str, _Process] = {}
        self.failures: Counter[str] = Counter()
        self.blacklist: set[str] = set()
        self.hosts: dict[str, int] = {}  # discovered host -> slots, in discovery order
        self.exit_codes: dict[str, int] = {}
        self._serial = 0
        self._finishing = False
        self._short_since: float | None = None
        self._discovery = Discovery(options.discovery_script)
        self._out = (Renderer(sys.stdout.buffer), Renderer(sys.stderr.buffer))
        self._out_lock = threading.Lock()

    # --- the job ----------------------------------------------------------------------------

    def run(self) -> int:
        """Runs the job to its end; Ctrl-C (or SIGTERM) stops every worker (exit code 130,
        143 for SIGTERM, as the launcher without elastic)."""
        self.server.start()
        next_discovery = 0.0
        terminated = []

        def on_sigterm(signum, frame):
            terminated.append(signum)
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            while True:
                now = time.monotonic()
                if not self._finishing:
                    if self._discovery.idle and now >= next_discovery:
                        self._discovery.start(now)
                        next_discovery = now + self.options.discovery_interval
                    self._collect_discovery(now)
                self._reap()
                code = self._verdict(now)
                if code is not None:
                    return code
                if not self._finishing:
                    self._fill_slots()
                time.sleep(_TICK_SECONDS)
        except KeyboardInterrupt:
            self.say("terminated by SIGTERM: stopping every worker" if terminated
                     else "interrupted: stopping every worker")
            return 128 + signal.SIGTERM if terminated else 130
        finally:
            signal.signal(signal.SIGTERM, previous)
            self._discovery.stop()  # a script still running, and what it started
            self._stop_all()
            self.server.close()

    def _verdict(self, now: float) -> int | None:
        """The job's exit code once it is over, else None."""
        if self.server.failure is not None:
            self.say(f"the job failed: {self.server.failure}")
            return 1
        _, members = self.server.snapshot()
        if self._finishing and all(m not in self.processes for m in members):
            failed = [self.exit_codes[m] for m in members if self.exit_codes.get(m, 0) != 0]
            return failed[0] if failed else 0
        failed = [self.exit_codes.get(m, 0) for m in members]
        if members and all(failed):  # nobody holds the committed state to go on from
            self.say(f"the job failed: every worker of the last world ({len(members)}) exited "
                     f"with an error (exit codes {sorted(set(failed))}): none is left to carry "
                     "its training on")
            return failed[0]
        live = len(self.processes)
        if live >= self.limits.min_np or self._finishing:
            self._short_since = None
            return None
        self._short_since = self._short_since or now
        if now - self._short_since >= self.limits.elastic_timeout:
            self.say(f"the job failed: it had {live} worker(s) for "
                     f"{now - self._short_since:.0f} s, fewer than --min-np {self.limits.min_np}"
                     f" (hosts blacklisted: {sorted(self.blacklist) or 'none'}; "
                     f"{ELASTIC_TIMEOUT_VARIABLE} bounds that wait)")
            return 1
        return None

    def _collect_discovery(self, now: float) -> None:
        """Takes the hosts of a discovery that ended (the job goes on meanwhile: a slow
        script held up the whole driver, even a job that had finished)."""
        result = self._discovery.result(now)
        if result is None:
            return
        problem, stdout = result
        if problem is not None:
            self.say(f"host discovery {problem}; keeping the last list")
            return
        hosts: dict[str, int] = {}
        for line in stdout.splitlines():
            host, _, slots = line.strip().partition(":")
            if host:
                hosts[host] = int(slots) if slots.strip().isdigit() else 1
        self.hosts = hosts

    def _fill_slots(self) -> None:
        generation, _ = self.server.snapshot()
        limit = self.options.np if generation == 0 else self.limits.max_np
        for host, slots in self.hosts.items():
            if host in self.blacklist:
                continue
            used = sum(1 for p in self.processes.values() if p.host == host)
            while used < slots and len(self.processes) < limit:
                self._start(host)
                used += 1

    # --- workers ----------------------------------------------------------------------------

    def _start(self, host: str) -> None:
        self._serial += 1
        worker_id = f"{host}.{self._serial}"
        env = self._worker_env(worker_id, host)
        local = _is_local(host)
        argv = self.options.command if local else self._remote_argv(host, env)
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as e:
            self.say(f"cannot start a worker on {host}: {e}")
            self._count_failure(host)
            return
        process = _Process(worker_id, host, proc)
        for source, sink in ((proc.stdout, 0), (proc.stderr, 1)):
            pump = threading.Thread(target=self._pump, args=(source, sink, worker_id),
                                    daemon=True)
            pump.start()
            process.pumps.append(pump)
        self.processes[worker_id] = process
        self._running = frozenset(self.processes)

    def _worker_env(self, worker_id: str, host: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(MPI_VARIABLE_PREFIXES)
               and k not in (RANK_VARIABLE, SIZE_VARIABLE, RENDEZVOUS_VARIABLE)}
        env.update({
            ELASTIC_RENDEZVOUS_VARIABLE: f"{self._address_for_workers()}:{self.server.port}",
            ELASTIC_WORKER_VARIABLE: worker_id,
            ELASTIC_SECRET_VARIABLE: self.secret,
            "KERAS_RING_HOST_ID": host,  # one identity per discovered host
            "PYTHONUNBUFFERED": "1",
        })
        return env

    def _address_for_workers(self) -> str:
        if self.options.rendezvous_address:
            return self.options.rendezvous_address
        if all(_is_local(h) for h in self.hosts):
            return "127.0.0.1"  # a job on this machine only: nothing listens outside it
        try:
            return interfaces.candidate_addresses()[0]
        except (interfaces.AddressError, IndexError):
            return socket.gethostname()

    def _remote_argv(self, host: str, env: dict[str, str]) -> list[str]:
        forwarded = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())
                             if k.startswith(_FORWARDED_PREFIXES))
        line = (f"cd {shlex.quote(os.getcwd())} && exec env {forwarded} "
                f"{shlex.join(self.options.command)}")
        return [*shlex.split(self.options.remote_shell), host, line]

    def _pump(self, source, sink: int, worker_id: str) -> None:
        fd = source.fileno()
        while chunk := os.read(fd, 65536):
            with self._out_lock:
                self._out[sink].rank_output(worker_id, chunk)
        source.close()

    def _reap(self) -> None:
        for worker_id, process in list(self.processes.items()):
            code = process.proc.poll()
            if code is None:
                continue
            for pump in process.pumps:
                pump.join(timeout=5)
            code = code if code >= 0 else 128 - code
            del self.processes[worker_id]
            self._running = frozenset(self.processes)
            self.exit_codes[worker_id] = code
            if code == 0:
                self._finishing = True  # a worker finished training: the job is ending
            elif process.dropped or not process.stopping:
                self.say(f"worker {worker_id} on {process.host} exited with {code}")
                self._count_failure(process.host)

    def _count_failure(self, host: str) -> None:
        self.failures[host] += 1
        if self.failures[host] >= self.options.blacklist_after and host not in self.blacklist:
            self.blacklist.add(host)
            self.say(f"host {host} blacklisted after {self.failures[host]} failed worker(s)")

    def _drop(self, worker_id: str) -> None:
        """The rendezvous dropped a stalled worker (server thread): stop its process."""
        process = self.processes.get(worker_id)
        if process is not None:
            self.say(f"worker {worker_id} did not rejoin in time: stopping it")
            process.dropped = True
            self._stop(process)

    def _stop(self, process: _Process) -> None:
        process.stopping = True
        try:
            os.killpg(process.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def _stop_all(self) -> None:
        for process in self.processes.values():
            self._stop(process)
        deadline = time.monotonic() + _STOP_GRACE_SECONDS
        for process in self.processes.values():
            try:
                process.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.proc.wait()

    def say(self, message: str) -> None:
        with self._out_lock:
            self._out[1].raw(f"keras-ring-run: {message}\n".encode())


class Discovery:
    """One run of the host discovery script at a time, in a process group of its own, never
    waited for: the driver polls it between its other work, and a run past
    ``_DISCOVERY_SECONDS`` (or at the job's end) is killed with what it started."""

    def __init__(self, script: str) -> None:
        self.script = script
        self._proc: subprocess.Popen | None = None
        self._files: tuple[Any, Any] | None = None
        self._started = 0.0
        self._failed_to_start: str | None = None

    @property
    def idle(self) -> bool:
        return self._proc is None

    def start(self, now: float) -> None:
        # Files, not pipes: nothing is read until it ends, and a full pipe would stall it.
        self._files = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
        try:
            self._proc = subprocess.Popen([self.script], stdin=subprocess.DEVNULL,
                                          stdout=self._files[0], stderr=self._files[1],
                                          start_new_session=True)
        except OSError as e:
            self._close()
            self._failed_to_start = str(e)
            return
        self._started = now

    def result(self, now: float) -> tuple[str | None, str] | None:
        """(problem or None, its output) once a run ended; None while none did."""
        failed = self._failed_to_start
        if failed is not None:
            self._failed_to_start = None
            return f"failed: {failed}", ""
        if self._proc is None:
            return None
        code = self._proc.poll()
        if code is None:
            if now - self._started <= _DISCOVERY_SECONDS:
                return None
            self.stop()
            return f"failed: still running after {_DISCOVERY_SECONDS:.0f} s (stopped)", ""
        out, err = (self._read(f) for f in self._files)
        self._proc = None
        self._close()
        if code != 0:
            return f"exited with {code}: {err.strip()[-300:]}", ""
        return None, out

    def stop(self) -> None:
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
            self._proc = None
        self._close()

    @staticmethod
    def _read(file: Any) -> str:
        file.seek(0)
        return file.read().decode(errors="replace")

    def _close(self) -> None:
        for file in self._files or ():
            file.close()
        self._files = None


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    return host in {i.address for i in interfaces.local_interfaces()}
