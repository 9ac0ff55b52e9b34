"""The replicated parameter-server process roles (``strategy.replication: 2``): a shard's
**primary** (:class:`flotilla.ps.replication_server.ReplicatedPSServer`, serving the workers and
acknowledging nothing its backup does not hold) and its **backup**
(:class:`flotilla.ps.replication_server.BackupServer`).  No command-line parsing here:
``python -m flotilla.cli.ps_replica_cmd`` parses the options and calls :func:`build_replica` and
:func:`serve_replica_until`.

Invariants: a role that fails to build closes its transport; :func:`serve_replica_until` always
closes the server however it exits (a primary answers its pending pulls and writes its final
snapshot, as ``roles/ps_server.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Union

from flotilla.comm import shaping
from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger
from flotilla.roles.ps_server import ServerArgs, serve_until

if TYPE_CHECKING:  # (torch: loaded only when a server is built)
    from flotilla.ps.replication_server import BackupServer, ReplicatedPSServer

    Replica = Union[ReplicatedPSServer, BackupServer]

__all__ = ["ROLES", "build_replica", "serve_replica_until"]

ROLES = ("primary", "backup")
log = get_logger("roles.ps_replica")


def build_replica(args: ServerArgs, *, role: str, backup: str | None = None) -> Replica:
    """The (not yet started) primary or backup of shard ``args.shard_index``."""
    from flotilla.comm.auth import read_secret_file
    from flotilla.comm.msgplane import serve
    from flotilla.config import load_config
    from flotilla.core.threads import use_torch_threads
    from flotilla.ps.replication_server import BackupServer, ReplicatedPSServer
    from flotilla.ps.server import SnapshotPolicy, shard_config_from
    from flotilla.trainer.builders import ps_config_of

    if role not in ROLES or (role == "primary") != (backup is not None):
        raise ConfigError("--role: primary (with --backup ADDRESS) or backup (without)")
    use_torch_threads()
    cfg = load_config(args.config, list(args.overrides))
    ps = ps_config_of(cfg)
    workers = args.num_workers if args.num_workers is not None else cfg.cluster.effective_num_workers()
    shard = shard_config_from(
        ps, num_workers=workers, shard_index=args.shard_index, data_key=cfg.data_fingerprint()
    )
    secret = read_secret_file(args.secret_file)
    links = cfg.cluster.link_shaping(f"ps-shard{args.shard_index}-{role}")  # (cluster.links.emulate)
    if links is not None:
        shaping.install(links)
    transport = serve(secret, args.bind, name=f"ps-shard{args.shard_index}-{role}")
    try:
        if backup is None:
            return BackupServer(shard, transport)
        policy = SnapshotPolicy.of(ps, args.snapshot_dir) if args.snapshot_dir is not None else None
        return ReplicatedPSServer(shard, transport, backup_address=backup, secret=secret, snapshots=policy)
    except BaseException:
        transport.close()
        raise


def serve_replica_until(
    server: Replica,
    stop: threading.Event,
    *,
    address_file: Path | None = None,
    announce: Callable[[str], None] = print,
) -> None:
    """Serve ``server`` until ``stop`` is set (a primary as ``roles/ps_server.serve_until``)."""
    from flotilla.core.atomic_io import atomic_write_bytes
    from flotilla.ps.replication_server import BackupServer

    if not isinstance(server, BackupServer):
        serve_until(server, stop, address_file=address_file, announce=announce)
        return
    server.start()
    try:
        if address_file is not None:
            atomic_write_bytes(address_file, (server.address + "\n").encode())
        announce(server.address)
        log.info("ps shard %d backup listening on %s", server.config.shard_index, server.address)
        while not stop.wait(1.0):
            pass
    finally:
        server.close()
