"""The link fits behind ``flotilla calibrate`` (``cluster/comm_cost.py``)."""

from __future__ import annotations

import pytest

from flotilla.cluster.comm_cost import (
    fit_allreduce_link,
    fit_software_cost,
    fit_transfer_link,
    message_s,
    ps_round_s,
    ring_allreduce_s,
    shard_service_s,
    transfer_s,
)
from flotilla.cluster.spec import Link

SIZES = [4096.0, 65536.0, 1 << 20, 16 << 20]


LINKS = [Link(bandwidth_gbps=8.0, latency_s=5e-5), Link(bandwidth_gbps=40.0, latency_s=0.0)]


@pytest.mark.parametrize("link", LINKS)
def test_a_transfer_fit_recovers_the_link(link: Link) -> None:
    fitted = fit_transfer_link([(b, transfer_s(b, link)) for b in SIZES])
    assert fitted.bandwidth_gbps == pytest.approx(link.bandwidth_gbps, rel=1e-6)
    assert fitted.latency_s == pytest.approx(link.latency_s, abs=1e-12)


@pytest.mark.parametrize("members", [2, 3, 8])
def test_an_allreduce_fit_recovers_the_link_and_predicts_the_samples(members: int) -> None:
    link = Link(bandwidth_gbps=12.5, latency_s=2e-5)
    samples = [(b, ring_allreduce_s(members, b, link)) for b in SIZES]
    fitted = fit_allreduce_link(members, samples)
    assert fitted.bandwidth_gbps == pytest.approx(12.5, rel=1e-6)
    assert fitted.latency_s == pytest.approx(2e-5, rel=1e-6)
    for b, t in samples:
        assert ring_allreduce_s(members, b, fitted) == pytest.approx(t, rel=1e-6)


def test_noise_below_zero_latency_is_clamped_through_the_origin() -> None:
    samples = [(1000.0, 0.9e-6), (2000.0, 2.1e-6), (4000.0, 4.2e-6)]  # intercept slightly < 0
    fitted = fit_transfer_link(samples)
    assert fitted.latency_s == 0.0 and fitted.bandwidth_gbps > 0


@pytest.mark.parametrize(
    "samples",
    [[(1000.0, 1e-3)], [(1000.0, 1e-3), (1000.0, 2e-3)], [(1000.0, 2e-3), (2000.0, 1e-3)]],
)
def test_samples_that_do_not_determine_a_link_are_refused(samples: list[tuple[float, float]]) -> None:
    with pytest.raises(ValueError):
        fit_transfer_link(samples)


def test_an_allreduce_of_one_member_has_no_link() -> None:
    with pytest.raises(ValueError, match="num_members must be >= 2"):
        fit_allreduce_link(1, [(1.0, 1.0), (2.0, 2.0)])


def test_the_fit_weighs_relative_error_so_a_noisy_large_size_keeps_the_fixed_cost() -> None:
    """A 16-MiB sample 30 % slow (noise that is common there) must not wipe out the 100-us fixed
    cost the small sizes show: the fit is in relative error."""
    link = Link(bandwidth_gbps=30.0, latency_s=1e-4)
    samples = [(b, transfer_s(b, link) * (1.3 if b == SIZES[-1] else 1.0)) for b in SIZES]
    fitted = fit_transfer_link(samples)
    assert fitted.latency_s == pytest.approx(1e-4, rel=0.1), fitted
    for b, t in samples[:2]:  # (an unweighted fit: 70 us, outside the 10 %)
        assert transfer_s(b, fitted) == pytest.approx(t, rel=0.1)


def test_the_message_planes_own_cost_is_what_its_messages_take_beyond_the_network() -> None:
    network = Link(bandwidth_gbps=32.0, latency_s=4e-5)
    software = Link(bandwidth_gbps=30.0, latency_s=1e-4)
    net = [(b, transfer_s(b, network)) for b in SIZES]
    total = [(b, message_s(b, network, software)) for b in SIZES]
    fitted = fit_software_cost(total, net)
    assert fitted.bandwidth_gbps == pytest.approx(30.0, rel=1e-6)
    assert fitted.latency_s == pytest.approx(1e-4, rel=1e-6)
    for b, t in total:  # (the simulator's message: the network's transfer plus the fitted cost)
        assert message_s(b, network, fitted) == pytest.approx(t, rel=1e-6)
    assert message_s(1000.0, network) == transfer_s(1000.0, network)  # (no cost given: none added)


def test_a_software_cost_that_does_not_grow_with_the_bytes_is_a_fixed_one() -> None:
    net = [(b, transfer_s(b, Link(bandwidth_gbps=32.0, latency_s=4e-5))) for b in SIZES]
    total = [(b, t + 2e-4) for b, t in net]
    fitted = fit_software_cost(total, net)
    assert fitted.latency_s == pytest.approx(2e-4, rel=1e-6)
    assert transfer_s(16 << 20, fitted) == pytest.approx(2e-4, rel=1e-3)  # (no per-byte cost)
    below = [(b, t * 0.9) for b, t in net]  # (faster than the network: noise, no cost)
    assert fit_software_cost(below, net).latency_s == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="the same two or more sizes"):
        fit_software_cost(total[:2], net)


def test_ps_costs_pay_the_message_planes_own_cost() -> None:
    link, software = Link(bandwidth_gbps=10.0, latency_s=1e-5), Link(bandwidth_gbps=5.0, latency_s=1e-4)
    b = 1e6
    assert ps_round_s(b, link, software) == pytest.approx(2 * (transfer_s(b, link) + transfer_s(b, software)))
    assert shard_service_s(b, 2, link, software) == pytest.approx(
        shard_service_s(b, 2, link) + (b / 2) / (5.0 * 1e9 / 8)
    )


CALIBRATED = [4096.0, 65536.0, 1 << 20, 4 << 20, 16 << 20]  # (flotilla calibrate's default sizes)


@pytest.mark.parametrize("off", range(len(CALIBRATED)))
def test_one_size_measured_far_off_does_not_move_the_message_planes_cost(off: int) -> None:
    """Each difference comes from two medians taken apart: one of calibrate's five sizes whose
    message-plane time came out *below* the network's (clamped to 0) must not erase the fixed cost
    or the rate (a least-squares fit did: 0 us, or 340,000 Gbit/s)."""
    network = Link(bandwidth_gbps=32.0, latency_s=4e-5)
    software = Link(bandwidth_gbps=30.7, latency_s=1.02e-4)
    net = [(b, transfer_s(b, network)) for b in CALIBRATED]
    total = [(b, message_s(b, network, software)) for b in CALIBRATED]
    total[off] = (total[off][0], net[off][1] * 0.99)
    fitted = fit_software_cost(total, net)
    assert fitted.latency_s == pytest.approx(1.02e-4, rel=1e-6)
    assert fitted.bandwidth_gbps == pytest.approx(30.7, rel=1e-6)
