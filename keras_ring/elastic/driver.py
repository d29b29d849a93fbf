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
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

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
        self._out = (Renderer(sys.stdout.buffer), Renderer(sys.stderr.buffer))
        self._out_lock = threading.Lock()

    # --- the job ----------------------------------------------------------------------------

    def run(self) -> int:
        """Runs the job to its end; Ctrl-C (or SIGTERM) stops every worker (exit code 130)."""
        self.server.start()
        next_discovery = 0.0
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            while True:
                now = time.monotonic()
                if now >= next_discovery and not self._finishing:
                    self._discover()
                    next_discovery = now + self.options.discovery_interval
                self._reap()
                code = self._verdict(now)
                if code is not None:
                    return code
                if not self._finishing:
                    self._fill_slots()
                time.sleep(_TICK_SECONDS)
        except KeyboardInterrupt:
            self.say("interrupted: stopping every worker")
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
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

    def _discover(self) -> None:
        try:
            out = subprocess.run([self.options.discovery_script], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.say(f"host discovery failed: {e}; keeping the last list")
            return
        if out.returncode != 0:
            self.say(f"host discovery exited with {out.returncode}: "
                     f"{out.stderr.strip()[-300:]}; keeping the last list")
            return
        hosts: dict[str, int] = {}
        for line in out.stdout.splitlines():
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


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    return host in {i.address for i in interfaces.local_interfaces()}
