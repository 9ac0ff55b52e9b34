"""The primary's replication log (``ps/replication.ReplicationLog``): replies held until the
backup acknowledged every op before them, batches in order, a rewind only while the log is
retained; and ``strategy.replication`` validated (1 or 2, the error naming the field)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.config import load_config
from flotilla.core.errors import ConfigError
from flotilla.ps.replication import MAX_BATCH_OPS, ReplicationLog

ROOT = Path(__file__).resolve().parents[2]


def test_a_reply_is_held_until_the_backup_acknowledged_every_op_before_it() -> None:
    log = ReplicationLog()
    released: list[str] = []
    log.when_acked(0, lambda: released.append("nothing pending"))  # at once
    first = log.append("ps.push", {"clock": 0}, [torch.ones(2)], False)
    second = log.append("ps.push", {"clock": 1}, [], False)
    log.when_acked(first, lambda: released.append("first"))
    log.when_acked(second, lambda: released.append("second"))
    assert released == ["nothing pending"]
    assert [o.seq for o in log.next_batch(0.0)] == [1, 2]
    log.ack(first)
    assert released == ["nothing pending", "first"]
    assert [o.seq for o in log.next_batch(0.0)] == [2]
    log.ack(99)  # (never past what was appended)
    assert released[-1] == "second" and log.acked == 2 and log.next_batch(0.0) == []


def test_batches_are_bounded_and_in_order() -> None:
    log = ReplicationLog()
    for i in range(MAX_BATCH_OPS + 5):
        log.append("ps.hello", {"clock": i}, [], False)
    batch = log.next_batch(0.0)
    assert [o.seq for o in batch] == list(range(1, MAX_BATCH_OPS + 1))
    log.ack(batch[-1].seq)
    assert [o.seq for o in log.next_batch(0.0)] == list(range(MAX_BATCH_OPS + 1, MAX_BATCH_OPS + 6))


def test_rewind_replays_from_the_start_only_while_the_log_is_retained() -> None:
    log = ReplicationLog()
    log.append("ps.hello", {}, [], False)
    log.ack(1)
    log.rewind()  # a never-seeded primary re-fills a pristine backup from seq 1
    assert [o.seq for o in log.next_batch(0.0)] == [1]
    log.retain = False
    log.ack(1)
    with pytest.raises(RuntimeError):
        log.rewind()


@pytest.mark.parametrize("value", ["0", "3", "two"])
def test_replication_is_1_or_2(value: str) -> None:
    with pytest.raises(ConfigError, match=r"strategy\.replication: .*allowed: 1, 2"):
        load_config(ROOT / "examples" / "ps_ssp.yaml", [f"strategy.replication={value}"])
    assert load_config(ROOT / "examples" / "ps_ssp.yaml").strategy.replication == 1
    assert (
        load_config(ROOT / "examples" / "ps_ssp.yaml", ["strategy.replication=2"]).strategy.replication == 2
    )
