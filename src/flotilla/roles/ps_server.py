"""The parameter-server process role: build one shard (SPEC §1) from a run configuration and
serve it until told to stop.  No command-line parsing here: ``flotilla server``
(:mod:`flotilla.cli.ps_cmd`) parses the options and calls :func:`build_server` and
:func:`serve_until`.

The shard's rules come from the run configuration (``strategy: {kind: ps, ...}`` and
``job.optimizer``, packaged by its spec: :func:`flotilla.trainer.builders.ps_config_of`); its identity is
``shard_index`` of ``strategy.num_servers``.  With a snapshot directory a restarted server (same
shard index, shard count, worker count, chunk_bytes and directory) resumes from its last
snapshot; binding the same port lets workers reconnect by themselves.

Invariants: a server that fails to build closes its transport; :func:`serve_until` always closes
the server (pending pulls answered, final snapshot written) however it exits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flotilla.comm import shaping
from flotilla.core.errors import ConfigError
from flotilla.core.log import get_logger

if TYPE_CHECKING:  # the server imports torch; load it only when a server is built
    from flotilla.ps.server import PSServer

__all__ = ["ServerArgs", "build_server", "serve_until"]

log = get_logger("roles.ps_server")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerArgs:
    """What one shard process is told: its run configuration and identity."""

    config: Path
    shard_index: int
    secret_file: Path
    overrides: tuple[str, ...] = ()
    bind: str = "tcp://127.0.0.1:0"
    num_shards: int | None = None  # checked against strategy.num_servers
    num_workers: int | None = None  # default: the cluster's
    snapshot_dir: Path | None = None


def build_server(args: ServerArgs) -> PSServer:
    """The (not yet started) :class:`flotilla.ps.server.PSServer` of ``args``; ``ConfigError``
    if the configuration is not a PS job or disagrees with ``args``."""
    from flotilla.comm.auth import read_secret_file
    from flotilla.comm.msgplane import serve
    from flotilla.config import load_config
    from flotilla.core.threads import use_torch_threads
    from flotilla.ps.server import PSServer, SnapshotPolicy, shard_config_from
    from flotilla.trainer.builders import ps_config_of

    use_torch_threads()  # one intra-op thread, like the workers (core/threads.py)
    cfg = load_config(args.config, list(args.overrides))
    ps = ps_config_of(cfg)  # (ConfigError naming strategy.kind unless it is ps)
    if args.num_shards is not None and args.num_shards != ps.num_servers:
        raise ConfigError(
            f"--num-shards {args.num_shards} differs from strategy.num_servers {ps.num_servers}"
        )
    workers = args.num_workers if args.num_workers is not None else cfg.cluster.effective_num_workers()
    shard = shard_config_from(
        ps, num_workers=workers, shard_index=args.shard_index, data_key=cfg.data_fingerprint()
    )
    policy = SnapshotPolicy.of(ps, args.snapshot_dir) if args.snapshot_dir is not None else None
    if (links := cfg.cluster.link_shaping(f"ps-shard{args.shard_index}")) is not None:  # (links.emulate)
        shaping.install(links)
    transport = serve(read_secret_file(args.secret_file), args.bind, name=f"ps-shard{args.shard_index}")
    try:
        return PSServer(shard, transport, snapshots=policy)
    except BaseException:
        transport.close()
        raise


def serve_until(
    server: PSServer,
    stop: threading.Event,
    *,
    address_file: Path | None = None,
    announce: Callable[[str], None] = print,
) -> None:
    """Start ``server``, publish its address (``announce``, and atomically ``address_file``),
    serve until ``stop`` is set, then close it."""
    from flotilla.core.atomic_io import atomic_write_bytes

    server.start()
    try:
        if address_file is not None:
            atomic_write_bytes(address_file, (server.address + "\n").encode())
        announce(server.address)
        log.info(
            "ps shard %d/%d listening on %s%s",
            server.config.shard_index,
            server.config.num_shards,
            server.address,
            f" (resumed at version {server.store.version})" if server.restored_from else "",
        )
        while not stop.wait(1.0):
            pass
    finally:
        server.close()
