"""An MPI-free bootstrap: ranks find each other through a TCP rendezvous at rank 0.

Set three variables in every process and call ``keras_ring.init()`` as usual:

```
KERAS_RING_RANK=1  KERAS_RING_SIZE=4  KERAS_RING_RENDEZVOUS=node0:29500  python train.py
```

Rank 0 listens on the rendezvous port; the other ranks connect to it, retrying until the
start deadline (``KERAS_RING_START_TIMEOUT_SECONDS``, default ``KERAS_RING_TIMEOUT_SECONDS``),
and send their rank, size, host identity and the address of their runtime listener. Rank 0
checks that the claims fit together, draws the job token and sends every rank the whole table.
The result is the same ``PeerTable`` as the MPI bootstrap's, so every transport works the same
afterwards.

The runtime listener is created before the exchange (peers may connect as soon as they have
the table), i.e. before rank 0 knows whether every rank is on its host. So it is bound to
loopback when the rendezvous host is a loopback address (then every rank runs on that one
host) and to every interface otherwise.

The pieces are usable on their own: ``exchange()`` is the TCP exchange and ``build_table()``
turns any exchange's result into a ``PeerTable`` (``keras_ring.spark`` exchanges through
Spark's barrier tasks instead).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from keras_ring._errors_base import InitError
from keras_ring.config import (RANK_VARIABLE, RENDEZVOUS_VARIABLE, SIZE_VARIABLE,
                               START_TIMEOUT_VARIABLE, Config, disagreement, int_from_env,
                               must_agree, seconds_from_env)
from keras_ring.interfaces import is_loopback, network_stack_id
from keras_ring.peer_table import (PeerTable, Topology, check_hosts, listen, offered_addresses,
                                   reachable_addresses)

_VARIABLES = (RANK_VARIABLE, SIZE_VARIABLE, RENDEZVOUS_VARIABLE)

# Identifies the protocol, so a stray connection (a port scanner, a health probe, a job of
# another keras_ring version) is told apart from a rank and ignored.
_MAGIC = "keras_ring.rendezvous/1"
_MAX_MESSAGE_BYTES = 1 << 20
# How long rank 0 waits for a connected client's hello before dropping that connection.
_HELLO_SECONDS = 10.0
_RETRY_SECONDS = (0.05, 1.0)  # first and longest pause between connection attempts
_FIRST_ATTEMPT_SECONDS = 5.0  # the first connection attempt's limit; each next one's doubles


@dataclass(frozen=True)
class Peer:
    """One rank's entry in the exchange: where its runtime listener is, and its host."""

    host_id: str
    address: str  # candidate addresses, comma-separated, best first
    port: int
    stack: str = ""  # interfaces.network_stack_id() of its process; "" if unknown


@dataclass(frozen=True)
class Offer:
    """What a rank tells rank 0 about itself."""

    host_id: str
    port: int  # of its runtime listener
    addresses: str = ""  # candidates, comma-separated, best first
    explicit: bool = False  # set by hand (KERAS_RING_ADVERTISE_ADDRESS): used exactly
    chosen: bool = False  # the interfaces KERAS_RING_SOCKET_IFNAME selects: no other address
    stack: str = ""  # interfaces.network_stack_id()
    loopback_only: bool = False  # its listener accepts connections from this machine only
    agree: list = field(default_factory=list)  # config.must_agree(), compared across ranks
    why: str = ""  # why there are no addresses (what the interfaces offered), else ""


@dataclass(frozen=True)
class Settings:
    """The rendezvous variables of this process, validated."""

    rank: int
    size: int
    host: str
    port: int
    start_timeout: float


def requested() -> bool:
    """True when any rendezvous variable is set (then all three must be)."""
    return any(os.environ.get(v, "").strip() for v in _VARIABLES)


def settings_from_env(config: Config | None = None) -> Settings:
    """Reads and checks the rendezvous variables.

    Args:
        config: supplies the default start timeout; read from the environment when None.

    Raises:
        ValueError: a variable is missing or invalid; the message names it.
    """
    missing = [v for v in _VARIABLES if not os.environ.get(v, "").strip()]
    if missing:
        given = [v for v in _VARIABLES if v not in missing]
        verbs = ("is", "are")
        raise ValueError(
            f"{' and '.join(missing)} {verbs[len(missing) > 1]} not set but "
            f"{' and '.join(given)} {verbs[len(given) > 1]}: the launch without MPI needs "
            f"all of {', '.join(_VARIABLES)} in every process"
        )
    # All three variables are known to be set here, so the defaults never apply.
    size = int_from_env(SIZE_VARIABLE, 1, minimum=1)
    rank = int_from_env(RANK_VARIABLE, 0, minimum=0)
    if rank >= size:
        raise ValueError(f"{RANK_VARIABLE}={rank} is out of range: "
                         f"{SIZE_VARIABLE}={size} allows ranks 0 to {size - 1}")
    host, port = parse_address(os.environ[RENDEZVOUS_VARIABLE], RENDEZVOUS_VARIABLE)
    default = (config or Config.from_env()).timeout_seconds
    return Settings(rank, size, host, port, seconds_from_env(START_TIMEOUT_VARIABLE, default))


def parse_address(text: str, name: str = "address") -> tuple[str, int]:
    """``host:port`` (or ``[v6 address]:port``) as a pair; a ValueError names ``name``.

    Example:

    ```python
    parse_address("node0:29500")  # ("node0", 29500)
    parse_address("[::1]:29500")  # ("::1", 29500)
    ```
    """
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or ":" in host and not text.startswith("["):
        raise ValueError(f"{name} must be host:port (e.g. node0:29500 or [::1]:29500), "
                         f"got {text!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{name} has an invalid port {port_text!r} in {text!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"{name} port must be in 1..65535, got {port} in {text!r}")
    return host, port


def build_table(rank: int, peers: list[Peer], job_token: int,
                listener: socket.socket | None) -> PeerTable:
    """The runtime's peer table from an exchange's result (``peers`` in rank order).

    Args:
        rank: this process's rank.
        peers: every rank's host identity and listener address, indexed by rank.
        job_token: the same random number on every rank (rejects connections of other jobs).
        listener: this rank's listening socket, whose port is ``peers[rank].port``.
    """
    host_ids = [p.host_id for p in peers]
    topology = Topology.from_host_ids(rank, host_ids)
    if len(peers) == 1:
        if listener is not None:
            listener.close()
        return PeerTable(topology)
    addresses = reachable_addresses(rank, host_ids, [p.stack for p in peers],
                                    [p.address for p in peers], [p.port for p in peers])
    return PeerTable(topology, addresses, job_token, listener)


def from_env(config: Config) -> PeerTable | None:
    """The peer table through the environment rendezvous, or None when it is not requested.

    Raises:
        ValueError: a rendezvous variable is missing or invalid.
        InitError: the rendezvous failed (unreachable, inconsistent ranks, deadline passed).
    """
    if not requested():
        return None
    s = settings_from_env(config)
    host_id = config.host_id or socket.gethostname()
    if s.size == 1:
        return PeerTable(Topology.from_host_ids(0, [host_id]))
    listener, offer = make_offer(config, host_id, is_loopback(s.host), s.size)
    rendezvous = (s.host, s.port)
    deadline = time.monotonic() + s.start_timeout
    try:
        if s.rank != 0:
            peers, token = _join(s.rank, s.size, rendezvous, offer, deadline, s.start_timeout)
            return build_table(s.rank, peers, token, listener)
        peers, token, server = _serve(s.size, rendezvous, offer, deadline, s.start_timeout,
                                      keep_server=True)
        try:
            table = build_table(s.rank, peers, token, listener)
        except BaseException:
            server.close()
            raise
    except BaseException:
        listener.close()
        raise
    table.late_claims = LateClaims(server, s.size, describe(rendezvous), host_id)
    return table


def make_offer(config: Config, host_id: str, loopback_only: bool,
               backlog: int) -> tuple[socket.socket, Offer]:
    """A new runtime listener and what this rank tells the others about itself.

    Args:
        config: the address settings (KERAS_RING_ADVERTISE_ADDRESS & co.).
        host_id: this rank's host identity.
        loopback_only: every rank runs on this machine: listen on loopback only.
        backlog: how many connections may wait at the listener.
    """
    listener = listen(multi_host=not loopback_only, backlog=backlog)
    # No usable interface is no error yet: the address rank 0 sees may be enough (unless
    # KERAS_RING_SOCKET_IFNAME chose the interfaces: check_world then names this reason).
    addresses, why = offered_addresses(config)
    offer = Offer(host_id, listener.getsockname()[1], addresses,
                  explicit=config.advertise_address is not None,
                  chosen=bool((config.socket_ifname or "").strip()), stack=network_stack_id(),
                  loopback_only=loopback_only, agree=list(must_agree(config)), why=why or "")
    return listener, offer


def exchange(rank: int, size: int, rendezvous: tuple[str, int], offer: Offer,
             timeout: float = 300.0) -> tuple[list[Peer], int]:
    """Swaps every rank's ``Peer`` through rank 0 over TCP.

    Rank 0 listens on ``rendezvous``'s port; every other rank connects to it, retrying until
    ``timeout`` seconds have passed. Unless a rank's addresses are explicit, the address its
    rendezvous connection came from (as rank 0 saw it; for rank 0, the address each rank
    reached it at) goes first among its candidates: that one is known to route.

    Args:
        rank: this process's rank in ``[0, size)``.
        size: the number of ranks; every rank must pass the same.
        rendezvous: ``(host, port)`` where rank 0 listens.
        offer: this rank's host identity, listener port and candidate addresses.
        timeout: seconds until the whole exchange must be done.

    Returns:
        Every rank's ``Peer`` in rank order, and the job token rank 0 drew.

    Raises:
        InitError: the deadline passed, or the ranks' claims do not fit together (the same
            message on rank 0 and every rank connected to it).

    Example:

    ```python
    offer = Offer(socket.gethostname(), port, "10.0.0.7", stack=network_stack_id())
    peers, token = exchange(rank, 4, ("node0", 29500), offer)
    table = build_table(rank, peers, token, listener)
    ```
    """
    deadline = time.monotonic() + timeout
    if rank == 0:
        peers, token, _ = _serve(size, rendezvous, offer, deadline, timeout)
        return peers, token
    return _join(rank, size, rendezvous, offer, deadline, timeout)


def route_first(address: str, candidates: str, chosen: bool = False) -> str:
    """``candidates`` with ``address`` (one known to route) in front, unless it is loopback
    or, where the candidates are the interfaces ``KERAS_RING_SOCKET_IFNAME`` chose
    (``chosen``), not among them: the user picked the network, not the rendezvous's route."""
    listed = [a for a in candidates.split(",") if a]
    known = [] if is_loopback(address) or (chosen and address not in listed) else [address]
    return ",".join(dict.fromkeys(known + listed))


# --- rank 0 ----------------------------------------------------------------------------------

def _rendezvous_server(rendezvous: tuple[str, int], backlog: int) -> socket.socket:
    # A loopback rendezvous listens on that loopback address only (an IPv6 one included);
    # otherwise on every interface, IPv6 as well as IPv4 where the system allows both.
    host, port = rendezvous
    if is_loopback(host):
        try:
            bind = str(ipaddress.ip_address(host))
        except ValueError:
            bind = "127.0.0.1"  # localhost
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        return socket.create_server((bind, port), family=family, backlog=backlog)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True,
                                    backlog=backlog)
    return socket.create_server(("0.0.0.0", port), backlog=backlog)


def _serve(size: int, rendezvous: tuple[str, int], me: Offer, deadline: float,
           timeout: float, keep_server: bool = False
           ) -> tuple[list[Peer], int, socket.socket | None]:
    """Rank 0's side of the exchange; with ``keep_server`` the rendezvous socket is returned
    open once the job formed (else None)."""
    where = describe(rendezvous)
    try:
        server = _rendezvous_server(rendezvous, size)
    except OSError as e:
        raise InitError(f"rank 0 could not listen on {where} ({RENDEZVOUS_VARIABLE}): {e}; "
                        "is another job's rank 0 using that port? (A job holds its "
                        "rendezvous port while its rank 0 runs: give each job its own)"
                        ) from None
    joined: dict[int, tuple[socket.socket, Offer, str]] = {}  # conn, offer, address seen
    try:
        with contextlib.ExitStack() as closing:
            closing.callback(server.close)
            while len(joined) < size - 1:
                accepted = _accept_hello(server, deadline)
                if accepted is None:
                    missing = [str(r) for r in range(1, size) if r not in joined]
                    _fail([c for c, _, _ in joined.values()],
                          f"rank 0 waited {timeout:g} s at {where} but rank(s) "
                          f"{', '.join(missing)} of {size} did not join "
                          f"({START_TIMEOUT_VARIABLE})")
                conn, hello = accepted
                problem = _check(hello, size, joined)
                if problem:
                    _fail([conn] + [c for c, _, _ in joined.values()], problem)
                joined[hello["rank"]] = (conn, offer_of(hello), conn.getpeername()[0])
            offers = [me] + [joined[r][1] for r in range(1, size)]
            problem = check_world(offers, [""] + [joined[r][2] for r in range(1, size)])
            if problem:
                _fail([c for c, _, _ in joined.values()], problem)
            token = secrets.randbits(63)
            peers = [Peer(me.host_id, me.addresses, me.port, me.stack)] + [
                Peer(o.host_id, o.addresses if o.explicit
                     else route_first(seen, o.addresses, o.chosen), o.port, o.stack)
                for _, o, seen in (joined[r] for r in range(1, size))]
            reply = {"token": token, "peers": [asdict(p) for p in peers],
                     "rank0_explicit": me.explicit, "rank0_chosen": me.chosen}
            for conn, _, _ in joined.values():
                _send_quietly(conn, reply)
            if keep_server:
                closing.pop_all()
            return peers, token, server if keep_server else None
    finally:
        for conn, _, _ in joined.values():
            conn.close()


def offer_of(hello: dict) -> Offer:
    why = hello.get("why", "")
    return Offer(hello["host_id"], hello["port"], hello["addresses"], hello["explicit"],
                 hello["chosen"], hello["stack"], hello["loopback_only"], hello["agree"],
                 why if isinstance(why, str) else "")


def check_world(offers: list[Offer], seen: list[str]) -> str | None:
    """What is wrong with the claims of all ranks together; None if nothing."""
    problem = (disagreement([o.agree for o in offers])
               or check_hosts([o.host_id for o in offers], [o.stack for o in offers]))
    if problem:
        return problem
    for r, o in enumerate(offers):
        away = [q for q, other in enumerate(offers) if other.stack != o.stack]
        if o.loopback_only and away:
            return (f"rank {r} on host {o.host_id} reached the rendezvous at a loopback "
                    f"address ({RENDEZVOUS_VARIABLE}), so its runtime accepts connections "
                    f"from its own machine only, but rank(s) {', '.join(map(str, away[:8]))} "
                    f"run on other hosts: give every rank the same {RENDEZVOUS_VARIABLE}, an "
                    "address that every host reaches")
        if away and not o.addresses and o.chosen:  # the rendezvous's route is not chosen
            return f"rank {r} (host '{o.host_id}'): {o.why or 'no address offered'}"
        if away and not o.addresses and is_loopback(seen[r] or "127.0.0.1"):
            return (f"rank {r} on host {o.host_id} has no address that other hosts can "
                    "reach: set KERAS_RING_SOCKET_IFNAME or KERAS_RING_ADVERTISE_ADDRESS "
                    "on that host")
    return None


def _accept_hello(server: socket.socket, deadline: float) -> tuple[socket.socket, dict] | None:
    """The next connection that speaks the protocol, with its hello; None past the deadline."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        server.settimeout(remaining)
        try:
            conn, _ = server.accept()
        except socket.timeout:
            return None
        try:
            hello = receive_message(conn, min(deadline, time.monotonic() + _HELLO_SECONDS))
            if hello.get("magic") == _MAGIC and well_formed(hello):
                return conn, hello
        except (OSError, ValueError):
            pass
        conn.close()  # not one of ours, or it gave up: keep waiting for the ranks


def well_formed(hello: dict) -> bool:
    types = {"rank": int, "size": int, "host_id": str, "port": int, "addresses": str,
             "explicit": bool, "chosen": bool, "stack": str, "loopback_only": bool,
             "agree": list}
    return all(isinstance(hello.get(k), t) for k, t in types.items())


def _check(hello: dict, size: int, joined: dict) -> str | None:
    """What is wrong with a rank's claim, given those already accepted; None if nothing."""
    rank, theirs, host = hello["rank"], hello["size"], hello["host_id"]
    if theirs != size:
        return (f"{SIZE_VARIABLE} disagrees: rank {rank} on host {host} has "
                f"{SIZE_VARIABLE}={theirs}, rank 0 has {SIZE_VARIABLE}={size}")
    if not 0 <= rank < size:
        return f"{RANK_VARIABLE}={rank} on host {host} is out of range for {size} ranks"
    if rank == 0 or rank in joined:
        first = "rank 0 itself" if rank == 0 else f"a process on host {joined[rank][1].host_id}"
        return (f"two processes claim {RANK_VARIABLE}={rank}: {first} and a process on host "
                f"{host}; every process needs its own rank")
    return None


def _fail(conns: list[socket.socket], message: str) -> None:
    """Tells every connected rank what went wrong, and raises it here."""
    for conn in conns:
        _send_quietly(conn, {"error": message})
        conn.close()
    raise InitError(message)


class LateClaims:
    """Rank 0's rendezvous port, held open after the job formed for as long as the process runs.

    Two jobs given one ``KERAS_RING_RENDEZVOUS`` mixed silently when it closed: the first rank 0
    took whichever process claimed a rank first, perhaps the other job's, and the other job's
    rank 0 then listened on the freed port and gathered the rest, so both jobs summed two
    programs' data with no error. Held, the port fails that second rank 0 at once, and a later
    claim of a rank reaches this rank 0: the claimant gets an ``InitError``, and where it claims
    a rank of a job of this size (so one of this job's ranks may be the other job's process),
    ``on_claim`` (the runtime's ``fail_job``) fails this job on every rank.
    """

    def __init__(self, server: socket.socket, size: int, where: str, host_id: str) -> None:
        self._server, self._size, self._where, self._host_id = server, size, where, host_id
        self.on_claim: Callable[[str], None] | None = None
        # The first claim that fails the job, kept: one that came before the runtime could
        # fail (init() still connecting, or between shutdown() and the next init()) is acted
        # on by the next init() (see Runtime.init), on_claim being only the quick path.
        self.claimed: str | None = None
        server.settimeout(None)
        # A process forked from rank 0 (a data loader's worker) would hold the port after
        # rank 0 ends, and connections would queue there unanswered: the child closes its
        # copy (only the descriptor: shutdown() would stop the parent's accept too).
        os.register_at_fork(after_in_child=server.close)
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="keras_ring rendezvous: late claims")
        self._thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        self._server.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    hello = receive_message(conn, time.monotonic() + _HELLO_SECONDS)
                except (OSError, ValueError):
                    continue
                if hello.get("magic") == _MAGIC and well_formed(hello):
                    self._refuse(conn, hello)

    def _refuse(self, conn: socket.socket, hello: dict) -> None:
        rank, size, host = hello["rank"], hello["size"], hello["host_id"]
        try:
            # The claim first, the answer after: the claimant, told, may look at once.
            if size == self._size:
                self._note_claim(rank, host)
        finally:
            _send_quietly(conn, {"error": (
                f"the job at {self._where} ({RENDEZVOUS_VARIABLE}), rank 0 on host "
                f"{self._host_id}, formed already without this process ({RANK_VARIABLE}={rank}, "
                f"{SIZE_VARIABLE}={size}): do two jobs share that rendezvous? Give each job its "
                "own port")})

    def _note_claim(self, rank: int, host: str) -> None:
        reason = (f"keras_ring: rank {rank} of this job was claimed again after the job formed, "
                  f"by a process on host {host} at {self._where} ({RENDEZVOUS_VARIABLE}): two "
                  f"jobs share that rendezvous, so one rank of this job may be the other job's "
                  "process, and collectives so far may have mixed the two jobs' data. Give "
                  "each job its own port")
        if self.claimed is None:
            self.claimed = reason  # before on_claim: init() reads it after the runtime is up
        if self.on_claim is not None:
            self.on_claim(reason)


# --- ranks 1.. -------------------------------------------------------------------------------

def _join(rank: int, size: int, rendezvous: tuple[str, int], offer: Offer, deadline: float,
          timeout: float) -> tuple[list[Peer], int]:
    where = describe(rendezvous)
    with _connect(rendezvous, deadline, timeout) as conn:
        hello = dict(asdict(offer), magic=_MAGIC, rank=rank, size=size)
        try:
            send_message(conn, hello)
            reply = receive_message(conn, deadline)
        except socket.timeout:
            raise InitError(f"rank {rank}: the rendezvous at {where} did not complete within "
                            f"{timeout:g} s ({START_TIMEOUT_VARIABLE}): rank 0 is still "
                            "waiting for other ranks") from None
        except (OSError, ValueError) as e:
            raise InitError(f"rank {rank}: the rendezvous at {where} broke off: {e}") from None
        rank0_address = conn.getpeername()[0]
    if "error" in reply:
        raise InitError(f"rank {rank}: rendezvous failed: {reply['error']}")
    peers = [Peer(p["host_id"], p["address"], int(p["port"]), p["stack"])
             for p in reply["peers"]]
    if not reply["rank0_explicit"]:  # rank 0 is known to route where this rank reached it
        zero = peers[0]
        peers[0] = Peer(zero.host_id, route_first(rank0_address, zero.address,
                                                  reply["rank0_chosen"]), zero.port, zero.stack)
    return peers, int(reply["token"])


def _connect(rendezvous: tuple[str, int], deadline: float, timeout: float) -> socket.socket:
    # Rank 0 may start later than the others (or its host name may not resolve yet).
    # Each attempt may take twice as long as the last: a round trip longer than the first
    # (a saturated VPN, a satellite hop) still connects within the timeout.
    pause, attempt, last_error = _RETRY_SECONDS[0], _FIRST_ATTEMPT_SECONDS, None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise InitError(f"could not reach rank 0 at {describe(rendezvous)} "
                            f"({RENDEZVOUS_VARIABLE}) within {timeout:g} s "
                            f"({START_TIMEOUT_VARIABLE}): {last_error}")
        try:
            return socket.create_connection(rendezvous, timeout=min(remaining, attempt))
        except TimeoutError as e:
            last_error, attempt = e, attempt * 2
        except OSError as e:
            last_error = e
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(pause * 2, _RETRY_SECONDS[1])


# --- messages: a 4-byte length, then JSON --------------------------------------------------------

def send_message(conn: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def _send_quietly(conn: socket.socket, message: dict) -> None:
    # A rank that already gave up is no reason to fail the others.
    try:
        conn.settimeout(5.0)
        send_message(conn, message)
    except OSError:
        pass


def receive_message(conn: socket.socket, deadline: float) -> dict:
    (length,) = struct.unpack("!I", _read(conn, 4, deadline))
    if length > _MAX_MESSAGE_BYTES:
        raise ValueError(f"rendezvous message of {length} bytes is too long")
    message = json.loads(_read(conn, length, deadline))
    if not isinstance(message, dict):
        raise ValueError("rendezvous message is not an object")
    return message


def _read(conn: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        conn.settimeout(remaining)
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed by the other side")
        data += chunk
    return data


def describe(rendezvous: tuple[str, int]) -> str:
    host, port = rendezvous
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
