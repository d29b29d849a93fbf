"""The elastic rendezvous on its own, with workers played by sockets in this process: how
worlds form, who gets which rank, who waits, who is refused. Real TCP on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import asdict

import pytest

from keras_ring.elastic.server import MAGIC, WorldLimits, WorldServer
from keras_ring.rendezvous import Offer, receive_message, send_message

SECRET = "s3cret"


class Worker:
    """One worker's connection, speaking the protocol."""

    def __init__(self, server: WorldServer, worker_id: str, secret: str = SECRET) -> None:
        self.worker_id = worker_id
        self.conn = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        self.hello = self.ask({"magic": MAGIC, "worker": worker_id, "secret": secret})

    def ask(self, message: dict, timeout: float = 10.0) -> dict:
        send_message(self.conn, message)
        return receive_message(self.conn, time.monotonic() + timeout)

    def join(self) -> None:
        send_message(self.conn, {"op": "join", "offer": asdict(
            Offer(self.worker_id, 1000, "127.0.0.1", stack="one"))})

    def world(self, timeout: float = 10.0) -> dict:
        return receive_message(self.conn, time.monotonic() + timeout)

    def close(self) -> None:
        self.conn.close()


def first_world(server: WorldServer, *ids: str) -> list[Worker]:
    """Workers ``ids`` connected, joined, and given the first world (ranks in that order)."""
    workers = [Worker(server, i) for i in ids]
    for w in workers:
        w.join()
    assert [w.world()["rank"] for w in workers] == list(range(len(ids)))
    return workers


@pytest.fixture
def make_server():
    servers = []

    def make(min_np=2, max_np=3, initial_np=2, join_seconds=30.0, elastic_timeout=30.0):
        server = WorldServer(WorldLimits(min_np, max_np, initial_np, join_seconds,
                                         elastic_timeout), SECRET)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def test_the_first_world_forms_when_np_workers_joined(make_server):
    server = make_server(initial_np=2)
    a, b = Worker(server, "a"), Worker(server, "b")
    a.join()
    b.join()
    worlds = [a.world(), b.world()]
    assert [w["rank"] for w in worlds] == [0, 1]
    assert {w["size"] for w in worlds} == {2} and {w["generation"] for w in worlds} == {1}
    assert worlds[0]["token"] == worlds[1]["token"]


def test_survivors_keep_their_order_and_newcomers_come_last(make_server):
    server = make_server(min_np=2, max_np=3, initial_np=3)
    a, b, c = first_world(server, "a", "b", "c")
    a.close()  # rank 0 dies; a newcomer connects
    d = Worker(server, "d")
    d.join()
    c.join()
    b.join()
    worlds = {w.worker_id: w.world() for w in (b, c, d)}
    assert {k: v["rank"] for k, v in worlds.items()} == {"b": 0, "c": 1, "d": 2}
    assert {v["generation"] for v in worlds.values()} == {2}


def test_newcomers_wait_for_a_commit_and_are_announced_by_poll(make_server):
    server = make_server(min_np=2, max_np=3, initial_np=2)
    a, b = first_world(server, "a", "b")
    assert a.ask({"op": "poll", "generation": 1}) == {"updated": False}
    c = Worker(server, "c")
    c.join()
    # The running world is not broken up: the newcomer waits until the members come.
    deadline = time.monotonic() + 10
    while not a.ask({"op": "poll", "generation": 1})["updated"]:
        assert time.monotonic() < deadline, "the newcomer was never announced"
    assert server.snapshot() == (1, ["a", "b"])
    a.join()
    b.join()
    assert [w.world()["rank"] for w in (a, b, c)] == [0, 1, 2]


def test_a_full_world_announces_no_newcomer(make_server):
    server = make_server(min_np=1, max_np=2, initial_np=2)
    a, b = first_world(server, "a", "b")
    c = Worker(server, "c")
    c.join()
    assert a.ask({"op": "poll", "generation": 1}) == {"updated": False}


def test_a_silent_member_is_dropped_after_the_join_window(make_server):
    server = make_server(min_np=2, max_np=3, initial_np=3, join_seconds=1.0)
    a, b, c = first_world(server, "a", "b", "c")
    a.join()
    b.join()  # c stalls: it never asks
    worlds = [a.world(), b.world()]
    assert [w["size"] for w in worlds] == [2, 2] and worlds[0]["dropped"] == ["c"]
    with pytest.raises((OSError, ValueError)):  # its connection was closed
        c.ask({"op": "poll", "generation": 2})


def test_below_min_np_the_waiting_workers_get_an_error_in_bounded_time(make_server):
    server = make_server(min_np=2, max_np=2, initial_np=2, elastic_timeout=1.0)
    a = Worker(server, "a")
    a.join()
    reply = a.world(timeout=20)
    assert "fewer than --min-np 2" in reply["error"], reply
    assert server.failure is not None


@pytest.mark.parametrize("secret, second_id, expected", [
    ("wrong", "x", "the job secret does not match"),
    (SECRET, "a", "two workers claim the id 'a'"),
])
def test_strangers_and_duplicates_are_refused(make_server, secret, second_id, expected):
    server = make_server()
    first = Worker(server, "a")
    refused = Worker(server, second_id, secret=secret)
    assert expected in refused.hello["error"], refused.hello
    assert first.ask({"op": "poll", "generation": 0}) == {"updated": False}  # still there


def test_after_training_finished_no_world_forms_for_a_newcomer(make_server):
    server = make_server(min_np=1, max_np=3, initial_np=2)
    a, b = first_world(server, "a", "b")
    c = Worker(server, "c")
    c.join()
    assert a.ask({"op": "finished"}) == {"ok": True}
    assert a.ask({"op": "poll", "generation": 1}) == {"updated": False}
    a.close()
    b.close()  # the members leave; the newcomer alone must not start training afresh
    assert "the job finished training" in c.world()["error"]


def test_a_worker_that_starts_after_training_finished_exits_quietly(make_server, clean_env):
    # Discovery found a slot as training ended: the worker's init() has no world to give it.
    # It printed a RendezvousError traceback under a job that succeeded.
    server = make_server(min_np=1, max_np=3, initial_np=2)
    a, b = first_world(server, "a", "b")
    assert a.ask({"op": "finished"}) == {"ok": True}
    env = dict(clean_env, KERAS_RING_ELASTIC_RENDEZVOUS=f"127.0.0.1:{server.port}",
               KERAS_RING_ELASTIC_SECRET=SECRET, KERAS_RING_ELASTIC_WORKER="late")
    proc = subprocess.run([sys.executable, "-c", "import keras_ring; keras_ring.init(); "
                           "print('trained')"], env=env, capture_output=True, text=True,
                          timeout=120)
    a.close()
    b.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained" not in proc.stdout
    assert ("keras_ring.elastic: worker late: the job finished training; no world forms: this "
            "worker, which never trained, exits") in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_no_world_forms_of_newcomers_once_every_worker_holding_the_state_is_gone(make_server):
    # The newcomer became the only worker and trained from its own initial state (step 0),
    # silently: its world formed while the survivor that held the state died before the sync.
    server = make_server(min_np=1, max_np=2, initial_np=1)
    (a,) = first_world(server, "a")
    assert a.ask({"op": "synced"}) == {"ok": True}
    b = Worker(server, "b")
    b.join()  # announced at a's next commit; a dies before handing the state on
    a.close()
    reply = b.world(timeout=20)
    assert "no worker of the next world (b) holds the job's state" in reply["error"], reply
    assert server.failure is not None


def test_newcomers_form_a_world_where_nobody_synced_yet(make_server):
    # A first world that broke before its sync: nothing to lose, a newcomer may start.
    server = make_server(min_np=1, max_np=2, initial_np=1)
    (a,) = first_world(server, "a")
    b = Worker(server, "b")
    b.join()
    a.close()
    assert b.world(timeout=20)["rank"] == 0
