"""Address selection helpers (``comm/addresses.py``) and where a role started by a scheduler
finds its coordinator and name (``cli/scheduler_env.py``)."""

from __future__ import annotations

import pytest

from flotilla.cli.scheduler_env import DEFAULT_PORT, coordinator_from_env, first_host, name_from_env
from flotilla.comm import addresses
from flotilla.core.errors import ConfigError


def test_route_to_loopback_is_loopback_and_an_unresolvable_name_is_named():
    assert addresses.route_to("127.0.0.1") == "127.0.0.1"
    with pytest.raises(Exception, match="no-such-host.invalid"):
        addresses.route_to("no-such-host.invalid")


def test_an_explicit_host_wins_and_a_foreign_one_is_refused_naming_it():
    try:
        addresses.set_local_host("127.0.0.1")
        assert addresses.local_toward("192.0.2.77") == "127.0.0.1"
        with pytest.raises(ConfigError, match="203.0.113.9.*not an address of this machine"):
            addresses.set_local_host("203.0.113.9")
    finally:
        addresses.set_local_host(None)
    assert addresses.local_host() is None


def test_split_host_port():
    assert addresses.split_host_port("tcp://10.0.0.1:5555") == ("10.0.0.1", 5555)
    assert addresses.split_host_port("[fd00::2]:7") == ("fd00::2", 7)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        addresses.split_host_port("10.0.0.1")


def test_the_peer_a_gloo_connect_error_names():
    err = (
        "Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: "
        "SO_ERROR: Connection refused, remote=[127.0.0.1]:30618$1"
    )
    assert addresses.unreachable_peer(err) == "127.0.0.1:30618 (connection refused)"
    assert addresses.unreachable_peer("Connect timeout [none]") is None
    with pytest.raises(
        addresses.PeerUnreachable, match=r"cannot reach peer 127.0.0.1:30618 .*advertised 10.0.0.2"
    ):
        addresses.check_first_group(err, own="10.0.0.2")
    addresses.check_first_group("Connect timeout [none]")  # names no peer: the loop recovers as before


def test_interface_of_loopback():
    assert addresses.interface_of("127.0.0.1") == "lo"
    assert addresses.interface_of("::1") is None


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node07", "node07"),
        ("node[03-05,9],gpu1", "node03"),
        ("gpu1,node[1-2]", "gpu1"),
        ("a[001-004]-ib", "a001-ib"),
    ],
)
def test_first_host_of_a_slurm_host_list(nodelist, first):
    assert first_host(nodelist) == first


def test_coordinator_precedence():
    slurm = {"SLURM_JOB_NODELIST": "n[4-5]", "SLURM_PROCID": "1"}
    assert coordinator_from_env(slurm) == (f"n4:{DEFAULT_PORT}", "SLURM_JOB_NODELIST (first host)")
    torchrun = {
        **slurm,
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "29500",
        "FLOTILLA_COORDINATOR_PORT": "7000",
    }
    assert coordinator_from_env(torchrun)[0] == "10.1.2.3:7000"  # MASTER_PORT is torchrun's own
    assert coordinator_from_env({**torchrun, "FLOTILLA_COORDINATOR": "coord:1"})[0] == "coord:1"
    assert coordinator_from_env({}) is None
    with pytest.raises(ConfigError, match="FLOTILLA_COORDINATOR_PORT.*1..65535"):
        coordinator_from_env({"MASTER_ADDR": "h", "FLOTILLA_COORDINATOR_PORT": "x"})


def test_name_precedence():
    env = {"SLURM_PROCID": "3", "JOB_COMPLETION_INDEX": "2", "RANK": "1"}
    assert name_from_env(env)[0] == "w1"
    assert name_from_env({k: v for k, v in env.items() if k != "RANK"})[0] == "w2"
    assert name_from_env({"SLURM_PROCID": "3"}) == ("w3", "SLURM_PROCID (SLURM)")
    assert name_from_env({**env, "FLOTILLA_NAME": "big"})[0] == "big"
    assert name_from_env({}) is None
    with pytest.raises(ConfigError, match="RANK: expected a non-negative integer"):
        name_from_env({"RANK": "-1"})


def test_why_a_member_was_lost():
    from flotilla.cluster import rendezvous_events as ev
    from flotilla.roles.members_lost import why_lost

    assert "found it gone" in why_lost(ev.Suspected(0, (1,), 0.5, 1.0, closed=True), suspected=True)
    assert "found it silent" in why_lost(ev.Suspected(0, (1,), 0.5, 1.0))
    assert "exited with code 9" in why_lost(ev.DeathNoticed(1, 1.0), notice="process exited with code 9")
    assert "did not report" in why_lost(ev.Polled(0, 1, True, 1.0), suspected=True)
    assert "no heartbeat for 10 s" in why_lost(ev.Tick(1.0), heartbeat_timeout_s=10.0)


def test_bind_beside_takes_the_route_and_the_given_port_never_the_remote_one():
    from flotilla.comm.msgplane import bind_beside

    assert bind_beside("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:0"
    assert bind_beside("tcp://127.0.0.1:5555", port=6001) == "tcp://127.0.0.1:6001"


def test_an_explicit_host_name_is_resolved_to_its_address():
    try:
        addresses.set_local_host("localhost")
        assert addresses.local_host() in ("127.0.0.1", "::1")
        with pytest.raises(ConfigError, match="cannot resolve 'no-such-host.invalid'"):
            addresses.set_local_host("no-such-host.invalid")
    finally:
        addresses.set_local_host(None)
