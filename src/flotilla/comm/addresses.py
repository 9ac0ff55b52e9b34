"""Which local address each plane binds and advertises: the one whose route reaches the cluster.

A host usually has several addresses (loopback, a LAN, a VPN, a container bridge) and its
hostname often resolves to a loopback address (``127.0.1.1`` on Debian): a process that
advertised what its hostname resolves to, as gloo's default device does, would be unreachable
from every other machine.  So every plane asks the kernel instead: the local address of the
route to the coordinator (a UDP ``connect`` sends nothing; the kernel only picks the route,
as Horovod and NCCL probe interfaces that reach their peers).

- :func:`route_to` -- the local address of the route to a host;
- :func:`local_toward` -- the same, unless this process was given an explicit address
  (:func:`set_local_host`: ``--host``, ``$FLOTILLA_HOST``, ``cluster.host``), which then wins;
- :func:`gloo_options` -- a gloo device bound to the address that reaches a group's rendezvous
  store (the coordinator's, or in ring mode the lowest member's), so the collective plane's
  full mesh advertises an address the peers can connect to;
- :func:`interface_of` -- the interface name holding an address (``NCCL_SOCKET_IFNAME``).

Every address chosen here is logged once per process (``comm.addresses``), so a host that
cannot join says which address it used.  Invariants: nothing here opens a listening socket;
an override that is not an address of this host is refused with an error naming it.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import ipaddress
import os
import re
import socket
import struct
import threading
from typing import Any

from flotilla.core.errors import CommError, ConfigError
from flotilla.core.log import get_logger

__all__ = [
    "WILDCARDS",
    "PeerUnreachable",
    "check_first_group",
    "gloo_options",
    "interface_of",
    "local_host",
    "local_toward",
    "log_address",
    "prepare_nccl",
    "route_to",
    "set_local_host",
    "split_host_port",
    "store_endpoint",
    "unreachable_peer",
]

log = get_logger("comm.addresses")

WILDCARDS = frozenset({"0.0.0.0", "::", "*", ""})
"""Bind addresses meaning "every interface": never advertised as they are."""

_override: str | None = None
_logged: set[tuple[str, str]] = set()
_advertised: dict[str, str] = {}  # plane -> the address it used last
_lock = threading.Lock()


def split_host_port(address: str) -> tuple[str, int]:
    """``tcp://host:port``, ``host:port`` or ``[v6]:port`` -> ``(host, port)``."""
    rest = address.partition("://")[2] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"address: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def reached_where_dialled(value: object, host: str) -> object:
    """``value`` (JSON data: a service's addresses) with every ``tcp://`` address bound on every
    interface (a wildcard host) given ``host`` instead: the host a client dialled to learn it."""
    if isinstance(value, dict):
        return {k: reached_where_dialled(v, host) for k, v in value.items()}
    if isinstance(value, list):
        return [reached_where_dialled(v, host) for v in value]
    if isinstance(value, str) and value.startswith("tcp://"):
        bound, port = split_host_port(value)
        if bound in WILDCARDS:
            return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
    return value


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def route_to(host: str, port: int = 9) -> str:
    """The local address of this host's route to ``host`` (a name or an address)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise CommError(f"cannot resolve {host!r}: {exc}") from None
    errors = []
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(sockaddr)  # (UDP: nothing is sent; the kernel picks the route)
                return str(probe.getsockname()[0])
        except OSError as exc:
            errors.append(f"{sockaddr[0]}: {exc}")
    raise CommError(f"no local interface reaches {host}: {'; '.join(errors) or 'no address'}")


def _check_local(host: str) -> None:
    """Refuse an address this host does not hold (binding it would fail later, obscurely)."""
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError as exc:
        raise ConfigError(f"host: {host!r} is not an address of this machine ({exc})") from None


def set_local_host(host: str | None) -> None:
    """Make ``host`` (an address of this machine) the one every plane of this process binds
    and advertises, instead of the route to the coordinator; ``None`` clears it."""
    global _override
    if host is not None and host not in WILDCARDS:
        host = _numeric(host.strip("[]"))
        _check_local(host)
        _override = host
    else:
        _override = None


def _numeric(host: str) -> str:
    """``host`` as an address (a name is resolved: zmq binds addresses, not names)."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as exc:
        raise ConfigError(f"host: cannot resolve {host!r}: {exc}") from None


def local_host() -> str | None:
    """The explicit address of this process (:func:`set_local_host`), if any."""
    return _override


def local_toward(host: str, port: int = 9, *, plane: str = "") -> str:
    """The address this process binds and advertises to be reached from ``host``: the
    explicit one, or the local end of the route to ``host``.  ``plane`` names the user in the
    log line written the first time an address is used for it."""
    local = _override if _override is not None else route_to(host, port)
    if plane:
        how = "set explicitly" if _override is not None else f"the route to {host}"
        log_address(plane, local, how)
    return local


def log_address(plane: str, address: str, how: str) -> None:
    """One INFO line per (plane, address) and process: which address a plane uses, and why."""
    with _lock:
        _advertised[plane] = address
        if (plane, address) in _logged:
            return
        _logged.add((plane, address))
    log.info("%s: %s (%s)", plane, address, how)


def store_endpoint(store: Any) -> tuple[str, int] | None:
    """``(host, port)`` of the TCP store under any prefix stores, or None (another store)."""
    for _ in range(64):
        if hasattr(store, "host") and hasattr(store, "port"):
            return str(store.host), int(store.port)
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            return None
        store = inner
    return None


def gloo_options(store: Any, timeout: _dt.timedelta) -> Any:
    """Options for ``ProcessGroupGloo`` whose device binds the address that reaches ``store``'s
    host (or this process's explicit address; ``$GLOO_SOCKET_IFNAME``, torch's own setting,
    still wins where a user set it)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if ifname:
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=i) for i in ifname.split(",")]
        log_address("collective plane (gloo)", ifname, "GLOO_SOCKET_IFNAME")
        return opts
    endpoint = store_endpoint(store)
    if endpoint is None and _override is None:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        return opts
    host, port = endpoint if endpoint is not None else ("", 0)
    local = local_toward(host, port, plane="collective plane (gloo)")
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
    return opts


_SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of the (IPv4) interface holding ``address``, or None (not found, IPv6, not
    Linux): what ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` want."""
    try:
        wanted = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if ipaddress.IPv4Address(raw[20:24]) == wanted:
                return name
    return None


def prepare_nccl(store: Any) -> None:
    """Point NCCL's bootstrap and socket transport at the interface that reaches ``store``'s
    host (``NCCL_SOCKET_IFNAME``), unless the user set it.  Untested: no GPU was available."""
    if os.environ.get("NCCL_SOCKET_IFNAME"):
        return
    endpoint = store_endpoint(store)
    if endpoint is None and _override is None:
        return
    host, port = endpoint if endpoint is not None else ("", 0)
    name = interface_of(local_toward(host, port, plane="collective plane (nccl)"))
    if name is not None:
        os.environ["NCCL_SOCKET_IFNAME"] = name


_REMOTE = re.compile(r"remote=\[([^\]]*)\]:(\d+)")
_CAUSES = ("Connection refused", "No route to host", "Network is unreachable", "Connection timed out")


def unreachable_peer(error: str) -> str | None:
    """``HOST:PORT (cause)`` of the peer a failed group set-up could not connect to, when the
    transport's error names one (gloo's full-mesh connect does), else None."""
    found = _REMOTE.search(error)
    if found is None:
        return None
    cause = next((c.lower() for c in _CAUSES if c.lower() in error.lower()), "could not connect")
    return f"{found.group(1)}:{found.group(2)} ({cause})"


def check_first_group(error: str, *, own: str | None = None) -> None:
    """A worker whose FIRST group could not connect to a peer fails its join with one line
    naming the address it tried (``PeerUnreachable``), instead of waiting for a view without
    that peer; ``own``: the address this worker advertised, for the message."""
    peer = unreachable_peer(error)
    own = own if own is not None else _advertised.get("collective plane (gloo)")
    if peer is not None:
        mine = f" (this worker advertised {own})" if own else ""
        raise PeerUnreachable(
            f"joined, but cannot reach peer {peer}{mine}: every host must advertise an address "
            "the others can reach (--host, GLOO_SOCKET_IFNAME; docs/multihost.md)"
        )


class PeerUnreachable(CommError):
    """A worker cannot connect to the address a peer advertised (not a collective failure:
    the loop does not recover from it; the worker exits naming the address)."""
