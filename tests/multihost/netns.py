"""Hosts made of Linux network namespaces, for tests that cross a real network.

A ``Cluster`` is a set of "hosts" on this machine, each a network namespace with its own
address on a private bridge (itself in a namespace of its own: nothing is added to this
machine's network), its own ``/etc/hosts`` (``ip netns exec`` mounts ``/etc/netns/NS/hosts``)
and, for every process started in it, its own host name (a UTS namespace). Each host's
``/etc/hosts`` maps its own name to 127.0.1.1, as Debian-like systems do, so a program that
advertises "the address of my host name" fails here as it would on such a cluster.

Everything is removed on exit, also on failure: processes left in the namespaces are killed,
namespaces and their ``/etc/netns`` folders deleted. Namespaces of earlier runs whose test
process is gone are removed at the start. Needs root and iproute2 (``ip``) and ``unshare``;
where they are missing, ``Cluster`` raises ``NetnsUnavailable`` saying so (the tests fail
with it: they never pass or skip silently).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

PREFIX = "krmh"  # every namespace of ours: krmh<pid>-<host>
SUBNET = "10.251.0"  # addresses exist only inside our own namespaces
NS_EXEC = Path(__file__).with_name("ns_exec")
NETNS_ETC = Path("/etc/netns")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created on this machine."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_and_delete(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def remove_stale() -> None:
    """Deletes namespaces left by test processes that no longer exist."""
    for ns in _namespaces():
        if not ns.startswith(PREFIX):
            continue
        pid = ns[len(PREFIX):].partition("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _kill_and_delete(ns)


class Cluster:
    """``hosts`` network namespaces joined by a bridge.

    Example:

    ```python
    with Cluster(["h0", "h1"]) as cluster:
        proc = cluster.popen("h1", ["python", "rank.py"], env=env)
        cluster.link_down("h1")  # pull h1's cable
    ```
    """

    def __init__(self, hosts: list[str]):
        self.hosts = list(hosts)
        self.prefix = f"{PREFIX}{os.getpid()}-"
        self.switch = self.prefix + "sw"
        self._made: list[str] = []

    def namespace(self, host: str) -> str:
        return self.prefix + host

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def __enter__(self) -> "Cluster":
        missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
        if missing or os.geteuid() != 0:
            raise NetnsUnavailable(
                "the multi-host tests need root and iproute2/util-linux "
                f"({'missing: ' + ', '.join(missing) if missing else 'not root'}): "
                "they make hosts out of network namespaces")
        remove_stale()
        try:
            self._build()
        except subprocess.CalledProcessError as e:
            self.__exit__(None, None, None)
            raise NetnsUnavailable(f"cannot create network namespaces here: {' '.join(e.cmd)}: "
                                   f"{e.stderr.strip()}") from None
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.namespace(host)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}",
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"port{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost", f"127.0.1.1 {host}"]
            lines += [f"{self.address(h)} {h}" for h in self.hosts if h != host]
            (NETNS_ETC / ns / "hosts").write_text("\n".join(lines) + "\n")

    def __exit__(self, *exc) -> None:
        for ns in reversed(self._made):
            _kill_and_delete(ns)
        self._made.clear()

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: in its namespace, under its host name."""
        return [str(NS_EXEC), host, *argv]

    def env(self, base: dict) -> dict:
        """``base`` plus what ``ns_exec`` needs to find this cluster's namespaces."""
        return dict(base, KR_NETNS_PREFIX=self.prefix)

    def popen(self, host: str, argv: list[str], env: dict, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), env=self.env(env), **kwargs)

    def link_down(self, host: str) -> None:
        """Cuts ``host`` off the bridge (its cable pulled): no error reaches its sockets."""
        _ip("-n", self.switch, "link", "set", f"port{self.hosts.index(host)}", "down")
