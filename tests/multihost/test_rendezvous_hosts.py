"""The environment rendezvous across hosts: uneven hosts, and misconfigurations that must
fail at once, on every rank, naming the rank or the variable at fault."""

from __future__ import annotations

import subprocess

from tests.multihost.conftest import PYTHON, ROOT, describe, finish, records

RANK_PROGRAM = str(ROOT / "tests" / "unit" / "rendezvous_rank.py")
PORT = 29611  # rank 0's rendezvous port, inside its own namespace: nothing else uses it
TIMEOUT = 60.0


def start(c, placement: list[str], env: dict, tmp_path, mode: str = "collectives",
          overrides: dict | None = None) -> list[subprocess.Popen]:
    """Rank r on host placement[r], all meeting at h0's rendezvous unless overridden."""
    procs = []
    for rank, host in enumerate(placement):
        child = dict(env, KERAS_RING_RANK=str(rank), KERAS_RING_SIZE=str(len(placement)),
                     KERAS_RING_RENDEZVOUS=f"{placement[0]}:{PORT}",
                     KERAS_RING_TIMEOUT_SECONDS=str(TIMEOUT), RENDEZVOUS_TEST_DIR=str(tmp_path))
        child.update((overrides or {}).get(rank, {}))
        procs.append(c.popen(host, [PYTHON, RANK_PROGRAM, mode], child, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def test_three_hosts_with_uneven_ranks_run_every_collective(cluster, env, tmp_path):
    placement = ["h0", "h0", "h1", "h2", "h2"]
    c = cluster(["h0", "h1", "h2"])
    outputs = finish(start(c, placement, env, tmp_path))
    results = [r for _, out, _ in outputs for r in records(out, "RESULT")]
    assert len(results) == 5, describe(outputs)
    for rank, r in enumerate(sorted(results, key=lambda r: r["rank"])):
        assert r["size"] == 5 and r["checked"] > 20
        assert r["local_size"] == placement.count(placement[rank])
        assert r["local_rank"] == placement[:rank].count(placement[rank])


def test_one_host_identity_on_two_hosts_fails_at_once_naming_the_variable(cluster, env, tmp_path):
    # As two machines with the same host name would: every rank claims host "node".
    c = cluster(["h0", "h1"])
    same = {r: {"KERAS_RING_HOST_ID": "node"} for r in range(4)}
    outputs = finish(start(c, ["h0", "h0", "h1", "h1"], env, tmp_path, "init", same))
    errors = [e for _, out, _ in outputs for e in records(out, "ERROR")]
    assert len(errors) == 4, describe(outputs)
    for e in errors:
        assert e["type"] == "InitError"
        assert "both claim host 'node'" in e["message"] and "KERAS_RING_HOST_ID" in e["message"]
        assert e["seconds"] < TIMEOUT / 2, e  # at the rendezvous, not after a timeout


def test_a_rank_that_spells_the_rendezvous_as_loopback_is_the_one_named(cluster, env, tmp_path):
    c = cluster(["h0", "h1"])
    loopback = {1: {"KERAS_RING_RENDEZVOUS": f"127.0.0.1:{PORT}"}}  # rank 1 lives on h0
    outputs = finish(start(c, ["h0", "h0", "h1", "h1"], env, tmp_path, "init", loopback))
    errors = [e for _, out, _ in outputs for e in records(out, "ERROR")]
    assert len(errors) == 4, describe(outputs)
    for e in errors:
        assert "rank 1 on host h0 reached the rendezvous at a loopback address" in e["message"], e
        assert e["seconds"] < TIMEOUT / 2, e


def test_a_rank_that_advertises_a_foreign_address_is_named_on_every_rank_before_the_timeout(
        cluster, env, tmp_path):
    # Rank 1 (on h0) hands its peers an address no host has: rank 2 and 3 on h1 cannot reach
    # it, and rank 1, waiting for them to connect, is reached by no one. They tell the ranks
    # they did reach, which pass it on, so rank 1 hears the cause too.
    c = cluster(["h0", "h1"])
    wrong = "10.250.99.99"  # outside the cluster's subnet: no route leads there
    advertise = {1: {"KERAS_RING_ADVERTISE_ADDRESS": wrong}}
    outputs = finish(start(c, ["h0", "h0", "h1", "h1"], env, tmp_path, "init", advertise))
    errors = {e["rank"]: e for _, out, _ in outputs for e in records(out, "ERROR")}
    assert sorted(errors) == [0, 1, 2, 3], describe(outputs)
    for e in errors.values():
        assert "could not connect to rank 1 at any address it offered" in e["message"], e
        assert f"{wrong}:" in e["message"] and "Network is unreachable" in e["message"], e
        assert e["seconds"] < TIMEOUT / 2, e  # told, not timed out
    assert "is no address of this host" in errors[1]["message"], errors[1]
    assert all(code != 0 for code, _, _ in outputs), describe(outputs)
