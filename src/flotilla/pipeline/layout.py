"""Where every stage process of a pipeline job sits (pure: no I/O, no torch).

A job runs ``len(counts)`` pipeline instances side by side; instance ``r`` has ``counts[r]``
stages.  Its stage processes are numbered instance by instance: instance 0's stages first (stage
0 to ``counts[0] - 1``), then instance 1's, and so on.  A plain pipeline and PP x DP
(``strategy.replicas``) have instances of one stage count (:meth:`Layout.uniform`: process ``g``
is stage ``g % P`` of instance ``g // P``); HetPipe's virtual workers, placed by
``pipeline/vw_placement.py``, may each have their own (a VW of two strong devices beside one of
four weak ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flotilla.core.errors import ConfigError

__all__ = ["Layout", "StagePlace"]


@dataclass(frozen=True, slots=True)
class StagePlace:
    """Stage process ``index`` of a job: stage ``stage`` of pipeline instance ``replica``."""

    index: int
    stage: int
    replica: int


@dataclass(frozen=True, slots=True)
class Layout:
    """The stage count of every pipeline instance of a job (module doc)."""

    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.counts or any(not isinstance(c, int) or c < 1 for c in self.counts):
            raise ConfigError(f"a pipeline job needs instances of >= 1 stage each, got {list(self.counts)}")

    @classmethod
    def uniform(cls, num_stages: int, replicas: int) -> Layout:
        if num_stages < 1 or replicas < 1:
            raise ConfigError(
                f"a pipeline needs num_stages >= 1 and replicas >= 1, got {num_stages}, {replicas}"
            )
        return cls((num_stages,) * replicas)

    @property
    def num_instances(self) -> int:
        return len(self.counts)

    @property
    def num_processes(self) -> int:
        return sum(self.counts)

    @property
    def is_uniform(self) -> bool:
        return len(set(self.counts)) == 1

    def first(self, instance: int) -> int:
        """The process of ``instance``'s stage 0."""
        return sum(self.counts[:instance])

    def processes(self, instance: int) -> range:
        """``instance``'s stage processes, stage 0 first."""
        first = self.first(instance)
        return range(first, first + self.counts[instance])

    def place(self, index: int) -> StagePlace:
        """Where stage process ``index`` sits; ConfigError out of range."""
        if not 0 <= index < self.num_processes:
            raise ConfigError(
                f"stage process {index} out of range: the job has {self.num_processes} stage "
                f"process(es) in {self.num_instances} instance(s) of {self._counts_text()} stage(s)"
            )
        first = 0
        for replica, count in enumerate(self.counts):
            if index < first + count:
                return StagePlace(index, index - first, replica)
            first += count
        raise AssertionError("unreachable")  # (index < num_processes)

    def instance_of(self, index: int) -> int:
        return self.place(index).replica

    def describe(self, index: int, names: Sequence[str]) -> str:
        """``w1 (stage 1 of instance 0)``."""
        place = self.place(index)
        return f"{names[index]} (stage {place.stage} of instance {place.replica})"

    def _counts_text(self) -> str:
        if self.is_uniform:
            return str(self.counts[0])
        return "/".join(str(c) for c in self.counts)
