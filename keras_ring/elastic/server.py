"""The elastic rendezvous: forms each world (generation) of an elastic job.

Every worker keeps one TCP connection to this server for its whole life, so the server knows
who is alive (a dead process's connection closes). A worker asks to *join* when it starts and
whenever its world broke (a peer failed) or was interrupted at a commit (new workers wait);
the server answers every joining worker at once with the new world's peer table, ranks
given to the previous world's members first, in their old order (so rank 0, which the others
sync from, is a worker that holds the committed state), then to newcomers.

A world forms when every live worker has asked to join (and ``min_np`` of them have), or, if
some live worker does not ask within ``join_seconds``, without it (it is taken for stalled and
dropped). Below ``min_np`` the server waits for more workers up to ``elastic_timeout``
seconds, then fails the waiting workers and the job with a message saying so.

The server runs in a thread of ``keras-ring-run``'s elastic driver, or on its own for a
scheduler that starts workers itself (``python -m keras_ring.elastic.server``). It imports no
TensorFlow.
"""

from __future__ import annotations

import argparse
import secrets
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from keras_ring.rendezvous import (Offer, Peer, check_world, offer_of, receive_message,
                                   route_first, send_message, well_formed)

MAGIC = "keras_ring.elastic/1"
# How often the server looks at its deadlines when no message arrives.
_TICK_SECONDS = 0.1
# How long a connected worker may take to send a whole message once it started one.
_MESSAGE_SECONDS = 5.0


@dataclass
class _Worker:
    worker_id: str
    conn: socket.socket
    seen: str  # the address its connection came from
    order: int  # connection order, for newcomers' ranks
    offer: Offer | None = None  # set while it waits for the next world
    waiting_since: float = 0.0
    holds_state: bool = False  # it synced the job's state in some world (see "synced")


@dataclass
class WorldLimits:
    """The sizes and bounds an elastic job runs within.

    Args:
        min_np: fewer workers than this cannot train: the job waits, then fails.
        max_np: at most this many workers train; more wait for a free place.
        initial_np: the first world waits for this many workers (up to ``join_seconds``).
        join_seconds: how long a world's forming waits for a live worker that has not
            asked to join (then it is dropped as stalled).
        elastic_timeout: how long the job may stay below ``min_np`` before it fails.
    """

    min_np: int
    max_np: int
    initial_np: int
    join_seconds: float = 60.0
    elastic_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_np <= self.max_np:
            raise ValueError(f"need 1 <= min_np <= max_np, got min_np={self.min_np}, "
                             f"max_np={self.max_np}")
        if not self.min_np <= self.initial_np <= self.max_np:
            raise ValueError(f"the initial number of workers ({self.initial_np}) must lie "
                             f"between min_np={self.min_np} and max_np={self.max_np}")


@dataclass
class _Round:
    """Bookkeeping of the world being formed."""

    short_since: float | None = None  # when the joining workers fell below min_np
    dropped: list[str] = field(default_factory=list)


class WorldServer:
    """Forms the worlds of one elastic job; see the module's description.

    Args:
        limits: sizes and bounds.
        secret: a worker must present it (keeps other jobs' workers and strays out).
        port: where to listen (0: any free port), on every interface.
        started: the ids of the workers the driver started that are still running (a world
            waits for those not connected yet as for joining workers); none on its own.
        on_dropped: called with a worker's id when it is dropped as stalled (the driver
            stops the process).

    Example:

    ```python
    server = WorldServer(WorldLimits(min_np=2, max_np=4, initial_np=3), secret="s3cret")
    server.start()
    print(server.port)  # workers get KERAS_RING_ELASTIC_RENDEZVOUS=host:port
    ```
    """

    def __init__(self, limits: WorldLimits, secret: str, port: int = 0,
                 started: Callable[[], set[str]] = set,
                 on_dropped: Callable[[str], None] = lambda worker_id: None) -> None:
        self.limits = limits
        self.secret = secret
        self._started = started
        self._on_dropped = on_dropped
        self._listener = _listen(port)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._workers: dict[str, _Worker] = {}
        self._connections = 0
        self.generation = 0
        self.members: list[str] = []  # the current world's workers, in rank order
        self.failure: str | None = None  # set when the job cannot go on
        self.finished = False  # a member reported the end of training
        self._state_synced = False  # some worker synced the job's state: it has one to lose
        self._round = _Round()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="keras_ring-elastic",
                                        daemon=True)
        self._lock = threading.Lock()  # guards what the driver reads

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for worker in list(self._workers.values()):
            worker.conn.close()
        self._workers.clear()
        self._selector.close()
        self._listener.close()

    def snapshot(self) -> tuple[int, list[str]]:
        """The current generation and its members (rank order)."""
        with self._lock:
            return self.generation, list(self.members)

    # --- the loop ---------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(_TICK_SECONDS):
                if key.data is None:
                    self._accept()
                else:
                    self._message(key.data)
            self._try_form(time.monotonic())

    def _accept(self) -> None:
        try:
            conn, (address, *_) = self._listener.accept()
        except OSError:
            return
        try:
            hello = receive_message(conn, time.monotonic() + _MESSAGE_SECONDS)
        except (OSError, ValueError):
            conn.close()
            return
        problem = self._check_hello(hello)
        if problem is not None:
            _tell(conn, {"error": problem})
            conn.close()
            return
        self._connections += 1
        worker = _Worker(hello["worker"], conn, address, self._connections)
        self._workers[worker.worker_id] = worker
        self._selector.register(conn, selectors.EVENT_READ, worker)
        _tell(conn, {"ok": True, "generation": self.generation})

    def _check_hello(self, hello: dict) -> str | None:
        if hello.get("magic") != MAGIC or not isinstance(hello.get("worker"), str):
            return "not a keras_ring elastic worker"
        if hello.get("secret") != self.secret:
            return ("the job secret does not match (KERAS_RING_ELASTIC_SECRET): this worker "
                    "belongs to another job")
        if hello["worker"] in self._workers:
            return (f"two workers claim the id {hello['worker']!r} "
                    "(KERAS_RING_ELASTIC_WORKER must be unique in a job)")
        return None

    def _message(self, worker: _Worker) -> None:
        try:
            message = receive_message(worker.conn, time.monotonic() + _MESSAGE_SECONDS)
        except (OSError, ValueError):
            self._forget(worker)  # the process is gone (or broke the protocol)
            return
        op = message.get("op")
        if op == "join" and isinstance(message.get("offer"), dict) and well_formed(
                dict(message["offer"], rank=0, size=1)):
            worker.offer = offer_of(message["offer"])
            worker.waiting_since = time.monotonic()
        elif op == "poll":
            _tell(worker.conn, {"updated": self._updates_waiting()})
        elif op == "synced":
            worker.holds_state = self._state_synced = True
            _tell(worker.conn, {"ok": True})
        elif op == "finished":
            self.finished = self.finished or worker.worker_id in self.members
            _tell(worker.conn, {"ok": True})
        elif op == "failed":
            self.failure = self.failure or (
                f"worker {worker.worker_id} failed with an error of the program, which every "
                f"world would meet again: {str(message.get('reason'))[:2000]}")
            _tell(worker.conn, {"ok": True})
        else:
            _tell(worker.conn, {"error": f"unknown request {op!r}"})

    def _forget(self, worker: _Worker) -> None:
        self._selector.unregister(worker.conn)
        worker.conn.close()
        self._workers.pop(worker.worker_id, None)

    def _updates_waiting(self) -> bool:
        """Whether newcomers wait for a place that the running world could give them."""
        newcomers = [w for w in self._workers.values()
                     if w.offer is not None and w.worker_id not in self.members]
        return bool(newcomers) and len(self.members) < self.limits.max_np and not self.finished

    # --- forming a world --------------------------------------------------------------------

    def _try_form(self, now: float) -> None:
        joining = [w for w in self._workers.values() if w.offer is not None]
        if not joining or self.failure is not None:
            return
        if self.finished:  # nothing to train any more: newcomers must not start afresh
            for worker in joining:
                _tell(worker.conn, {"error": "the job finished training; no world forms",
                                    "finished": True})
                worker.offer = None
            return
        limits = self.limits
        members = [w for w in joining if w.worker_id in self.members]
        if not members and any(w in self.members for w in self._workers):
            return  # the world runs on: newcomers wait for its next commit (see poll)
        absent = [w for w in self._workers.values() if w.offer is None]
        first_wait = min(w.waiting_since for w in (members or joining))
        overdue = now - first_wait >= limits.join_seconds
        everyone = not absent and not self._started() - set(self._workers)
        if self.generation == 0 and len(joining) < limits.initial_np:
            everyone = False  # the first world waits for -np workers (or the join window)
        if len(joining) < limits.min_np:
            self._wait_for_more(joining, now)
            return
        self._round.short_since = None
        if not everyone and not overdue:
            return
        if overdue:
            for worker in absent:  # alive but silent past the window: stalled
                self._round.dropped.append(worker.worker_id)
                self._forget(worker)
                self._on_dropped(worker.worker_id)
        self._form(joining)

    def _orphaned(self, chosen: list[_Worker]) -> str | None:
        """Why no world may form of ``chosen``: none holds the state the job trained (the
        new rank 0 would sync its own initial state to the others), or None."""
        if not self._state_synced or any(w.holds_state for w in chosen):
            return None
        return (f"no worker of the next world ({', '.join(w.worker_id for w in chosen)}) "
                "holds the job's state: every worker that had synced it is gone, the last "
                "before handing it on to a newcomer, whose own initial state a world would "
                "silently train from (from step 0). Start the job again, from a checkpoint")

    def _wait_for_more(self, joining: list[_Worker], now: float) -> None:
        if self._round.short_since is None:
            self._round.short_since = now
        waited = now - self._round.short_since
        if waited < self.limits.elastic_timeout:
            return
        self.failure = (f"the elastic job had {len(joining)} worker(s) ready for "
                        f"{waited:.0f} s, fewer than --min-np {self.limits.min_np} "
                        "(KERAS_RING_ELASTIC_TIMEOUT_SECONDS bounds that wait)")
        for worker in joining:
            _tell(worker.conn, {"error": self.failure})
            worker.offer = None

    def _form(self, joining: list[_Worker]) -> None:
        rank_of = {w: r for r, w in enumerate(self.members)}
        ordered = sorted(joining, key=lambda w: (rank_of.get(w.worker_id, len(rank_of)),
                                                 w.order))
        chosen = ordered[:self.limits.max_np]
        offers = [w.offer for w in chosen]
        problem = check_world(offers, [w.seen for w in chosen]) or self._orphaned(chosen)
        if problem is not None:
            self.failure = problem
            for worker in chosen:
                _tell(worker.conn, {"error": problem})
                worker.offer = None
            return
        peers = [Peer(o.host_id, o.addresses if o.explicit
                      else route_first(w.seen, o.addresses, o.chosen),
                      o.port, o.stack) for w, o in zip(chosen, offers)]
        token = secrets.randbits(63)
        with self._lock:
            self.generation += 1
            self.members = [w.worker_id for w in chosen]
        reply = {"generation": self.generation, "size": len(chosen), "token": token,
                 "peers": [asdict(p) for p in peers], "dropped": self._round.dropped}
        for rank, worker in enumerate(chosen):
            _tell(worker.conn, dict(reply, rank=rank))
            worker.offer = None
        self._round = _Round()


def _listen(port: int) -> socket.socket:
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True,
                                    backlog=128)
    return socket.create_server(("0.0.0.0", port), backlog=128)


def _tell(conn: socket.socket, message: dict) -> None:
    """Sends ``message``; a worker that is gone is noticed by the loop, not here."""
    try:
        conn.settimeout(_MESSAGE_SECONDS)
        send_message(conn, message)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    """``python -m keras_ring.elastic.server``: the rendezvous alone, for a scheduler that
    starts and restarts the workers itself (each with KERAS_RING_ELASTIC_RENDEZVOUS)."""
    parser = argparse.ArgumentParser(prog="python -m keras_ring.elastic.server")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--min-np", type=int, required=True)
    parser.add_argument("--max-np", type=int, required=True)
    parser.add_argument("-np", dest="np", type=int, default=None)
    parser.add_argument("--secret", default="", help="what workers must present "
                        "(KERAS_RING_ELASTIC_SECRET); empty by default")
    args = parser.parse_args(argv)
    limits = WorldLimits(args.min_np, args.max_np, args.np or args.min_np)
    server = WorldServer(limits, args.secret, args.port)
    server.start()
    print(f"keras_ring elastic rendezvous on port {server.port}", flush=True)
    while server.failure is None:
        time.sleep(1.0)
    print(f"keras_ring elastic rendezvous: {server.failure}", file=sys.stderr)
    server.close()
    return 1


if __name__ == "__main__":
    sys.exit(main())
