"""Which addresses this host offers its peers, and what identifies its network stack.

A rank of a multi-host job advertises a list of candidate addresses; peers try them in
order. They come, in this order of precedence, from:

1. ``KERAS_RING_ADVERTISE_ADDRESS`` (one address or several, comma-separated), taken as given;
2. ``KERAS_RING_SOCKET_IFNAME``: the addresses of the interfaces it selects, in NCCL's
   syntax: ``eth`` (names starting with eth), ``=eth0`` (exactly eth0), ``^docker`` (all
   but names starting with docker), ``^=docker0``; several comma-separated;
3. otherwise every address of an interface that is up, except loopback, link-local and
   interfaces named ``lo*`` or ``docker*`` (NCCL's default), the addresses the host name
   resolves to first, IPv4 before IPv6.

A loopback address is never a candidate: on Debian-like systems the host name resolves to
127.0.1.1, which other hosts cannot reach.

Nothing here imports TensorFlow or MPI: launchers use it too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket
from dataclasses import dataclass

ADVERTISE_VARIABLE = "KERAS_RING_ADVERTISE_ADDRESS"
IFNAME_VARIABLE = "KERAS_RING_SOCKET_IFNAME"
_DEFAULT_EXCLUDED = ("lo", "docker")
_MAX_CANDIDATES = 8

_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


@dataclass(frozen=True)
class Interface:
    """One address of one network interface."""

    name: str
    address: str
    family: int  # socket.AF_INET or socket.AF_INET6
    up: bool
    loopback: bool


class AddressError(RuntimeError):
    """No address can be offered to other hosts; the message says what was tried."""


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)), ("netmask", ctypes.POINTER(_SockAddr)),
    ("broadaddr", ctypes.POINTER(_SockAddr)), ("data", ctypes.c_void_p),
]


def local_interfaces() -> list[Interface]:
    """Every IPv4 and IPv6 address of this host's interfaces (getifaddrs), in system order."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.addr:
                family = entry.addr.contents.family
                raw = ctypes.string_at(entry.addr, 28 if family == socket.AF_INET6 else 16)
                address = None
                if family == socket.AF_INET:
                    address = socket.inet_ntop(socket.AF_INET, raw[4:8])
                elif family == socket.AF_INET6:
                    address = socket.inet_ntop(socket.AF_INET6, raw[8:24])
                if address is not None:
                    found.append(Interface(entry.name.decode(errors="replace"), address, family,
                                           bool(entry.flags & _IFF_UP),
                                           bool(entry.flags & _IFF_LOOPBACK)))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return found


def parse_ifname(spec: str) -> tuple[bool, list[tuple[str, bool]]]:
    """``KERAS_RING_SOCKET_IFNAME`` as (exclude, [(name, exact)]).

    Example:

    ```python
    parse_ifname("^docker,=lo")  # (True, [("docker", False), ("lo", True)])
    parse_ifname("eth,ib0")      # (False, [("eth", False), ("ib0", False)])
    ```
    """
    spec = spec.strip()
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    rules = []
    for item in spec.split(","):
        item = item.strip()
        if item:
            rules.append((item[1:], True) if item.startswith("=") else (item, False))
    return exclude, rules


def _matches(name: str, rules: list[tuple[str, bool]]) -> bool:
    return any(name == r if exact else name.startswith(r) for r, exact in rules)


def _routable(interface: Interface) -> bool:
    try:
        ip = ipaddress.ip_address(interface.address.split("%")[0])
    except ValueError:
        return False
    return interface.up and not interface.loopback and not ip.is_loopback and not ip.is_link_local


def _resolved_host_addresses() -> list[str]:
    found = []
    for name in dict.fromkeys((socket.getfqdn(), socket.gethostname())):
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError:
            continue
        found += [info[4][0] for info in infos]
    return list(dict.fromkeys(found))


def candidate_addresses(advertise: str | None = None, ifname: str | None = None,
                        interfaces: list[Interface] | None = None) -> list[str]:
    """The addresses peers on other hosts should try for this rank, best first.

    Args:
        advertise: ``KERAS_RING_ADVERTISE_ADDRESS``: comma-separated, used as given.
        ifname: ``KERAS_RING_SOCKET_IFNAME``: which interfaces to offer (NCCL's syntax).
        interfaces: this host's interfaces (``local_interfaces()`` when None).

    Raises:
        AddressError: nothing routable was found; the message lists what was seen and why
            each was left out, and names the variables that choose.

    Example:

    ```python
    candidate_addresses()                # e.g. ["10.1.2.3", "192.168.7.3", "fd00::3"]
    candidate_addresses(ifname="=eth1")  # eth1's addresses only
    ```
    """
    if advertise:
        return [a.strip() for a in advertise.split(",") if a.strip()]
    interfaces = local_interfaces() if interfaces is None else interfaces
    spec = (ifname or "").strip()
    if spec:
        exclude, rules = parse_ifname(spec)
        chosen = [i for i in interfaces if _matches(i.name, rules) != exclude]
    else:
        chosen = [i for i in interfaces
                  if not _matches(i.name, [(p, False) for p in _DEFAULT_EXCLUDED])]
    usable = [i for i in chosen if _routable(i)]
    mine = {i.address for i in usable}
    preferred = [a for a in _resolved_host_addresses() if a in mine]
    ordered = preferred + [i.address for i in usable if i.family == socket.AF_INET] + [
        i.address for i in usable if i.family == socket.AF_INET6]
    ordered = list(dict.fromkeys(ordered))[:_MAX_CANDIDATES]
    if not ordered:
        raise AddressError(_nothing_usable(interfaces, spec))
    return ordered


def foreign_addresses(advertised: str) -> list[str]:
    """The entries of ``advertised`` (comma-separated addresses or names) that name no
    address of this host: a socket cannot be bound to them here (or a name does not resolve).

    Peers reach such an address only through a translation that forwards every port to this
    host: the runtime listens on an ephemeral port.
    """
    return [a for a in candidate_addresses(advertised) if not _bindable(a)]


def _bindable(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(address)
            return True
        except OSError:
            continue
    return False


def advertise_hint(advertised: str | None) -> str:
    """A sentence for a failed connection: which of this rank's hand-set addresses are not
    this host's, or "" when all are (or none was set)."""
    foreign = foreign_addresses(advertised) if advertised else []
    if not foreign:
        return ""
    what = "is no address" if len(foreign) == 1 else "are no addresses"
    return (f"; this rank advertises {ADVERTISE_VARIABLE}={advertised!r}, and "
            f"{', '.join(foreign)} {what} of this host (a socket cannot be bound here): "
            "peers reach this rank there only through a translation that forwards every "
            "port to it")


def _nothing_usable(interfaces: list[Interface], spec: str) -> str:
    seen = ", ".join(f"{i.name} {i.address}" + ("" if i.up else " (down)")
                     for i in interfaces) or "none"
    rule = (f"{IFNAME_VARIABLE}={spec!r} selects none of them that is up and not loopback"
            if spec else "all are loopback, link-local, down or named lo*/docker*")
    return (f"this host has no address other hosts can reach: its interfaces are {seen}; "
            f"{rule}. Set {IFNAME_VARIABLE} to the interface that connects the hosts "
            f"(e.g. eth0), or {ADVERTISE_VARIABLE} to this host's address (the only way "
            "for a link-local one: fe80::1%eth0)")


def is_loopback(host: str) -> bool:
    """True when ``host`` is a loopback address or ``localhost``.

    Other names count as not loopback even when they resolve to 127.x here: many systems map
    their own host name to 127.0.1.1, yet other hosts reach that name over the network.
    """
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def routable(address: str) -> str:
    """The form of a peer's address that its runtime listener accepts.

    A loopback address (``::1`` too) means this machine, and every listener accepts
    ``127.0.0.1``; an IPv4 client of a dual-stack server shows as ``::ffff:a.b.c.d``.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address  # a host name
    if ip.is_loopback:
        return "127.0.0.1"
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return address


def network_stack_id() -> str:
    """What tells network stacks apart: equal on ranks that can reach each other over
    loopback (one machine, one network namespace), different otherwise.

    It is the kernel's boot id (random per boot, so per machine) and the inode of this
    process's network namespace.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()  # not Linux: the best we know
