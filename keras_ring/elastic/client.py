"""A worker's side of the elastic rendezvous (``keras_ring.elastic.server``).

The connection is opened once, at the worker's first ``init()``, and kept until the process
ends: the server takes its closing for the worker's death. Each ``init()`` of the worker then
asks for the next world (``next_world``) and gets a peer table like any other bootstrap's;
rank 0 asks at every commit whether newcomers wait (``updates_waiting``).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict

from keras_ring._errors_base import InitError
from keras_ring.config import (DEFAULT_ELASTIC_TIMEOUT_SECONDS, ELASTIC_RENDEZVOUS_VARIABLE,
                               ELASTIC_SECRET_VARIABLE, ELASTIC_TIMEOUT_VARIABLE,
                               ELASTIC_WORKER_VARIABLE, START_TIMEOUT_VARIABLE, Config,
                               seconds_from_env)
from keras_ring.elastic.server import MAGIC
from keras_ring.interfaces import is_loopback
from keras_ring.peer_table import PeerTable
from keras_ring.rendezvous import (Peer, build_table, describe, make_offer, parse_address,
                                   receive_message, send_message)

# A poll is a round trip to a server that answers at once; anything longer is a lost server.
_POLL_SECONDS = 30.0


class RendezvousError(InitError):
    """The elastic rendezvous cannot give this worker a world: the job failed (below
    ``--min-np`` too long), finished, or no longer counts this worker."""


class JobFinishedError(RendezvousError):
    """The job finished training before this worker joined a world: nothing is left for it."""


class WorkerRemovedError(RendezvousError):
    """The elastic rendezvous no longer counts this worker in the job."""


def requested() -> bool:
    """True when this process is a worker of an elastic job."""
    return bool(os.environ.get(ELASTIC_RENDEZVOUS_VARIABLE, "").strip())


class ElasticClient:
    """This worker's connection to the elastic rendezvous.

    Args:
        config: supplies the start timeout (connecting) and the address settings.

    Raises:
        InitError: the rendezvous cannot be reached within the start timeout, or refused
            this worker (another job's secret, a duplicate worker id).
    """

    def __init__(self, config: Config) -> None:
        self._config = config
        self.address = parse_address(os.environ[ELASTIC_RENDEZVOUS_VARIABLE],
                                     ELASTIC_RENDEZVOUS_VARIABLE)
        self.worker_id = (os.environ.get(ELASTIC_WORKER_VARIABLE, "").strip()
                          or f"{socket.gethostname()}-{os.getpid()}")
        self.generation = 0
        self.elastic_timeout = seconds_from_env(ELASTIC_TIMEOUT_VARIABLE,
                                                DEFAULT_ELASTIC_TIMEOUT_SECONDS)
        start = seconds_from_env(START_TIMEOUT_VARIABLE, config.timeout_seconds)
        self._conn = _connect(self.address, start)
        hello = {"magic": MAGIC, "worker": self.worker_id,
                 "secret": os.environ.get(ELASTIC_SECRET_VARIABLE, "")}
        reply = self._request(hello, start, "the greeting")
        if "error" in reply:
            self.close()
            raise RendezvousError(f"worker {self.worker_id}: the elastic rendezvous at "
                            f"{describe(self.address)} refused it: {reply['error']}")

    def next_world(self) -> PeerTable:
        """Waits for the next world and returns this worker's peer table in it.

        Raises:
            InitError: the job stayed below ``--min-np`` too long (the message says so), or
                the rendezvous is gone.
            WorkerRemovedError: the rendezvous dropped this worker (it did not rejoin in time).
        """
        config = self._config
        host_id = config.host_id or socket.gethostname()
        listener, offer = make_offer(config, host_id, is_loopback(self.address[0]), 64)
        try:
            # The server answers within its own bound (below --min-np: the elastic timeout);
            # this wait only catches a server that is gone without closing the connection.
            reply = self._request({"op": "join", "offer": asdict(offer)},
                                  self.elastic_timeout + 60.0, "joining the next world")
            if "error" in reply:
                error = JobFinishedError if reply.get("finished") else RendezvousError
                raise error(f"worker {self.worker_id}: {reply['error']}")
            peers = [Peer(p["host_id"], p["address"], int(p["port"]), p["stack"])
                     for p in reply["peers"]]
            self.generation = int(reply["generation"])
            return build_table(int(reply["rank"]), peers, int(reply["token"]), listener)
        except BaseException:
            listener.close()
            raise

    def updates_waiting(self) -> bool:
        """Whether new workers wait to join at the next commit (asked of the server)."""
        reply = self._request({"op": "poll", "generation": self.generation}, _POLL_SECONDS,
                              "asking for new workers")
        return bool(reply.get("updated"))

    def synced(self) -> None:
        """Tells the rendezvous that this worker holds the job's state now (its world's
        sync ended): a world whose workers all lack it must not form (they would train from
        a newcomer's initial state)."""
        self._request({"op": "synced"}, _POLL_SECONDS, "reporting the state's sync")

    def finished(self) -> None:
        """Tells the rendezvous that training finished: no world forms after this one."""
        self._request({"op": "finished"}, _POLL_SECONDS, "reporting the end of training")

    def failed(self, reason: str) -> None:
        """Tells the rendezvous that the program failed by its own error (not a lost peer):
        the job ends, as a job that is not elastic would."""
        self._request({"op": "failed", "reason": reason}, _POLL_SECONDS,
                      "reporting the program's error")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _request(self, message: dict, timeout: float, what: str) -> dict:
        if self._conn is None:
            raise WorkerRemovedError(f"worker {self.worker_id}: the elastic rendezvous "
                                     "connection is closed")
        where = describe(self.address)
        try:
            send_message(self._conn, message)
            return receive_message(self._conn, time.monotonic() + timeout)
        except socket.timeout:
            raise RendezvousError(f"worker {self.worker_id}: the elastic rendezvous at {where} "
                                  f"did not answer within {timeout:g} s ({what})") from None
        except (OSError, ValueError) as e:
            self.close()
            raise WorkerRemovedError(
                f"worker {self.worker_id}: the elastic rendezvous at {where} closed the "
                f"connection ({what}: {e}): the job ended, or dropped this worker because it "
                "did not rejoin in time") from None


def _connect(address: tuple[str, int], timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    pause, last_error = 0.05, None
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection(address, timeout=min(5.0, timeout))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        except OSError as e:
            last_error = e
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 1.0)
    raise InitError(f"could not reach the elastic rendezvous at {describe(address)} "
                    f"({ELASTIC_RENDEZVOUS_VARIABLE}) within {timeout:g} s "
                    f"({START_TIMEOUT_VARIABLE}): {last_error}")
