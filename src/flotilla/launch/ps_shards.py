"""The parameter-server shards of a ``flotilla run`` (strategy ps): started, watched, restarted.

Guarantees
- One ``flotilla server`` process per shard, started by the run's ``Supervisor``; ``start``
  returns their addresses once every shard listens.
- Snapshots are on by default (``job.auto_checkpoint``, no ``snapshot_every_*`` set): every
  :data:`DEFAULT_SNAPSHOT_EVERY_S` seconds into ``<report dir>/ps-snapshots`` (the run directory
  without a report directory), written, fsynced and renamed (``ps/snapshot.py``).  Snapshots a
  previous job left there are moved aside to ``ps-snapshots.prev`` first (a fresh job never
  resumes them); ``--resume`` cuts a previous job's into this job's first
  (``launch/ps_resume.py``) and the shards restore those.
- A shard that exits while the job runs is logged (a WARNING naming the shard, its exit code and
  its log's last lines) and restarted at the **same address** from its newest snapshot, at most
  ``job.max_restarts`` times per job; the workers' calls meanwhile time out and are retried, and
  against the new incarnation they say hello again, re-syncing their clocks (``ps/client_calls``).
  Past the budget the shard stays dead and the workers give up after ``pull_timeout_s``.
- ``stop`` ends the restarts first, then the shards (SIGTERM: each writes a final snapshot).
- ``report`` (after ``stop``) reads each shard's final snapshot: its version (pushes applied in
  its surviving history) and the updates it lost (pushes a dead incarnation acknowledged after
  its last snapshot, counted by the restarted one when the workers re-said hello:
  ``ps/server_snapshots.py``); acknowledged = applied + lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from flotilla.config import RunConfig
from flotilla.core.errors import FlotillaError
from flotilla.core.log import get_logger
from flotilla.launch.ps_resume import set_aside
from flotilla.launch.supervisor import Child, Supervisor
from flotilla.sync.ps_settings import PSStrategy

__all__ = ["DEFAULT_SNAPSHOT_EVERY_S", "ShardSupervisor", "server_command", "with_default_snapshots"]

DEFAULT_SNAPSHOT_EVERY_S = 2.0  # a restarted shard loses at most about this much of its updates
START_TIMEOUT_S = 60.0

log = get_logger("launcher")


def server_command(
    cfg_file: Path, shard_index: int, secret_file: Path, addr_file: Path, snapshot_dir: Path, bind: str
) -> list[str]:
    import sys

    return [
        sys.executable,
        "-m",
        "flotilla.cli.main",
        "server",
        str(cfg_file),
        "--shard-index",
        str(shard_index),
        "--secret-file",
        str(secret_file),
        "--address-file",
        str(addr_file),
        "--bind",
        bind,
        "--snapshot-dir",
        str(snapshot_dir),
        "--log-level",
        "WARNING",
    ]


def replica_command(
    cfg_file: Path,
    shard_index: int,
    secret_file: Path,
    addr_file: Path,
    bind: str,
    backup: str | None,
    snapshot_dir: Path,
) -> list[str]:
    """A replicated shard's process (``strategy.replication: 2``): its primary (``backup`` given)
    or its backup (``cli/ps_replica_cmd.py``)."""
    import sys

    cmd = [
        sys.executable,
        "-m",
        "flotilla.cli.ps_replica_cmd",
        str(cfg_file),
        "--shard-index",
        str(shard_index),
    ]
    cmd += ["--secret-file", str(secret_file), "--address-file", str(addr_file), "--bind", bind]
    cmd += ["--log-level", "WARNING", "--role"]
    if backup is None:
        return [*cmd, "backup"]
    return [*cmd, "primary", "--backup", backup, "--snapshot-dir", str(snapshot_dir)]


def with_default_snapshots(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the shards' default snapshot cadence (strategy ps, ``job.auto_checkpoint`` on
    and neither ``strategy.snapshot_every_versions`` nor ``snapshot_every_s`` set)."""
    if not cfg.launch_plan().num_servers or not cfg.job.auto_checkpoint:
        return cfg
    s = cast(PSStrategy, cfg.strategy)  # (the strategy with servers)
    if s.snapshot_every_versions or s.snapshot_every_s:
        return cfg
    strategy = s.model_copy(update={"snapshot_every_s": DEFAULT_SNAPSHOT_EVERY_S})
    return cfg.model_copy(update={"strategy": strategy})


@dataclass(slots=True)
class _Proc:
    """One process of a shard: its primary (``backup=False``) or its backup (replication 2)."""

    index: int
    backup: bool = False
    address: str = ""
    child: Child | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"ps{self.index}{'b' if self.backup else ''}"


class ShardSupervisor:
    """Starts the job's shards, restarts a dead one, reports what happened (module doc)."""

    def __init__(
        self,
        cfg: RunConfig,
        supervisor: Supervisor,
        *,
        run_dir: Path,
        snapshot_dir: Path,
        secret_file: Path,
        num_shards: int,
        resumed: bool = False,
    ) -> None:
        self.cfg = cfg
        self.resumed = resumed  # the snapshots in snapshot_dir are this job's (launch/ps_resume.py)
        self.supervisor = supervisor
        self.run_dir = Path(run_dir)
        self.snapshot_dir = Path(snapshot_dir)
        self.secret_file = secret_file
        self.replication = int(cast(PSStrategy, cfg.strategy).replication)
        self.shards = [_Proc(i) for i in range(num_shards)]
        self.backups = [_Proc(i, backup=True) for i in range(num_shards)] if self.replication == 2 else []
        self.max_restarts = cfg.job.max_restarts
        self._stopping = False
        self._t0 = time.monotonic()
        self._cfg_file = self.run_dir / "config.yaml"

    # ------------------------------------------------------------------ start
    def start(self) -> list[str]:
        """Start every shard; their addresses once all listen (``FlotillaError`` if one fails)."""
        self._cfg_file.write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        if not self.resumed:  # (a fresh job never resumes an old one's shards; --resume can)
            set_aside(self.snapshot_dir)
        deadline = time.monotonic() + START_TIMEOUT_S
        for group in (self.backups, self.shards):  # (a primary needs its backup's address)
            for proc in group:
                self._addr_file(proc).unlink(missing_ok=True)  # never a previous job's address
                proc.child = self._spawn(proc, f"tcp://{self.cfg.cluster.host}:0")
            for proc in group:
                proc.address = self._await_address(proc, deadline)
        return [s.address for s in self.shards]

    def _addr_file(self, proc: _Proc) -> Path:
        return self.run_dir / f"{proc.name}.address"

    def _spawn(self, proc: _Proc, bind: str) -> Child:
        addr_file = self._addr_file(proc)
        if self.replication == 1:
            cmd = server_command(
                self._cfg_file, proc.index, self.secret_file, addr_file, self.snapshot_dir, bind
            )
        else:
            backup = None if proc.backup else self.backups[proc.index].address
            cmd = replica_command(
                self._cfg_file, proc.index, self.secret_file, addr_file, bind, backup, self.snapshot_dir
            )
        return self.supervisor.spawn(
            proc.name, cmd, role="server", on_exit=lambda child, rc: self._exited(proc, child, rc)
        )

    def _await_address(self, shard: _Proc, deadline: float) -> str:
        addr_file = self._addr_file(shard)
        child = shard.child
        assert child is not None
        while not addr_file.exists():
            if child.proc.poll() is not None or time.monotonic() > deadline:
                tail = child.log_path.read_text(errors="replace").strip()[-500:]
                raise FlotillaError(f"parameter server {shard.index} did not start: {tail}")
            time.sleep(0.05)
        return addr_file.read_text().strip()

    # ------------------------------------------------------------------ supervision
    def _exited(self, shard: _Proc, child: Child, rc: int) -> None:
        """A shard process ended (``Supervisor.reap``): restart it unless the job is stopping."""
        if self._stopping or child is not shard.child:
            return
        used = sum(len(s.restarts) for s in (*self.shards, *self.backups))
        at_s = round(time.monotonic() - self._t0, 3)
        if not shard.address or used >= self.max_restarts:
            log.error(
                "parameter server shard %d (%s) exited with code %d and is not restarted "
                "(%d of job.max_restarts=%d restarts used): %s",
                shard.index,
                child.name,
                rc,
                used,
                self.max_restarts,
                child.log_tail(),
            )
            shard.restarts.append(self._restart_row(shard, rc, at_s, restarted=False))
            return
        log.warning(
            "parameter server shard %d (%s) exited with code %d: restarting it at %s from its newest "
            "snapshot or its backup's state (restart %d of %d): %s",
            shard.index,
            child.name,
            rc,
            shard.address,
            used + 1,
            self.max_restarts,
            child.log_tail(),
        )
        shard.restarts.append(self._restart_row(shard, rc, at_s, restarted=True))
        shard.child = self._spawn(shard, shard.address)

    @staticmethod
    def _restart_row(proc: _Proc, rc: int, at_s: float, *, restarted: bool) -> dict[str, Any]:
        role = "backup" if proc.backup else "primary"
        return {"shard": proc.index, "role": role, "exit_code": rc, "at_s": at_s, "restarted": restarted}

    def stop(self) -> None:
        """No more restarts; SIGTERM every shard (final snapshots), SIGKILL after 5 s."""
        self._stopping = True
        self.supervisor.stop("server", grace_s=5.0, terminate=True)

    # ------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        """The summary's shard fields (after ``stop``): restarts, updates applied/lost/acknowledged."""
        from flotilla.ps.snapshot import SnapshotError, read_snapshot, snapshot_path

        rows: list[dict[str, Any]] = []
        data: dict[str, Any] = {}
        for shard in self.shards:
            restarts = len(shard.restarts) + (len(self.backups[shard.index].restarts) if self.backups else 0)
            row: dict[str, Any] = {"shard": shard.index, "restarts": restarts}
            path = snapshot_path(self.snapshot_dir, shard.index, len(self.shards))
            try:
                meta = read_snapshot(path).meta if path.exists() else {}
            except SnapshotError as exc:
                log.warning("shard %d: final snapshot unreadable: %s", shard.index, exc)
                meta = {}
            row["updates_applied"] = int(meta["version"]) if "version" in meta else None
            row["updates_lost"] = int(meta.get("updates_lost", 0))
            if shard.index == 0 and "data_views" in meta:  # (ps/data_views.py)
                data = {
                    "views": meta["data_views"]["views"],
                    "dropped": meta.get("dropped", []),
                    "dropped_overflow": meta.get("dropped_overflow", 0),
                }
            rows.append(row)
        applied = [r["updates_applied"] for r in rows]
        lost = sum(r["updates_lost"] for r in rows)
        total_applied = sum(applied) if None not in applied else None
        return {
            "replication": self.replication,
            "shard_restarts": sorted(
                (r for s in (*self.shards, *self.backups) for r in s.restarts), key=lambda r: r["at_s"]
            ),
            "ps_shards": rows,
            "updates_lost": lost,
            "updates_applied": total_applied,
            "updates_acknowledged": None if total_applied is None else total_applied + lost,
            # which workers split each clock's data from which clock ([start, [worker ids]]), and
            # the slices no push used ([worker id, first clock, stop clock, why]); none: one view
            "data_views": data,
        }
