"""Chain replication of a PS shard (``ps/replication*.py``) over the in-process transport: the
backup replays the primary's accepted requests into the same state (digest for digest, the same
as an unreplicated shard fed the same pushes); a primary that crashes (no final snapshot) is
replaced by one that recovers from its backup with every acknowledged update; a backup that is
replaced is re-filled by the primary; an unclassified operation is refused."""

from __future__ import annotations

import contextlib

import pytest
import torch

from flotilla.comm import auth
from flotilla.comm.msgplane import connect, serve
from flotilla.core.errors import ConfigError
from flotilla.ps.client import ClientOptions, PSClient, keys_of
from flotilla.ps.consistency import SSP
from flotilla.ps.replication import GatedTransport, ReplicationLog
from flotilla.ps.replication_server import BackupServer, ReplicatedPSServer
from flotilla.ps.server import PSServer
from flotilla.ps.store import ServerSGD, ShardConfig

SECRET = auth.generate_secret()
pytestmark = pytest.mark.timeout(90)
FAST = ClientOptions(pull_timeout_s=20.0, attempt_timeout_s=2.0)
CFG = ShardConfig(
    shard_index=0,
    num_shards=1,
    num_workers=2,
    consistency=SSP(staleness=1),
    update=ServerSGD(lr=0.1, momentum=0.9),
    chunk_bytes=256,
)
VALUES = {"w": torch.zeros(100), "b": torch.zeros(7)}


def primary(name: str, backup: str) -> ReplicatedPSServer:
    return ReplicatedPSServer(
        CFG, serve(SECRET, f"mem://{name}"), backup_address=backup, secret=SECRET
    ).start()


def backup(name: str) -> BackupServer:
    return BackupServer(CFG, serve(SECRET, f"mem://{name}")).start()


def clients(address: str) -> list[PSClient]:
    out = [
        PSClient([address], SECRET, worker_id=w, keys=keys_of(VALUES), chunk_bytes=256, options=FAST)
        for w in (0, 1)
    ]
    for c in out:
        c.hello(0)
    out[0].initialize(VALUES)
    return out


def train(cs: list[PSClient], clocks: range) -> None:
    """Both workers, clock by clock: push a gradient, pull the next weights."""
    for clock in clocks:
        for w, c in enumerate(cs):
            grads = {k: torch.full_like(v, 0.01 * (clock + 1) * (w + 1)) for k, v in VALUES.items()}
            c.push(grads, clock)
        for c in cs:
            c.pull(clock + 1, {k: torch.zeros_like(v) for k, v in VALUES.items()})


def backup_stats(address: str) -> dict:
    with connect(address, SECRET, sender="test") as conn:
        return conn.call("ps.replica_stats", {}, timeout_s=10).body


def test_the_backup_replays_into_the_same_state_as_an_unreplicated_shard() -> None:
    with contextlib.ExitStack() as stack:
        b = backup("bk-same")
        stack.callback(b.close)
        p = primary("pr-same", b.address)
        stack.callback(p.close)
        plain = PSServer(CFG, serve(SECRET, "mem://plain-same")).start()
        stack.callback(plain.close)
        cs, ref = clients(p.address), clients(plain.address)
        train(cs, range(12))
        train(ref, range(12))
        stats = backup_stats(b.address)
        assert stats["version"] == p.store.version == 24  # every push acknowledged is on the backup
        assert stats["digest"] == p.store.digest() == plain.store.digest()
        for c in (*cs, *ref):
            c.close()


def test_a_crashed_primary_recovers_every_acknowledged_update_from_its_backup() -> None:
    with contextlib.ExitStack() as stack:
        b = backup("bk-crash")
        stack.callback(b.close)
        p = primary("pr-crash", b.address)
        cs = clients(p.address)
        train(cs, range(10))
        acked = p.store.version
        p.close(final_snapshot=False)  # a crash: nothing written, the process' state gone
        p2 = primary("pr-crash", b.address)  # the restart, at the same address
        stack.callback(p2.close)
        assert p2.store.version == acked == 20 and p2.store.updates_lost == 0
        train(cs, range(10, 15))  # the workers re-say hello (new incarnation) and go on
        assert p2.store.version == 30 and p2.store.updates_lost == 0
        assert backup_stats(b.address)["digest"] == p2.store.digest()
        for c in cs:
            c.close()


def test_a_replaced_backup_is_refilled_by_the_primary() -> None:
    with contextlib.ExitStack() as stack:
        b = backup("bk-refill")
        p = primary("pr-refill", b.address)
        stack.callback(p.close)
        cs = clients(p.address)
        train(cs, range(5))
        b.close()
        b2 = backup("bk-refill")  # empty, at the same address
        stack.callback(b2.close)
        train(cs, range(5, 8))  # replies wait until the new backup holds the state
        stats = backup_stats(b2.address)
        assert stats["version"] == p.store.version == 16 and stats["digest"] == p.store.digest()
        for c in cs:
            c.close()


def test_an_unclassified_operation_is_refused_when_the_server_is_built() -> None:
    gate = GatedTransport(serve(SECRET, "mem://unclassified"), ReplicationLog())
    try:
        with pytest.raises(ConfigError, match="ps.frobnicate"):
            gate.register("ps.frobnicate", lambda req: {}, {})
    finally:
        gate.close()
