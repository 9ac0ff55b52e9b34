"""What one HetPipe stage does when, on its own schedule (SPEC §2; pure: no torch, no I/O, no
clock).  A virtual worker (VW) is a pipeline running PipeDream's asynchronous schedule with
``N_m = s_local + 1`` minibatches in flight (``pipeline/schedule.pipedream(in_flight=N_m)``); the
same rules as the discrete-tick model ``ps/wsp.py`` hold on every stage:

- **waves**: wave u = the VW's minibatches uW … (u+1)W - 1 (0-based here; W = s_local + 1); the
  last wave may be shorter.  A stage's update of a wave's last minibatch **ends** the wave: the
  stage pushes the sum of its updates of that wave (its part of the VW's clock u) and votes to
  commit it with its pull of clock u + 1 (``ps.vpull``);
- **gate**: the forward of a full wave's last minibatch, (u+2)W - 1, may not run before the pull
  of clock u + 1 was answered (``ps/wsp.needed_clock``); the pull may arrive earlier and is then
  folded in at the first forward after it arrived.  While a stage waits there, the minibatches in
  flight go on downstream (the pipeline does not drain);
- **a VW coming back** (its stages new processes, a new worker id on the servers) starts at the
  wave ``first_wave`` the servers gave it: its minibatches are numbered from ``first_wave * W``
  (the runtime's minibatch ``m`` is the VW's ``first_wave * W + m``), its weights are the global
  state of clock ``first_wave`` and its earlier waves count as done;
- **records**: before each forward the stage records which global waves (per VW) and which of
  its own updates its weights hold (:class:`flotilla.ps.wsp.MinibatchRecord`), so that
  ``ps/wsp.check_sglobal_bound`` checks SPEC §2's bound on what really ran.  Another VW's waves
  are counted from the pulled ``c_global`` (every VW had pushed that many: a lower bound, so a
  check that passes on it passes on the truth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flotilla.core.errors import ConfigError
from flotilla.ps.wsp import MinibatchRecord, needed_clock

__all__ = ["WavePlan", "WaveView"]


@dataclass(frozen=True, kw_only=True, slots=True)
class WavePlan:
    """One stage's wave arithmetic: ``num_minibatches`` this stage process trains, from the VW's
    wave ``first_wave`` on (module doc), ``s_local``.  Minibatch arguments are the runtime's
    (0-based, from this process's first); waves and clocks are the VW's."""

    s_local: int
    num_minibatches: int
    first_wave: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.s_local, int) or self.s_local < 0:
            raise ConfigError(f"s_local must be an int >= 0, got {self.s_local!r}")
        if not isinstance(self.num_minibatches, int) or self.num_minibatches < 1:
            raise ConfigError(f"num_minibatches must be an int >= 1, got {self.num_minibatches!r}")
        if not isinstance(self.first_wave, int) or self.first_wave < 0:
            raise ConfigError(f"first_wave must be an int >= 0, got {self.first_wave!r}")

    @property
    def wave_size(self) -> int:
        return self.s_local + 1

    @property
    def first_minibatch(self) -> int:
        """The VW's minibatch (0-based) this process's first is."""
        return self.first_wave * self.wave_size

    @property
    def num_waves(self) -> int:
        """The waves this process trains (the last may be shorter)."""
        return math.ceil(self.num_minibatches / self.wave_size)

    def ends_wave(self, m: int) -> int | None:
        """The VW's wave the update of minibatch ``m`` ends, or None."""
        a = self.first_minibatch + m
        if (a + 1) % self.wave_size == 0 or m == self.num_minibatches - 1:
            return a // self.wave_size
        return None

    def needed_clock(self, b: int) -> int:
        """The pull clock the forward of minibatch ``b`` waits for (0: none)."""
        return needed_clock(self.first_minibatch + b + 1, self.wave_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class WaveView:
    """What a stage's live weights hold: ``pulled`` = the clock of the last pull folded in (own
    waves 0 … pulled-1 are in the global state it brought), ``c_global`` = every VW's waves in it
    (at least), ``local_done`` = own updates applied here."""

    vw: int
    num_vws: int
    pulled: int = 0
    c_global: int = 0
    local_done: int = 0

    def record(self, b: int, wave_size: int, tick: int = 0) -> MinibatchRecord:
        """The record of the forward of the VW's minibatch ``b`` (0-based) run on these weights."""
        waves = tuple(self.pulled if v == self.vw else self.c_global for v in range(self.num_vws))
        return MinibatchRecord(
            vw=self.vw,
            minibatch=b + 1,
            wave_size=wave_size,
            start_tick=tick,
            global_waves=waves,
            local_done=self.local_done,
        )
