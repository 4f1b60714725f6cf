"""Where a redirected connection was going: SO_ORIGINAL_DST on a socket (rule 4: the
proxy's per-connection form is compiled with its accept path).

Rules:
1. iptables mode: the REDIRECT target rewrote the destination in conntrack;
   `getsockopt(SOL_IP, SO_ORIGINAL_DST)` on the accepted socket reads it back.
2. Other modes (eBPF) pass `lookup`, a function from the accepted socket to the
   original destination or None; it is asked first, and SO_ORIGINAL_DST is the
   fallback. This is the only hook; the eBPF mode extends it, nothing else.
3. A socket that was not redirected has no conntrack NAT entry: the kernel
   answers ENOENT and this raises `OriginalDstError`.
4. The proxy's per-connection form, from the accepted socket's fd, compiled, is
   `agent.proxy.accept.original_dst_of_fd` (its rule 6): this module is interpreted.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from agent.errors import AgentError

# <linux/netfilter_ipv4.h>: #define SO_ORIGINAL_DST 80 (at level SOL_IP).
SO_ORIGINAL_DST = 80
SOL_IP = getattr(socket, "SOL_IP", 0)

# The kernel fills a `struct sockaddr_in` (16 bytes):
#   sa_family_t    sin_family;  2 bytes, host order (AF_INET)
#   in_port_t      sin_port;    2 bytes, network order
#   struct in_addr sin_addr;    4 bytes, network order
#   unsigned char  sin_zero[8]; padding
# so bytes 2..4 are the port and 4..8 the IPv4 address, both big-endian.
_SOCKADDR_IN_LEN = 16

Lookup = Callable[[socket.socket], tuple[str, int] | None]


class OriginalDstError(AgentError):
    """The original destination of a connection is unknown."""

    def __init__(self, sock: str, reason: str) -> None:
        self.sock = sock
        self.reason = reason
        super().__init__(f"original destination of {sock}: {reason}")


def original_dst(sock: socket.socket, *, lookup: Lookup | None = None) -> tuple[str, int]:
    """The (ip, port) the peer of this accepted socket originally connected to.

    Raises:
        OriginalDstError: neither `lookup` nor conntrack knows it.
    """
    if lookup is not None:
        found = lookup(sock)
        if found is not None:
            return found
    try:
        raw = sock.getsockopt(SOL_IP, SO_ORIGINAL_DST, _SOCKADDR_IN_LEN)
    except OSError as exc:
        raise OriginalDstError(_describe(sock), exc.strerror or str(exc)) from exc
    return decode_sockaddr_in(raw)


def decode_sockaddr_in(raw: bytes) -> tuple[str, int]:
    """(ip, port) from the bytes of a `struct sockaddr_in`.

    Raises:
        ValueError: too short.
    """
    if len(raw) < 8:
        raise ValueError(f"sockaddr_in needs 8 bytes, got {len(raw)}")
    (port,) = struct.unpack_from("!H", raw, 2)
    return socket.inet_ntoa(raw[4:8]), port


def _describe(sock: socket.socket) -> str:
    try:
        local = sock.getsockname()
        peer = sock.getpeername()
    except OSError:
        return f"fd {sock.fileno()}"
    return f"{peer[0]}:{peer[1]}->{local[0]}:{local[1]}"
