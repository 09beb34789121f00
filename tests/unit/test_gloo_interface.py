"""engine/transport/gloo_interface.py: where this host's name resolves to loopback, a process about to join a
gloo group whose rendezvous is on another address binds the interface that routes to it (else its
peers on other machines could never connect); nothing changes otherwise. On a real multi-node Ray
cluster (whose host name here resolves to 127.0.0.1): tests/integration/test_ray_multinode.py."""

from __future__ import annotations

import socket

import pytest

import k3post.engine.transport.gloo_interface as gloo
from k3post.engine.transport.gloo_interface import IFNAME_ENV, bind_gloo_towards, interface_with, source_address_towards


def a_routable_address() -> tuple[str, str]:
    """(interface, its IPv4 address) of a non-loopback interface of this machine."""
    for _, name in socket.if_nameindex():
        address = gloo._ipv4_of(name)
        if address and not address.startswith("127."):
            return name, address
    pytest.skip("no non-loopback IPv4 interface on this machine")


def test_the_loopback_route_and_interface():
    assert source_address_towards("127.0.0.1") == "127.0.0.1"
    assert gloo._ipv4_of(interface_with("127.0.0.1")) == "127.0.0.1"
    assert interface_with("203.0.113.254") is None  # a documentation address no interface holds


def test_a_loopback_host_name_binds_the_interface_towards_the_peer(monkeypatch):
    interface, address = a_routable_address()
    monkeypatch.delenv(IFNAME_ENV, raising=False)
    monkeypatch.setattr(gloo, "host_name_is_loopback", lambda: True)
    assert bind_gloo_towards(address) == interface
    assert gloo.os.environ[IFNAME_ENV] == interface


@pytest.mark.parametrize("case", ["set by the user", "loopback peer", "host name not loopback"])
def test_otherwise_nothing_changes(monkeypatch, case):
    _, address = a_routable_address()
    monkeypatch.delenv(IFNAME_ENV, raising=False)
    monkeypatch.setattr(gloo, "host_name_is_loopback", lambda: case != "host name not loopback")
    if case == "set by the user":
        monkeypatch.setenv(IFNAME_ENV, "ib0")
    assert bind_gloo_towards("127.0.0.1" if case == "loopback peer" else address) is None
    assert gloo.os.environ.get(IFNAME_ENV) == ("ib0" if case == "set by the user" else None)
