"""Host staging of PS pushes and pulls (``sync/ps_staging.py``) without a GPU: the CPU
pass-through is today's path (the same tensors, no copy, no hook), and the bookkeeping of the
staged path -- slots allocated once with the parameters' shapes and dtypes, reused, the one in
flight never written, hooks copying final gradients only, copies waited for before a push and
before a pull buffer is reused -- run with :class:`PlainCopies` (plain copies, the same code)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flotilla.core.errors import ConfigError
from flotilla.sync.ps_staging import HostStaging, PlainCopies, copies_for

pytestmark = pytest.mark.timeout(30)


class Net(nn.Module):
    """Two float32 layers and a float64 parameter; ``extra`` is used only when asked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.ones(2, dtype=torch.float64))

    def forward(self, x: torch.Tensor, extra: bool = True) -> torch.Tensor:
        h = self.a(x)
        out = self.b(torch.tanh(h)) if extra else h[:, :2]
        return out * self.scale.float()


def params_of(m: nn.Module) -> dict[str, nn.Parameter]:
    return dict(m.named_parameters())


def backward(m: Net, *, extra: bool = True, seed: int = 1) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    m(x, extra).sum().backward()


def grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in m.named_parameters()}


class Recording(PlainCopies):
    """Plain copies that log what happened, to check the order of copies and waits."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append("d2h")
        super().to_host(dst, src)

    def host_fence(self):
        log = self.log

        class F:
            def wait(self) -> None:
                log.append("wait d2h")

        return F()

    def device_fence(self):
        log = self.log

        class F:
            def wait(self) -> None:
                log.append("wait h2d")

        return F()


# ----------------------------------------------------------------------------- pass-through
def test_on_the_cpu_staging_is_a_pass_through() -> None:
    m = Net()
    backward(m)
    assert copies_for(params_of(m)) is None
    st = HostStaging(params_of(m), busy=lambda: False)
    assert not st.active and st._hooks == []
    st.arm()
    update = grads(m)
    assert st.to_host(update) is update  # the same tensors: the codec's path, bit for bit
    target = st.target()
    assert {n: t.data_ptr() for n, t in target.items()} == {n: p.data_ptr() for n, p in m.named_parameters()}
    st.load()  # nothing to copy: the pull wrote into the parameters
    assert st.slots == []


def test_the_pass_through_read_ahead_target_is_device_tensors_copied_in() -> None:
    m = Net()
    st = HostStaging(params_of(m), busy=lambda: False, copies=None)
    ahead = st.target("ahead")
    assert all(ahead[n].data_ptr() != p.data_ptr() for n, p in m.named_parameters())
    for t in ahead.values():
        t.fill_(0.5)
    st.load("ahead")
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in m.parameters())
    assert st.target("ahead")["a.weight"].data_ptr() == ahead["a.weight"].data_ptr()


# ----------------------------------------------------------------------------- slots
def test_slots_have_the_parameters_shapes_and_dtypes_and_are_reused() -> None:
    m = Net()
    st = HostStaging(params_of(m), busy=lambda: False, copies=PlainCopies(), hooks=False)
    ptrs = set()
    for seed in range(3):
        m.zero_grad(set_to_none=True)
        st.arm()
        backward(m, seed=seed)
        host = st.to_host(grads(m))
        assert all(torch.equal(host[n], g) for n, g in grads(m).items())
        assert all(host[n].device.type == "cpu" for n in host)
        ptrs.add(tuple(t.data_ptr() for t in host.values()))
    assert len(st.slots) == 1 and len(ptrs) == 1  # a synchronous push: one slot, reused
    slot = st.slots[0]
    assert {n: (t.shape, t.dtype) for n, t in slot.items()} == {
        n: (p.shape, p.dtype) for n, p in m.named_parameters()
    }
    assert slot["scale"].dtype == torch.float64


def test_the_slot_in_flight_is_never_written_and_two_slots_alternate() -> None:
    m = Net()
    busy = [False]
    st = HostStaging(params_of(m), busy=lambda: busy[0], copies=PlainCopies(), hooks=False)
    handed = []
    for step in range(5):
        st.arm()
        backward(m, seed=step)
        before = [{n: t.clone() for n, t in s.items()} for s in st.slots]
        in_flight = st.in_flight()
        host = st.to_host(grads(m))
        slot = next(
            i for i, s in enumerate(st.slots) if s["a.weight"].data_ptr() == host["a.weight"].data_ptr()
        )
        assert slot != in_flight
        if in_flight is not None:  # the slot a push may still read is unchanged
            assert all(torch.equal(before[in_flight][n], t) for n, t in st.slots[in_flight].items())
        busy[0] = True  # an asynchronous push now holds it
        assert st.in_flight() == slot
        handed.append(slot)
        m.zero_grad(set_to_none=True)
    assert handed == [0, 1, 0, 1, 0] and len(st.slots) == 2
    busy[0] = False  # the client collected the acknowledgement: nothing is in flight
    assert st.in_flight() is None


def test_an_update_unlike_the_parameters_is_refused() -> None:
    m = Net()
    st = HostStaging(params_of(m), busy=lambda: False, copies=PlainCopies(), hooks=False)
    bad = {n: p.detach().clone() for n, p in m.named_parameters()}
    bad["scale"] = bad["scale"].float()
    with pytest.raises(ConfigError, match="'scale' is torch.float32"):
        st.to_host(bad)
    with pytest.raises(ConfigError, match="no such parameter"):
        st.to_host({"nope": torch.zeros(2)})


def test_a_push_waits_for_every_copy_into_its_slot() -> None:
    m = Net()
    copies = Recording()
    st = HostStaging(params_of(m), busy=lambda: False, copies=copies)  # (no hooks by default)
    st.arm()
    backward(m)
    assert copies.log == [] and st._hooks == []
    st.to_host(grads(m))
    assert copies.log == ["d2h"] * 5 + ["wait d2h"]


# ----------------------------------------------------------------------------- hooks
def test_hooks_copy_each_gradient_as_backward_finishes_it() -> None:
    m = Net()
    copies = Recording()
    st = HostStaging(params_of(m), busy=lambda: False, copies=copies, hooks=True)
    st.arm()
    backward(m)
    assert copies.log == ["d2h"] * 5  # during backward, one per parameter
    assert all(torch.equal(st.slots[0][n], g) for n, g in grads(m).items())
    host = st.to_host(grads(m))
    assert copies.log == ["d2h"] * 5 + ["wait d2h"]  # nothing copied twice
    assert all(torch.equal(host[n], g) for n, g in grads(m).items())
    st.close()
    assert st._hooks == []


def test_accumulation_copies_only_the_final_gradients() -> None:
    """``job.accumulate``: earlier passes are deferred; a parameter unused in the last pass, and a
    gradient changed after its copy, are copied at the push."""
    m = Net()
    copies = Recording()
    st = HostStaging(params_of(m), busy=lambda: False, copies=copies, hooks=True)
    st.arm()
    st.defer(True)
    backward(m, seed=1)  # uses every parameter
    assert copies.log == []
    st.defer(False)
    backward(m, extra=False, seed=2)  # the last pass: b.* unused
    assert copies.log == ["d2h"] * 3  # a.weight, a.bias, scale
    m.a.bias.grad.mul_(2)  # changed after its copy
    host = st.to_host(grads(m))
    assert copies.log.count("d2h") == 6  # b.weight, b.bias and a.bias again
    assert all(torch.equal(host[n], g) for n, g in grads(m).items())


def test_hooks_do_nothing_unless_armed() -> None:
    m = Net()
    copies = Recording()
    st = HostStaging(params_of(m), busy=lambda: False, copies=copies, hooks=True)
    backward(m)  # e.g. a test driving PSSync without begin_step
    assert copies.log == [] and st.slots == []
    host = st.to_host(grads(m))
    assert all(torch.equal(host[n], g) for n, g in grads(m).items())
    backward(m)  # after the push: not armed until the next unit
    assert copies.log.count("d2h") == 5


# ----------------------------------------------------------------------------- pulls
def test_pull_buffers_are_host_tensors_reused_after_the_last_load() -> None:
    m = Net()
    copies = Recording()
    st = HostStaging(params_of(m), busy=lambda: False, copies=copies, hooks=False)
    target = st.target()
    assert all(target[n].data_ptr() != p.data_ptr() for n, p in m.named_parameters())
    for t in target.values():
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape))
    st.load()
    assert all(torch.equal(p, target[n]) for n, p in m.named_parameters())
    again = st.target()
    assert copies.log == ["wait h2d"]  # the next pull waits for the last load's copies
    assert {n: t.data_ptr() for n, t in again.items()} == {n: t.data_ptr() for n, t in target.items()}
    assert st.target("ahead")["a.weight"].data_ptr() != target["a.weight"].data_ptr()


def test_by_default_a_change_of_the_gradients_after_backward_is_pushed() -> None:
    """fp16's unscale works in place without moving ``_version``: copies made during backward
    would miss it (why the hooks are opt-in); the default copies at the push see it."""
    m = Net()
    st = HostStaging(params_of(m), busy=lambda: False, copies=PlainCopies())
    st.arm()
    backward(m)
    gs = [p.grad for p in m.parameters()]
    versions = [g._version for g in gs]
    torch._amp_foreach_non_finite_check_and_unscale_(gs, torch.zeros(1), torch.full((1,), 0.25))
    assert [g._version for g in gs] == versions  # (invisible to the hooks' check)
    host = st.to_host(grads(m))
    assert all(torch.equal(host[n], g) for n, g in grads(m).items())
