"""``flotilla server``: run one parameter-server shard (SPEC §1) as its own process.

The shard's rules come from the run configuration (``strategy: {kind: ps, ...}`` and
``job.optimizer``); its identity is ``--shard-index`` of ``strategy.num_servers``.  It binds
``--bind`` (default ``tcp://127.0.0.1:0``, a free port), prints its address as the first line of
stdout (and writes it to ``--address-file`` atomically if given), and serves until SIGTERM or
SIGINT, then answers pending pulls, writes a final snapshot (with ``--snapshot-dir``) and exits 0.

With ``--snapshot-dir`` a restarted server (same shard index, shard count, worker count,
chunk_bytes and directory) resumes from its last snapshot; pass the same ``--bind`` port so
workers reconnect by themselves.  Registered in ``cli/main.py`` as
``app.command("server")(server_command)``; also runnable as ``python -m flotilla.roles.ps_server``.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from flotilla.core.errors import ConfigError, FlotillaError
from flotilla.core.log import get_logger, setup_logging

__all__ = ["server_command"]

log = get_logger("cli.server")


def _build(
    config: Path,
    overrides: list[str],
    shard_index: int,
    num_shards: Optional[int],
    num_workers: Optional[int],
    snapshot_dir: Optional[Path],
    secret_file: Path,
    bind: str,
):
    from flotilla.comm.auth import read_secret_file
    from flotilla.comm.msgplane import serve
    from flotilla.config import load_config
    from flotilla.core.threads import use_torch_threads
    from flotilla.ps.server import PSServer, SnapshotPolicy, shard_config_from

    use_torch_threads()  # one intra-op thread, like the workers (core/threads.py)
    cfg = load_config(config, overrides)
    strategy = cfg.strategy
    if strategy.kind != "ps":
        raise ConfigError(f"strategy.kind must be 'ps' to run a server (got {strategy.kind!r})")
    if num_shards is not None and num_shards != strategy.num_servers:
        raise ConfigError(
            f"--num-shards {num_shards} differs from strategy.num_servers {strategy.num_servers}"
        )
    workers = num_workers if num_workers is not None else cfg.cluster.effective_num_workers()
    shard = shard_config_from(strategy, cfg.job.optimizer, num_workers=workers, shard_index=shard_index)
    policy = None
    if snapshot_dir is not None:
        policy = SnapshotPolicy(
            directory=snapshot_dir,
            every_versions=strategy.snapshot_every_versions,
            every_s=strategy.snapshot_every_s,
        )
    transport = serve(read_secret_file(secret_file), bind, name=f"ps-shard{shard_index}")
    try:
        return PSServer(shard, transport, snapshots=policy)
    except BaseException:
        transport.close()
        raise


def server_command(
    config: Path = typer.Argument(..., help="Run configuration (YAML) with strategy.kind: ps."),
    shard_index: int = typer.Option(..., "--shard-index", help="This shard's index in [0, S)."),
    secret_file: Path = typer.Option(..., "--secret-file", help="File holding the cluster secret."),
    bind: str = typer.Option("tcp://127.0.0.1:0", "--bind", help="tcp://HOST:PORT (0 = any port)."),
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
    from flotilla.core.atomic_io import atomic_write_bytes

    setup_logging(f"server {shard_index}", log_level)
    try:
        server = _build(
            config, set_ or [], shard_index, num_shards, num_workers, snapshot_dir, secret_file, bind
        )
    except FlotillaError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2 if isinstance(exc, ConfigError) else 1) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    try:
        if address_file is not None:
            atomic_write_bytes(address_file, (server.address + "\n").encode())
        typer.echo(server.address)
        log.info(
            "ps shard %d/%d listening on %s%s",
            shard_index,
            server.config.num_shards,
            server.address,
            f" (resumed at version {server.store.version})" if server.restored_from else "",
        )
        while not stop.wait(1.0):
            pass
    finally:
        server.close()


if __name__ == "__main__":  # pragma: no cover - exercised by the multi-process tests
    typer.run(server_command)
