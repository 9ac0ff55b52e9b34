"""The link fits behind ``flotilla calibrate`` (``cluster/comm_cost.py``)."""

from __future__ import annotations

import pytest

from flotilla.cluster.comm_cost import fit_allreduce_link, fit_transfer_link, ring_allreduce_s, transfer_s
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
