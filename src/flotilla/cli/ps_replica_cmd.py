"""``flotilla server-replica`` (or ``python -m flotilla.cli.ps_replica_cmd``): run one process of
a replicated parameter-server shard (``strategy.replication: 2``): ``--role backup``, or
``--role primary --backup ADDRESS``.
``flotilla run`` starts both for every shard (``launch/ps_shards.py``); the options are those of
``flotilla server`` (:mod:`flotilla.cli.ps_cmd`) plus the role.  Serves until SIGTERM or SIGINT;
configuration errors exit 2, other flotilla errors 1.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.core.log import setup_logging
from flotilla.roles.ps_replica import build_replica, serve_replica_until
from flotilla.roles.ps_server import ServerArgs

__all__ = ["replica_command"]


def replica_command(
    config: Path = typer.Argument(..., help="Run configuration (YAML) with strategy.kind: ps."),
    shard_index: int = typer.Option(..., "--shard-index", help="This shard's index in [0, S)."),
    role: str = typer.Option(..., "--role", help="primary or backup."),
    secret_file: Path = typer.Option(..., "--secret-file", help="File holding the cluster secret."),
    backup: Optional[str] = typer.Option(None, "--backup", help="The backup's address (--role primary)."),
    bind: str = typer.Option("tcp://127.0.0.1:0", "--bind", help="tcp://HOST:PORT (0 = any port)."),
    snapshot_dir: Optional[Path] = typer.Option(None, "--snapshot-dir", help="(primary) Snapshot here."),
    address_file: Optional[Path] = typer.Option(None, "--address-file", help="Write the address here."),
    log_level: str = typer.Option("INFO", "--log-level"),
) -> None:
    """Run one primary or backup of a replicated shard until SIGTERM/SIGINT."""
    setup_logging(f"server {shard_index} {role}", log_level)
    args = ServerArgs(
        config=config, shard_index=shard_index, secret_file=secret_file, bind=bind, snapshot_dir=snapshot_dir
    )
    try:
        server = build_replica(args, role=role, backup=backup)
    except FlotillaError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2 if isinstance(exc, ConfigError) else 1) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve_replica_until(server, stop, address_file=address_file, announce=typer.echo)


if __name__ == "__main__":  # pragma: no cover - exercised by the multi-process tests
    typer.run(replica_command)
