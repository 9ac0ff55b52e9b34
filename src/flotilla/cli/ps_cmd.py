"""``flotilla server``: run one parameter-server shard (SPEC §1) as its own process.

Parses the options and hands over to the process role :mod:`flotilla.roles.ps_server`.  Binds
``--bind`` (default ``tcp://127.0.0.1:0``, a free port) or, with ``--coordinator HOST:PORT``,
the local address that reaches the coordinator (``--host`` to choose one) at ``--port``; prints
its address as the first line of stdout (and writes it to ``--address-file`` atomically if
given), and serves until SIGTERM or
SIGINT, then answers pending pulls, writes a final snapshot (with ``--snapshot-dir``) and exits 0.
Configuration errors exit 2, other flotilla errors 1.

Registered in ``cli/main.py`` as ``app.command("server")(server_command)``; also runnable as
``python -m flotilla.cli.ps_cmd``.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.core.log import setup_logging
from flotilla.roles.ps_server import ServerArgs, build_server, serve_until

__all__ = ["server_command"]


def server_command(
    config: Path = typer.Argument(..., help="Run configuration (YAML) with strategy.kind: ps."),
    shard_index: int = typer.Option(..., "--shard-index", help="This shard's index in [0, S)."),
    secret_file: Path = typer.Option(..., "--secret-file", help="File holding the cluster secret."),
    bind: Optional[str] = typer.Option(
        None, "--bind", help="tcp://HOST:PORT (0 = any port); default 127.0.0.1, or see --coordinator."
    ),
    coordinator: Optional[str] = typer.Option(
        None,
        "--coordinator",
        help="HOST:PORT of the coordinator: bind on the address that reaches it (with --port).",
    ),
    port: int = typer.Option(0, "--port", help="The port to bind (0 = any), without --bind."),
    host: Optional[str] = typer.Option(None, "--host", help="The address to bind, without --bind."),
    num_shards: Optional[int] = typer.Option(
        None, "--num-shards", help="Checked against strategy.num_servers."
    ),
    num_workers: Optional[int] = typer.Option(
        None, "--num-workers", help="Workers expected (default: the cluster's)."
    ),
    snapshot_dir: Optional[Path] = typer.Option(
        None, "--snapshot-dir", help="Snapshot here; resume from it on start."
    ),
    address_file: Optional[Path] = typer.Option(
        None, "--address-file", help="Also write the bound address here."
    ),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Override a config value."),
    log_level: str = typer.Option("INFO", "--log-level"),
) -> None:
    """Run one parameter-server shard until SIGTERM/SIGINT."""
    setup_logging(f"server {shard_index}", log_level)
    try:
        bind = _bind_address(bind, coordinator, port, host)
    except FlotillaError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2 if isinstance(exc, ConfigError) else 1) from None
    args = ServerArgs(
        config=config,
        shard_index=shard_index,
        secret_file=secret_file,
        overrides=tuple(set_ or ()),
        bind=bind,
        num_shards=num_shards,
        num_workers=num_workers,
        snapshot_dir=snapshot_dir,
    )
    try:
        server = build_server(args)
    except FlotillaError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2 if isinstance(exc, ConfigError) else 1) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve_until(server, stop, address_file=address_file, announce=typer.echo)


def _bind_address(bind: str | None, coordinator: str | None, port: int, host: str | None) -> str:
    """``--bind`` as given; else ``--host``:``--port``, the address that reaches
    ``--coordinator`` (``comm/addresses``), or 127.0.0.1."""
    if bind is not None:
        if coordinator is not None or host is not None or port:
            raise ConfigError("--bind: give it alone (not with --coordinator, --host or --port)")
        return bind
    if coordinator is None:
        where = host or "127.0.0.1"
        return f"tcp://[{where}]:{port}" if ":" in where else f"tcp://{where}:{port}"
    from flotilla.comm.addresses import set_local_host
    from flotilla.comm.msgplane import bind_beside

    set_local_host(host)
    address = coordinator if "://" in coordinator else f"tcp://{coordinator}"
    return bind_beside(address, plane="parameter server", port=port)


if __name__ == "__main__":  # pragma: no cover - exercised by the multi-process tests
    typer.run(server_command)
