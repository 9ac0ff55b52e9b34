"""Hosts made of Linux network namespaces, for multi-host tests on one machine.

``Hosts(n)`` creates ``n`` namespaces ("hosts"), each holding only a loopback interface and one
end of a veth pair to the next, so the hosts reach each other on private addresses
``10.<a>.<b>.k`` (unique per run) and on nothing else: a process that advertised its loopback
address, or what its hostname resolves to, is unreachable from the other host.  Every name
carries this process's id and a counter, so parallel or leftover runs never collide.

``close`` (always called: use it as a context manager or a fixture) kills every process started
in a host and deletes the namespaces, which removes their veths with them -- on failure too.

``unavailable()`` says why namespaces cannot be used here (not root, no ``ip``, creation
refused), or None.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.multiproc._jobs import ROOT, stop

_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why network namespaces cannot be used on this machine, or None."""
    if os.geteuid() != 0:
        return "network-namespace tests need root"
    if shutil.which("ip") is None:
        return "network-namespace tests need the `ip` command (iproute2)"
    probe = f"flprobe-{os.getpid()}-{next(_counter)}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    netns: str
    address: str


class Hosts:
    """Two hosts on one private /24, joined by a veth pair (the tests here need no more)."""

    def __init__(self, n: int = 2) -> None:
        if n != 2:
            raise ValueError("Hosts supports two hosts (one veth pair)")
        k = next(_counter)
        tag = f"{os.getpid() % 100000}{k}"
        net = f"10.{100 + (os.getpid() // 250) % 150}.{(os.getpid() + k) % 250}"
        self.hosts = [Host(f"flotilla-{tag}-{i}", f"{net}.{i + 1}") for i in range(n)]
        self._veths = (f"flv{tag}a"[:15], f"flv{tag}b"[:15])
        self._procs: list[tuple[Host, subprocess.Popen]] = []
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        a, b = self.hosts
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            _ip("-n", h.netns, "link", "set", "lo", "up")
        _ip("link", "add", self._veths[0], "type", "veth", "peer", "name", self._veths[1])
        for h, veth in zip(self.hosts, self._veths):
            _ip("link", "set", veth, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", veth)
            _ip("-n", h.netns, "link", "set", veth, "up")

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def start(self, host: Host, args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """``flotilla ARGS`` as a process of ``host`` (its own session, output to ``log``)."""
        fh = open(log, "wb")
        try:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, sys.executable, "-m", "flotilla.cli.main", *args],
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        finally:
            fh.close()
        self._procs.append((host, proc))
        return proc

    def kill_host(self, host: Host) -> None:
        """SIGKILL every process started on ``host`` (the machine is gone)."""
        for where, proc in self._procs:
            if where == host:
                stop(proc)

    def close(self) -> None:
        for _, proc in self._procs:
            try:
                stop(proc)
            except Exception:
                pass
        for h in self.hosts:
            _ip("netns", "del", h.netns, check=False)  # (its veth end and the peer go with it)
        for veth in self._veths:  # a veth not yet moved into a namespace
            _ip("link", "del", veth, check=False)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
