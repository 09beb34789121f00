"""Which network interface gloo binds to, so that ranks on different machines can reach each other.

Gloo (the learner's group on CPUs, and the CPU weight broadcast) does not take an address: each
process binds the address its host name resolves to, unless `GLOO_SOCKET_IFNAME` names an
interface. Many hosts resolve their own name to a loopback address (`127.0.1.1 <host>` in a
Debian/Ubuntu /etc/hosts, `127.0.0.1` in some containers): a process there binds loopback, tells
its peers that address, and a peer on another machine can never connect - the group's first
collective fails, or hangs until its timeout.

`bind_gloo_towards(peer)` is called before a process joins a gloo group whose rendezvous is at
`peer` (learner rank 0's node address, which Ray gives). If the variable is unset, the peer is not
a loopback address, and this host's name resolves to loopback, it sets `GLOO_SOCKET_IFNAME` to the
interface that carries this host's traffic towards `peer` (the kernel's route: the source address
of a UDP socket connected to it, no packet sent). Anything else is left to gloo as it was.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

IFNAME_ENV = "GLOO_SOCKET_IFNAME"
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def host_name_is_loopback() -> bool:
    """Whether this host's name resolves (IPv4) only to loopback addresses - what gloo would bind."""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        return False
    return bool(found) and all(_is_loopback(a) for a in found)


def source_address_towards(peer: str) -> str:
    """The local address the kernel would send from to reach `peer` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_with(address: str) -> str | None:
    """The name of the local interface that holds IPv4 `address`, if any."""
    return next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == address), None)


def bind_gloo_towards(peer: str) -> str | None:
    """Set GLOO_SOCKET_IFNAME for a group whose rendezvous is at `peer` where gloo would otherwise
    bind loopback (see the module docstring); returns the interface chosen, or None."""
    if os.environ.get(IFNAME_ENV) or _is_loopback(peer) or not host_name_is_loopback():
        return None
    try:
        interface = interface_with(source_address_towards(peer))
    except OSError:  # no route to the peer: gloo will say so itself
        return None
    if interface is not None:
        os.environ[IFNAME_ENV] = interface
    return interface
