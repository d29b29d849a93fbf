"""Address selection: which addresses a rank offers to other hosts, and why not others."""

import socket

import pytest

from keras_ring import interfaces as itf

V4, V6 = socket.AF_INET, socket.AF_INET6


def interface(name, address, up=True):
    family = V6 if ":" in address else V4
    return itf.Interface(name, address, family, up, loopback=name == "lo")


HOST = [interface("lo", "127.0.0.1"), interface("eth0", "10.1.0.5"),
        interface("docker0", "172.17.0.1"), interface("ib0", "192.168.9.5"),
        interface("eth0", "fe80::1"), interface("eth0", "fd00::5"),
        interface("eth1", "10.2.0.5", up=False), interface("lo", "::1")]


def test_default_offers_every_routable_address_ipv4_first():
    assert itf.candidate_addresses(interfaces=HOST) == ["10.1.0.5", "192.168.9.5", "fd00::5"]


@pytest.mark.parametrize("spec, expected", [
    ("ib", ["192.168.9.5"]),
    ("=eth0", ["10.1.0.5", "fd00::5"]),
    ("^eth", ["172.17.0.1", "192.168.9.5"]),  # an explicit rule replaces the default one
    ("^=eth0,=docker0", ["192.168.9.5"]),
    ("eth,ib", ["10.1.0.5", "192.168.9.5", "fd00::5"]),
])
def test_socket_ifname_selects_interfaces_as_nccl_does(spec, expected):
    assert itf.candidate_addresses(ifname=spec, interfaces=HOST) == expected


def test_explicit_addresses_win():
    assert itf.candidate_addresses("10.9.9.9, 10.8.8.8", "ib", HOST) == ["10.9.9.9", "10.8.8.8"]


def test_no_usable_interface_says_what_was_seen_and_what_to_set():
    only_loopback = [interface("lo", "127.0.0.1"), interface("eth1", "10.2.0.5", up=False)]
    with pytest.raises(itf.AddressError) as e:
        itf.candidate_addresses(interfaces=only_loopback)
    assert "lo 127.0.0.1, eth1 10.2.0.5 (down)" in str(e.value)
    assert "KERAS_RING_SOCKET_IFNAME" in str(e.value) and "KERAS_RING_ADVERTISE_ADDRESS" in str(e.value)
    with pytest.raises(itf.AddressError, match="KERAS_RING_SOCKET_IFNAME='=eth9' selects none"):
        itf.candidate_addresses(ifname="=eth9", interfaces=HOST)


def test_this_hosts_interfaces_are_read_and_never_offer_loopback():
    found = itf.local_interfaces()
    assert any(i.loopback and i.address == "127.0.0.1" for i in found)
    routable = [i for i in found if i.up and not i.loopback and not i.name.startswith("docker")
                and not i.address.startswith("fe80")]
    try:
        offered = itf.candidate_addresses()
    except itf.AddressError:
        offered = []
    assert sorted(offered) == sorted(i.address for i in routable), found


def test_network_stack_id_is_stable_in_a_process():
    assert itf.network_stack_id() == itf.network_stack_id()
    assert "/" in itf.network_stack_id()  # boot id / namespace inode, on Linux


def test_a_hand_set_address_that_is_not_this_hosts_is_told_apart():
    # 192.0.2.x is reserved for documentation: no host has it. Loopback and a real address
    # of this host can be bound; a name that does not resolve is no address either.
    mine = next((i.address for i in itf.local_interfaces()
                 if i.family == socket.AF_INET and i.up), "127.0.0.1")
    assert itf.foreign_addresses(f"192.0.2.7, {mine},localhost,no-such-host.invalid") == [
        "192.0.2.7", "no-such-host.invalid"]
    assert itf.foreign_addresses(mine) == []
    hint = itf.advertise_hint("192.0.2.7")
    assert "KERAS_RING_ADVERTISE_ADDRESS='192.0.2.7'" in hint
    assert "192.0.2.7 is no address of this host" in hint
    assert itf.advertise_hint(mine) == "" and itf.advertise_hint(None) == ""
