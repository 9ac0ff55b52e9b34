"""A virtual worker's stages commit its clock without coordinating among themselves
(``ps.vpull``, ``VWPartClient.vote_pull``; ``ps/two_phase.py`` "Parts"): each stage, once its part
is staged on every shard, votes to commit it with its pull of the next clock; a shard applies the
clock at the last vote and answers every part's pull once the clock is applied and the gate
allows it.  Two stages' pulls wait side by side (they no longer supersede each other); a vote for
a part not staged, or with a wrong count, is refused and changes nothing; a retried vote of an
applied clock is acknowledged."""

from __future__ import annotations

import threading

import pytest
import torch

from flotilla.core.errors import RemoteError
from flotilla.ps.consistency import WSP

from .test_ps_server import client, ones_like, servers, shard_configs, values
from .test_ps_virtual_worker import OWN, VALS, VW, _vw_clocks, vw_parts

pytestmark = pytest.mark.timeout(60)


def _own(i: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in values(**VALS).items() if k in OWN[i]}


def _vote_in_thread(part, clock: int, k: float, out: dict, errors: list) -> threading.Thread:
    def run() -> None:
        try:
            part.vote_pull(ones_like(values(**VALS), k), clock, out)
        except BaseException as exc:  # (the test reads it)
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_the_last_vote_applies_the_clock_and_both_parts_pulls_are_answered() -> None:
    with servers(shard_configs(2, 2, WSP(s_local=0, clock_distance=0))) as srvs:
        w0 = client(srvs, 0, values(**VALS))  # seeds zeros
        parts = vw_parts(srvs)
        w0.push(ones_like(values(**VALS)), 0)  # worker 0 is at clock 1: the gate waits on the VW
        assert parts[1].stage(ones_like(values(**VALS), 3.0), 0) is False
        out1, errors = _own(1), []
        t1 = _vote_in_thread(parts[1], 0, 3.0, out1, errors)
        # stage 1 voted and waits: nothing applied (one part of two staged, one vote of two)
        assert parts[0].stage(ones_like(values(**VALS), 2.0), 0) is True
        assert _vw_clocks(srvs) == [0, 0] and t1.is_alive(), errors
        out0 = _own(0)
        parts[0].vote_pull(ones_like(values(**VALS), 2.0), 0, out0)  # the last vote: applied
        t1.join(20)
        assert not t1.is_alive() and not errors
        assert _vw_clocks(srvs) == [1, 1] and parts[0].clocks == parts[1].clocks == [1, 1]
        assert torch.equal(out0["a"], torch.full((600,), 3.0))  # 1 (worker 0) + 2 (stage 0)
        assert torch.equal(out1["b"], torch.full((10,), 4.0))  # 1 + 3 (stage 1)
        assert min(parts[0].read_c_global) == 1
        before = [srv.store.version for srv in srvs]
        parts[1].vote_pull(ones_like(values(**VALS), 3.0), 0, out1)  # a retry: acknowledged only
        assert [srv.store.version for srv in srvs] == before and _vw_clocks(srvs) == [1, 1]
        for c in (w0, *parts):
            c.close()


def test_two_parts_pulls_wait_side_by_side_at_the_gate() -> None:
    """Both stages voted (the VW's clock 0 applied) and wait for worker 0 at the WSP gate (D=0):
    neither pull supersedes the other; worker 0's push answers both."""
    with servers(shard_configs(2, 2, WSP(s_local=0, clock_distance=0))) as srvs:
        w0 = client(srvs, 0, values(**VALS))
        parts = vw_parts(srvs)
        outs, errors = [_own(0), _own(1)], []
        for p, k in zip(parts, (2.0, 3.0)):
            p.stage(ones_like(values(**VALS), k), 0)
        threads = [_vote_in_thread(p, 0, k, o, errors) for p, k, o in zip(parts, (2.0, 3.0), outs)]
        assert all(t.is_alive() for t in threads)
        w0.push(ones_like(values(**VALS)), 0)
        for t in threads:
            t.join(20)
        assert not errors and not any(t.is_alive() for t in threads)
        assert torch.equal(outs[0]["a"], torch.full((600,), 3.0))
        assert torch.equal(outs[1]["c"], torch.full((3, 4), 4.0))
        for c in (w0, *parts):
            c.close()


@pytest.mark.parametrize(
    ("case", "code"),
    [("not staged", "not_staged"), ("wrong count", "bad_part"), ("wrong clock", "bad_clock")],
)
def test_a_bad_vote_is_refused_and_changes_nothing(case: str, code: str) -> None:
    with servers(shard_configs(1, 2, WSP(s_local=0, clock_distance=0))) as srvs:
        w0 = client(srvs, 0, values(**VALS))
        parts = vw_parts(srvs)
        if case != "not staged":
            parts[0].stage(ones_like(values(**VALS), 2.0), 0)
        before = (srvs[0].store.version, _vw_clocks(srvs), srvs[0].store.staged.get(VW))
        if case == "wrong count":
            parts[0].parts = 3
        clock = 1 if case == "wrong clock" else 0
        with pytest.raises(RemoteError) as err:
            parts[0]._vpull(0, _own(0), clock, parts[0]._deadline())
        assert err.value.code == code
        assert (srvs[0].store.version, _vw_clocks(srvs), srvs[0].store.staged.get(VW)) == before
        for c in (w0, *parts):
            c.close()
