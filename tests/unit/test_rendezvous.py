"""The MPI-free launch: KERAS_RING_RANK / KERAS_RING_SIZE / KERAS_RING_RENDEZVOUS.

Real jobs here are N subprocesses started by the test (no mpirun) running real collectives;
the exchange's consistency checks run in threads of this process, which is faster.
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import keras_ring as kr
from keras_ring import interfaces
from keras_ring import rendezvous as rv
from keras_ring.bootstrap import bootstrap
from keras_ring.config import Config

RANK_PROGRAM = Path(__file__).with_name("rendezvous_rank.py")
GUARD = 180  # seconds: a hang guard for the child processes, never a timing assertion


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(env: dict, size: int, mode: str, host_ids=None, overrides=None,
                rank0_delay: float = 0.0, host: str = "127.0.0.1") -> list[subprocess.Popen]:
    """``size`` rank processes; rank 0 last (after ``rank0_delay``) so the others retry."""
    rendezvous = f"{host}:{free_port()}"
    procs = {}
    for rank in reversed(range(size)):
        if rank == 0 and rank0_delay:
            time.sleep(rank0_delay)
        child = dict(env, KERAS_RING_RANK=str(rank), KERAS_RING_SIZE=str(size),
                     KERAS_RING_RENDEZVOUS=rendezvous)
        if host_ids:
            child["KERAS_RING_HOST_ID"] = host_ids[rank]
        child.update((overrides or {}).get(rank, {}))
        procs[rank] = subprocess.Popen(
            [sys.executable, str(RANK_PROGRAM), mode], env=child, cwd=RANK_PROGRAM.parents[2],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return [procs[r] for r in range(size)]


def outcomes(procs: list[subprocess.Popen]) -> list[tuple[str, dict]]:
    """("RESULT" or "ERROR", payload) per rank, in rank order."""
    outputs = [proc.communicate(timeout=GUARD) for proc in procs]
    found, problems = [], []
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        lines = [ln for ln in out.splitlines() if ln.startswith(("RESULT ", "ERROR "))]
        if not lines:  # every rank's story: the first to fail is not always the culprit
            problems.append(f"rank {rank} printed no outcome (exit {proc.returncode}):\n"
                            f"{out}\n{err[-3000:]}")
            continue
        kind, _, payload = lines[-1].partition(" ")
        found.append((kind, json.loads(payload)))
    assert not problems, "\n".join(problems)
    return found


@pytest.fixture
def env(clean_env, tmp_path):
    env = {k: v for k, v in clean_env.items() if not k.startswith("KERAS_RING_")}
    env.update(KERAS_RING_TIMEOUT_SECONDS="60", KERAS_RING_SEGMENT_BYTES="65536",
               RENDEZVOUS_TEST_DIR=str(tmp_path))
    return env


# --- real jobs -------------------------------------------------------------------------------

def test_two_ranks_one_host_run_collectives(env):
    results = outcomes(start_ranks(env, 2, "collectives", rank0_delay=1.0))
    for rank, (kind, r) in enumerate(results):
        assert kind == "RESULT", r
        assert (r["rank"], r["size"], r["local_rank"], r["local_size"]) == (rank, 2, rank, 2)
        assert (r["cross_rank"], r["cross_size"]) == (0, 1)
        assert r["checked"] > 15


def test_four_ranks_on_two_hosts_run_collectives(env):
    # Two host identities on one machine: shared memory within a "host", TCP across.
    hosts = ["alpha", "alpha", "beta", "beta"]
    results = outcomes(start_ranks(env, 4, "collectives", host_ids=hosts))
    for rank, (kind, r) in enumerate(results):
        assert kind == "RESULT", r
        assert (r["rank"], r["size"]) == (rank, 4)
        assert (r["local_rank"], r["local_size"]) == (rank % 2, 2)
        assert (r["cross_rank"], r["cross_size"]) == (rank // 2, 2)


def test_ipv6_rendezvous_with_two_hosts_runs_collectives(env):
    # Rank 0 listens on [::1] and sees the others' addresses as ::1; their runtime listeners
    # are reached at 127.0.0.1 (a loopback address means this machine, whatever its family).
    results = outcomes(start_ranks(env, 2, "collectives", host_ids=["alpha", "beta"],
                                   host="[::1]"))
    for rank, (kind, r) in enumerate(results):
        assert kind == "RESULT", r
        assert (r["rank"], r["cross_rank"], r["cross_size"]) == (rank, rank, 2)


def test_multi_host_listener_accepts_ipv4_and_ipv6():
    from keras_ring.peer_table import listen

    listener = listen(multi_host=True, backlog=2)
    port = listener.getsockname()[1]
    try:
        families = [socket.AF_INET, socket.AF_INET6] if socket.has_dualstack_ipv6() else [socket.AF_INET]
        for family in families:
            address = "127.0.0.1" if family == socket.AF_INET else "::1"
            with socket.create_connection((address, port), timeout=5):
                conn, _ = listener.accept()
                conn.close()
    finally:
        listener.close()


@pytest.mark.parametrize("address, routable", [
    ("::1", "127.0.0.1"), ("127.0.0.5", "127.0.0.1"), ("::ffff:10.1.2.3", "10.1.2.3"),
    ("10.1.2.3", "10.1.2.3"), ("fd00::7", "fd00::7"), ("node7", "node7")])
def test_peer_addresses_become_routable(address, routable):
    assert interfaces.routable(address) == routable


def test_unreachable_rendezvous_fails_the_bootstrap_within_the_start_timeout(monkeypatch):
    monkeypatch.setenv("KERAS_RING_RANK", "1")
    monkeypatch.setenv("KERAS_RING_SIZE", "2")
    monkeypatch.setenv("KERAS_RING_RENDEZVOUS", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("KERAS_RING_START_TIMEOUT_SECONDS", "1.5")
    start = time.monotonic()
    with pytest.raises(kr.InitError, match=r"could not reach rank 0 at 127\.0\.0\.1:\d+ "
                       r"\(KERAS_RING_RENDEZVOUS\) within 1\.5 s "
                       r"\(KERAS_RING_START_TIMEOUT_SECONDS\): .*Connection refused"):
        bootstrap(Config.from_env())  # what init() calls (once per process, hence directly)
    # Not the default start timeout's wait: a hang guard, not a timing claim (6 s was seen
    # under load).
    assert 1.5 <= time.monotonic() - start < 30.0


# --- the variables ---------------------------------------------------------------------------

BAD_SETTINGS = [
    ({"KERAS_RING_RANK": "one"}, "KERAS_RING_RANK must be an integer, got 'one'"),
    ({"KERAS_RING_RANK": "-1"}, "KERAS_RING_RANK must be at least 0"),
    ({"KERAS_RING_SIZE": "0"}, "KERAS_RING_SIZE must be at least 1"),
    ({"KERAS_RING_SIZE": "2.5"}, "KERAS_RING_SIZE must be an integer"),
    ({"KERAS_RING_RANK": "2"}, "KERAS_RING_RANK=2 is out of range: KERAS_RING_SIZE=2"),
    ({"KERAS_RING_RENDEZVOUS": "node0"}, "KERAS_RING_RENDEZVOUS must be host:port"),
    ({"KERAS_RING_RENDEZVOUS": ":29500"}, "KERAS_RING_RENDEZVOUS must be host:port"),
    ({"KERAS_RING_RENDEZVOUS": "node0:http"}, "KERAS_RING_RENDEZVOUS has an invalid port"),
    ({"KERAS_RING_RENDEZVOUS": "node0:70000"}, "KERAS_RING_RENDEZVOUS port must be in"),
    ({"KERAS_RING_RENDEZVOUS": "::1:29500"}, "KERAS_RING_RENDEZVOUS must be host:port"),
    ({"KERAS_RING_RENDEZVOUS": ""}, "KERAS_RING_RENDEZVOUS is not set but KERAS_RING_RANK and KERAS_RING_SIZE are"),
    ({"KERAS_RING_RANK": "", "KERAS_RING_SIZE": ""}, "KERAS_RING_RANK and KERAS_RING_SIZE are not set but KERAS_RING_RENDEZVOUS is"),
    ({"KERAS_RING_START_TIMEOUT_SECONDS": "soon"}, "KERAS_RING_START_TIMEOUT_SECONDS must be"),
]


@pytest.fixture
def rendezvous_env(monkeypatch):
    monkeypatch.setenv("KERAS_RING_RANK", "1")
    monkeypatch.setenv("KERAS_RING_SIZE", "2")
    monkeypatch.setenv("KERAS_RING_RENDEZVOUS", "node0:29500")
    return monkeypatch


@pytest.mark.parametrize("changes,message", BAD_SETTINGS, ids=[m for _, m in BAD_SETTINGS])
def test_bad_variables_name_the_variable(rendezvous_env, changes, message):
    for name, value in changes.items():
        rendezvous_env.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        rv.settings_from_env()


def test_the_bootstrap_reports_a_bad_variable_before_connecting(rendezvous_env):
    rendezvous_env.setenv("KERAS_RING_RANK", "7")
    with pytest.raises(ValueError, match="KERAS_RING_RANK=7 is out of range"):
        bootstrap(Config.from_env())


def test_good_variables_and_ipv6(rendezvous_env):
    rendezvous_env.setenv("KERAS_RING_START_TIMEOUT_SECONDS", "12")
    assert rv.settings_from_env() == rv.Settings(1, 2, "node0", 29500, 12.0)
    rendezvous_env.setenv("KERAS_RING_RENDEZVOUS", "[::1]:29500")
    assert (rv.settings_from_env().host, rv.settings_from_env().port) == ("::1", 29500)


def test_start_timeout_defaults_to_the_timeout(rendezvous_env):
    rendezvous_env.setenv("KERAS_RING_TIMEOUT_SECONDS", "42")
    rendezvous_env.delenv("KERAS_RING_START_TIMEOUT_SECONDS", raising=False)
    assert rv.settings_from_env().start_timeout == 42.0


def test_world_of_one_needs_no_exchange(monkeypatch):
    monkeypatch.setenv("KERAS_RING_RANK", "0")
    monkeypatch.setenv("KERAS_RING_SIZE", "1")
    monkeypatch.setenv("KERAS_RING_RENDEZVOUS", f"127.0.0.1:{free_port()}")
    table = rv.from_env(Config.from_env())
    assert table.topology.size == 1 and table.listener is None


def test_loopback_names():
    is_loopback = interfaces.is_loopback
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    # Host names count as routable even where /etc/hosts maps them to 127.0.1.1.
    assert not is_loopback(socket.gethostname()) and not is_loopback("10.1.2.3")


def test_two_jobs_given_one_rendezvous_fail_instead_of_mixing(env):
    """Job B's rank 1 reached job A's rank 0 first and formed a job with it; job A's rank 1 and
    job B's rank 0 come later. Each job's ranks would have summed the other program's data,
    and every process would have ended well. Now all four fail, each saying why."""
    rendezvous = f"127.0.0.1:{free_port()}"

    def rank(r: int, mode: str) -> subprocess.Popen:
        child = dict(env, KERAS_RING_RANK=str(r), KERAS_RING_SIZE="2",
                     KERAS_RING_RENDEZVOUS=rendezvous)
        return subprocess.Popen([sys.executable, str(RANK_PROGRAM), mode], env=child,
                                cwd=RANK_PROGRAM.parents[2], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    a0, b1 = rank(0, "until_failure"), rank(1, "until_failure")
    formed = a0.stdout.readline()  # an ERROR line (or none) if the two never formed a job
    assert formed == "FORMED\n", formed + a0.stderr.read()[-3000:]
    b0 = rank(0, "init")
    [(kind, second_zero)] = outcomes([b0])
    assert kind == "ERROR" and second_zero["type"] == "InitError", second_zero
    assert "could not listen" in second_zero["message"], second_zero
    assert "another job's rank 0" in second_zero["message"], second_zero
    a1 = rank(1, "init")
    results = outcomes([a0, b1, a1])
    assert [kind for kind, _ in results] == ["ERROR"] * 3, results
    (_, late), claimed = results[2], [payload for _, payload in results[:2]]
    assert late["type"] == "InitError", late
    assert "formed already without this process (KERAS_RING_RANK=1" in late["message"], late
    for payload in claimed:  # the mixed job, on both of its ranks
        assert "rank 1 of this job was claimed again after the job formed" in \
            payload["message"], payload
        assert "Give each job its own port" in payload["message"], payload


def test_late_claims_are_refused_and_only_a_claim_of_this_size_fails_the_job():
    rendezvous = ("127.0.0.1", free_port())
    deadline = time.monotonic() + 10
    joined = threading.Thread(target=lambda: rv._join(1, 2, rendezvous, rv.Offer("h", 2),
                                                      deadline, 10.0))
    joined.start()
    _, _, server = rv._serve(2, rendezvous, rv.Offer("h", 1), deadline, 10.0, keep_server=True)
    joined.join(GUARD)
    claims: list[str] = []
    guard = rv.LateClaims(server, 2, "127.0.0.1:x", "h")

    def claim(size: int, host: str) -> None:
        with pytest.raises(kr.InitError, match="formed already without this process"):
            rv._join(1, size, rendezvous, rv.Offer(host, 3), time.monotonic() + 10, 10.0)

    try:
        claim(3, "other")  # another job's shape: refused, this job left alone
        assert guard.claimed is None
        claim(2, "early")  # before the runtime could fail (init() still connecting): kept
        assert "by a process on host early" in guard.claimed, guard.claimed
        guard.on_claim = claims.append
        claim(2, "late")
        assert len(claims) == 1 and "by a process on host late" in claims[0], claims
        assert "host early" in guard.claimed  # the first one stays
        child = os.fork()  # a data loader's worker, say: it must not hold rank 0's port
        if child == 0:
            os._exit(0 if guard._server.fileno() == -1 else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
        with pytest.raises(kr.InitError, match="could not listen"):  # the port stays held
            rv.exchange(0, 2, rendezvous, rv.Offer("h", 4), timeout=1.0)
    finally:
        guard.close()
    guard._thread.join(GUARD)
    assert not guard._thread.is_alive()
    with socket.create_server(rendezvous):  # closed: free again
        pass


# --- the exchange, in threads -------------------------------------------------------------------

def exchange_all(claims: list[tuple[int, int]], timeout: float = 10.0, offers=None) -> list:
    """Runs exchange() for each (rank, size) claim in its own thread; results or exceptions.

    Claim i offers host ``host{i % 2}`` in its own network stack, port 40000 + i and address
    10.9.0.i, unless ``offers`` gives its Offer.
    """
    rendezvous = ("127.0.0.1", free_port())
    results = [None] * len(claims)

    def one(i, rank, size):
        offer = (offers or {}).get(i) or rv.Offer(f"host{i % 2}", 40000 + i, f"10.9.0.{i}",
                                                  stack=f"stack{i % 2}")
        try:
            results[i] = rv.exchange(rank, size, rendezvous, offer, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - compared below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, *c)) for i, c in enumerate(claims)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GUARD)
    return results


def test_exchange_gives_every_rank_the_same_table_and_token():
    results = exchange_all([(2, 3), (1, 3), (0, 3)])
    tables = [peers for peers, _ in results]
    tokens = {token for _, token in results}
    assert len(tokens) == 1 and 0 <= tokens.pop() < 2**63
    assert tables[0] == tables[1]  # ranks 1 and 2 see rank 0 where they reached it
    assert [p.port for p in tables[0]] == [40002, 40001, 40000]
    assert [p.host_id for p in tables[0]] == ["host0", "host1", "host0"]
    # Seen at a loopback address, which other hosts cannot use: the offered ones stay.
    assert [p.address for p in tables[0]] == ["10.9.0.2", "10.9.0.1", "10.9.0.0"]
    assert [p.stack for p in tables[0]] == ["stack0", "stack1", "stack0"]


def test_size_disagreement_is_an_error_on_every_process():
    results = exchange_all([(0, 2), (1, 3)])
    for r in results:
        assert isinstance(r, kr.InitError), r
        assert ("KERAS_RING_SIZE disagrees: rank 1 on host host1 has KERAS_RING_SIZE=3, "
                "rank 0 has KERAS_RING_SIZE=2") in str(r)
    assert str(results[1]).startswith("rank 1: rendezvous failed: ")


def test_duplicate_rank_is_an_error_on_every_process():
    results = exchange_all([(0, 3), (1, 3), (1, 3)])
    for r in results:
        assert isinstance(r, kr.InitError), r
        assert "two processes claim KERAS_RING_RANK=1" in str(r)


def test_second_rank_zero_cannot_take_the_port():
    results = exchange_all([(0, 2), (0, 2)], timeout=2.0)
    errors = [r for r in results if isinstance(r, kr.InitError)]
    assert len(errors) == 2, results  # one cannot listen; the other waits for rank 1 in vain
    assert any("could not listen" in str(e) for e in errors)


def test_rank_zero_names_the_ranks_that_never_came():
    start = time.monotonic()
    [error] = exchange_all([(0, 4)], timeout=1.0)
    assert isinstance(error, kr.InitError)
    assert "rank(s) 1, 2, 3 of 4 did not join" in str(error)
    assert time.monotonic() - start < 5.0


def test_stray_connections_are_ignored():
    rendezvous = ("127.0.0.1", free_port())
    result = {}
    server = threading.Thread(target=lambda: result.update(
        zero=rv.exchange(0, 2, rendezvous, rv.Offer("h", 1), timeout=10.0)))
    server.start()
    deadline = time.monotonic() + 5
    while True:  # a probe that speaks another protocol, then hangs up
        try:
            with socket.create_connection(rendezvous) as probe:
                probe.sendall(b"GET / HTTP/1.0\r\n\r\n")
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    peers, token = rv.exchange(1, 2, rendezvous, rv.Offer("h", 2), timeout=10.0)
    server.join(GUARD)
    assert result["zero"][1] == token and [p.port for p in peers] == [1, 2]


def test_build_table_reaches_same_host_peers_over_loopback():
    peers = [rv.Peer("a", "10.0.0.1", 1), rv.Peer("b", "10.0.0.2", 2), rv.Peer("a", "10.0.0.3", 3)]
    table = rv.build_table(2, peers, 99, listener=None)
    assert table.addresses == [("127.0.0.1", 1), ("10.0.0.2", 2), ("127.0.0.1", 3)]
    topo = table.topology
    assert (topo.rank, topo.local_rank, topo.local_size, topo.cross_rank) == (2, 1, 2, 0)
    assert table.job_token == 99


def test_one_host_identity_in_two_network_stacks_fails_on_every_rank_naming_the_variable():
    # Two machines that share a host name: they would reach each other over loopback.
    offers = {i: rv.Offer("node", 40000 + i, f"10.9.0.{i}", stack=f"machine{i}")
              for i in range(2)}
    start = time.monotonic()
    results = exchange_all([(0, 2), (1, 2)], offers=offers)
    for r in results:
        assert isinstance(r, kr.InitError), r
        assert "ranks 0 and 1 both claim host 'node'" in str(r)
        assert "KERAS_RING_HOST_ID" in str(r)
    assert time.monotonic() - start < GUARD / 2  # at the rendezvous, not at a timeout


def test_a_rank_behind_a_loopback_rendezvous_in_a_multi_host_job_is_named():
    # Rank 1 spelled the rendezvous 127.0.0.1 (its listener is loopback-only) while rank 2
    # runs on another host: rank 1 is at fault, not the rank that cannot reach it.
    offers = {0: rv.Offer("a", 40000, "10.9.0.0", stack="A"),
              1: rv.Offer("a", 40001, "10.9.0.0", stack="A", loopback_only=True),
              2: rv.Offer("b", 40002, "10.9.0.2", stack="B")}
    results = exchange_all([(0, 3), (1, 3), (2, 3)], offers=offers)
    for r in results:
        assert isinstance(r, kr.InitError), r
        assert "rank 1 on host a reached the rendezvous at a loopback address" in str(r)
        assert "rank(s) 2 run on other hosts" in str(r)


def test_an_interface_choice_that_matches_nothing_is_named_on_every_rank():
    # KERAS_RING_SOCKET_IFNAME=eth0 where host b calls it ens5: the interfaces' own reason
    # must reach every rank, not "offered no address" (the rendezvous's route is not chosen).
    why = "KERAS_RING_SOCKET_IFNAME='eth0' matches no interface (seen: lo, ens5)"
    offers = {0: rv.Offer("a", 40000, "10.9.0.0", chosen=True, stack="A"),
              1: rv.Offer("b", 40001, "", chosen=True, stack="B", why=why)}
    results = exchange_all([(0, 2), (1, 2)], offers=offers)
    for r in results:
        assert isinstance(r, kr.InitError), r
        assert f"rank 1 (host 'b'): {why}" in str(r)


def test_explicit_addresses_are_kept_as_given():
    offers = {0: rv.Offer("a", 40000, "192.168.5.1", explicit=True, stack="A"),
              1: rv.Offer("b", 40001, "192.168.5.2,10.0.0.2", explicit=True, stack="B")}
    (peers0, _), (peers1, _) = exchange_all([(0, 2), (1, 2)], offers=offers)
    assert peers0 == peers1
    assert [p.address for p in peers0] == ["192.168.5.1", "192.168.5.2,10.0.0.2"]


def test_the_rendezvous_route_goes_first_unless_the_interfaces_were_chosen():
    # The address a rank reached rank 0 from is known to route: tried first. Where
    # KERAS_RING_SOCKET_IFNAME chose the interfaces, it goes first only if it is on one of
    # them (a probe's job ran 3 of 4 host pairs over the rendezvous's network instead).
    assert rv.route_first("10.1.0.5", "10.2.0.5") == "10.1.0.5,10.2.0.5"
    assert rv.route_first("10.1.0.5", "10.2.0.5", chosen=True) == "10.2.0.5"
    assert rv.route_first("10.2.0.6", "10.2.0.5,10.2.0.6", chosen=True) == "10.2.0.6,10.2.0.5"
    assert rv.route_first("127.0.0.1", "10.2.0.5") == "10.2.0.5"


def test_an_mpi_launch_without_mpi4py_says_what_to_install(monkeypatch):
    from keras_ring.mpi_exchange import mpi_bootstrap

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if it were not installed
    with pytest.raises(kr.InitError, match=r"mpi4py is not installed: pip install "
                                           r"keras-ring\[mpi\]"):
        mpi_bootstrap(Config.from_env())


def test_check_hosts():
    from keras_ring.bootstrap import check_hosts

    assert check_hosts(["a", "a", "b"], ["s1", "s1", "s2"]) is None
    # A host map faked on one machine: different identities in one stack are fine.
    assert check_hosts(["a", "b"], ["s1", "s1"]) is None
    assert "ranks 1 and 2 both claim host 'b'" in check_hosts(["a", "b", "b"], ["s", "s", "t"])


def test_reachable_addresses():
    from keras_ring.bootstrap import reachable_addresses

    hosts, stacks = ["a", "b", "c", "a"], ["A", "B", "A", "A"]
    offered = ["10.0.0.1", "127.0.1.1,10.0.0.2,::ffff:10.0.0.9", "10.0.0.3", "10.0.0.1"]
    got = reachable_addresses(0, hosts, stacks, offered, [1, 2, 3, 4])
    # Same host or same stack: loopback. Another stack: its loopback candidate is dropped.
    assert got == [("127.0.0.1", 1), ("10.0.0.2,10.0.0.9", 2), ("127.0.0.1", 3),
                   ("127.0.0.1", 4)]
    with pytest.raises(kr.InitError, match=r"rank 1 \(host 'b'\) offered no address"):
        reachable_addresses(0, hosts, stacks, ["", "127.0.0.1", "", ""], [1, 2, 3, 4])


_DIFFERENT_SETTING = """
import os, sys
rank = os.environ.get("PMI_RANK") or os.environ["KERAS_RING_RANK"]
os.environ["KERAS_RING_FAST_AGREE"] = "0" if rank == "0" else "1"
from keras_ring.bootstrap import bootstrap
from keras_ring.config import Config
try:
    bootstrap(Config.from_env())
except Exception as e:
    # One write: unbuffered, print writes each piece and the newline apart, and ranks sharing
    # mpirun's stdout interleaved them.
    sys.stdout.write(f"ERROR {rank} {type(e).__name__} {e}\\n")
    sys.stdout.flush()
"""


@pytest.mark.parametrize("exchange", ["mpirun", "rendezvous"])
def test_ranks_started_with_different_transport_settings_fail_at_init_naming_it(
        exchange, mpirun, clean_env):
    # Such ranks could not talk (a lost connection, or mismatches naming nothing of the cause).
    if exchange == "mpirun":
        procs = [subprocess.Popen([mpirun, "-np", "2", sys.executable, "-c", _DIFFERENT_SETTING],
                                  env=clean_env, stdout=subprocess.PIPE, text=True)]
    else:
        address = f"127.0.0.1:{free_port()}"
        procs = [subprocess.Popen([sys.executable, "-c", _DIFFERENT_SETTING], env=dict(
            clean_env, KERAS_RING_RANK=str(r), KERAS_RING_SIZE="2",
            KERAS_RING_RENDEZVOUS=address), stdout=subprocess.PIPE, text=True) for r in range(2)]
    out = "".join(p.communicate(timeout=GUARD)[0] for p in procs)
    errors = {line.split()[1]: line for line in out.splitlines() if line.startswith("ERROR ")}
    assert sorted(errors) == ["0", "1"], out
    for line in errors.values():
        assert line.split()[2] == "InitError", out
        assert ("KERAS_RING_FAST_AGREE differs between ranks: rank 0 runs with False, rank 1 "
                "with True") in line, out
