"""A strategy of one's own (docs/strategies.md): all-reduced gradients, a momentum SGD it keeps."""

import torch
from pydantic import Field

from flotilla import Outcome, Regime, StrategySettings, StrategySpec, SyncStrategy, Traits


class Settings(StrategySettings):  # the YAML `strategy:` section; bad values name the field
    lr: float = Field(default=0.05, gt=0)
    momentum: float = Field(default=0.9, ge=0, lt=1)


class Averaged(SyncStrategy):
    kind = "averaged"
    traits = Traits(regime=Regime.VOTE)  # a vote every step

    def __init__(self, model, settings: Settings) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.s, self.group = settings, None
        self.velocity = [torch.zeros_like(p) for p in self.params]

    def bind(self, group) -> None:  # each membership view brings its process group
        self.group = group

    def begin_step(self, step: int) -> None:
        for p in self.params:
            p.grad = None

    def synchronize(self, proposal):  # commit everywhere or nowhere
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        vote = torch.tensor([float(not proposal.local_ok), proposal.pending_epoch, proposal.stop, 0.0])
        try:  # losses are sums / the global batch: the SUM is the global mean gradient
            self.group.allreduce(flat)
            self.group.allreduce(vote, op="max")
        except Exception as exc:  # a member died: nothing applied, the loop recovers
            return Outcome.group_failed(str(exc))
        bad, epoch, stop, _ = vote.tolist()
        if bad or not torch.isfinite(flat).all():
            return Outcome(committed=False, pending_epoch=int(epoch), stop=stop > 0, local_ok=False)
        with torch.no_grad():
            for p, v, g in zip(self.params, self.velocity, flat.split([p.numel() for p in self.params])):
                p.sub_(self.s.lr * v.mul_(self.s.momentum).add_(g.view_as(p)))
        return Outcome(committed=True, pending_epoch=int(epoch), stop=stop > 0)

    def state_dict(self):
        return {f"v{i}": v for i, v in enumerate(self.velocity)}

    def load_state_dict(self, state) -> None:
        for i, v in enumerate(self.velocity):
            v.copy_(state[f"v{i}"])


SPEC = StrategySpec(
    kind="averaged",
    settings=Settings,
    build=lambda model, optimizer, settings, ctx: Averaged(model, settings),
    summary="all-reduced gradients, a momentum SGD kept by the strategy",
)
