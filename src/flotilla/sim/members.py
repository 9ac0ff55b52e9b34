"""Who is alive in a simulation, and what the devices cost (pure; ``docs/simulator.md``).

:class:`Members` applies a run's :class:`~flotilla.sim.model.Change` list as simulated time
passes: a revocation removes a live worker (or a replacement still starting up); an arrival
holds a new device from its arrival on and makes it *ready* to join ``Recovery.startup_s``
later.  A device is paid for from its start (0, or its arrival) to its revocation or the end
(``device_s``, ``cost``).  Worker indices are stable: a device keeps its index (its slowdown
draws) for the whole run; a returning name gets a new one, as a restarted process gets a new
worker id.
"""

from __future__ import annotations

from flotilla.sim.model import Change, Recovery, SimCluster, SimDevice

__all__ = ["Members"]


class Members:
    def __init__(
        self, cluster: SimCluster, changes: tuple[Change, ...] | list[Change], recovery: Recovery
    ) -> None:
        self.cluster, self.recovery = cluster, recovery
        self.live: dict[str, SimDevice] = {d.name: d for d in cluster.devices()}
        self.index: dict[str, int] = {name: i for i, name in enumerate(self.live)}
        self._next_index = len(self.index)
        self._changes = sorted(changes, key=lambda c: c.at_s)
        self._at = 0  # the next change to apply
        self._kills = [i for i, c in enumerate(self._changes) if c.kill]  # (next_kill scans only these)
        self._kill_at = 0
        self._devices = {d.name: d for d in cluster.devices()}
        self._since: dict[str, float] = dict.fromkeys(self.live, 0.0)
        self._price: dict[str, float] = {n: d.price_per_hour for n, d in self.live.items()}
        self.arriving: dict[str, tuple[SimDevice, float]] = {}  # name -> (device, ready at)
        self.device_s = 0.0
        self.cost = 0.0
        self.revoked_at: list[float] = []  # revocations of live workers (the recoveries to measure)

    def _release(self, name: str, t: float) -> None:
        held = max(0.0, t - self._since.pop(name))
        self.device_s += held
        self.cost += held * self._price.pop(name) / 3600.0

    def next_kill(self, until: float) -> Change | None:
        """The next revocation of a live worker at or before ``until``, not applied yet."""
        while self._kill_at < len(self._kills) and self._kills[self._kill_at] < self._at:
            self._kill_at += 1  # (applied already)
        for i in self._kills[self._kill_at :]:
            c = self._changes[i]
            if c.at_s > until:
                return None
            if c.name in self.live:
                return c
        return None

    def advance(self, t: float) -> list[Change]:
        """Apply every change at or before ``t``; the revocations of live workers are returned."""
        killed: list[Change] = []
        while self._at < len(self._changes) and self._changes[self._at].at_s <= t:
            c = self._changes[self._at]
            self._at += 1
            if c.kill:
                if c.name in self.live:
                    del self.live[c.name]
                    self._release(c.name, c.at_s)
                    self.revoked_at.append(c.at_s if c.cause_s is None else c.cause_s)
                    killed.append(c)
                elif c.name in self.arriving:
                    del self.arriving[c.name]
                    self._release(c.name, c.at_s)
            elif c.name not in self.live and c.name not in self.arriving:
                device = self._devices.get(c.name) or self.cluster.spare(c.name)
                self.arriving[c.name] = (device, c.ready_at(self.recovery))
                self._since[c.name] = c.at_s
                self._price[c.name] = device.price_per_hour
                self.index[c.name] = self._next_index  # (a new process: a new worker id)
                self._next_index += 1
        return killed

    def ready(self, t: float) -> list[str]:
        """The arrivals that finished starting up by ``t`` (in arrival order)."""
        return [n for n, (_, at) in self.arriving.items() if at <= t]

    def admit(self, names: list[str]) -> None:
        for n in names:
            device, _ = self.arriving.pop(n)
            self.live[n] = device

    def next_ready_at(self) -> float | None:
        return min((at for _, at in self.arriving.values()), default=None)

    def next_change_at(self) -> float | None:
        return self._changes[self._at].at_s if self._at < len(self._changes) else None

    def close(self, t: float) -> None:
        """The run ended at ``t``: every device still held is released."""
        for name in list(self._since):
            self._release(name, t)
