"""Where every stage process of a pipeline job sits (pure: no I/O, no torch).

A job runs ``len(counts)`` pipeline instances side by side; instance ``r`` has ``counts[r]``
stages.  Its stage processes are numbered instance by instance: instance 0's stages first (stage
0 to ``counts[0] - 1``), then instance 1's, and so on.  A plain pipeline and PP x DP
(``strategy.replicas``) have instances of one stage count (:meth:`Layout.uniform`: process ``g``
is stage ``g % P`` of instance ``g // P``); HetPipe's virtual workers, placed by
``pipeline/vw_placement.py``, may each have their own (a VW of two strong devices beside one of
four weak ones).

An instance may be **formed again** on other processes (:meth:`Layout.reformed`: a HetPipe VW
lost with a device, re-formed from its surviving devices and free ones, maybe with another
stage count): its new processes are numbered after every existing one, and the old ones are
retired -- they keep their place (``place``: where they were) but belong to no instance any more
(``current``).  So the numbers of the other instances' processes never change, and each
instance's processes stay consecutive.  ``places`` (instance, stage) of every process ever
numbered, in order, is the whole layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from flotilla.core.errors import ConfigError

__all__ = ["Layout", "StagePlace", "device_of", "process_name"]

REFORMED = "~"  # (a worker name never holds it: config/cluster.WorkerName)


def process_name(device: str, index: int) -> str:
    """The name of stage process ``index`` of an instance formed again, on ``device``: unique in
    the job (a device may hold a retired process of the same instance): ``d1~7``."""
    return f"{device}{REFORMED}{index}"


def device_of(name: str) -> str:
    """The device (the cluster's worker) a stage process named ``name`` runs on."""
    return name.split(REFORMED, 1)[0]


@dataclass(frozen=True, slots=True)
class StagePlace:
    """Stage process ``index`` of a job: stage ``stage`` of pipeline instance ``replica``."""

    index: int
    stage: int
    replica: int


@dataclass(frozen=True, slots=True)
class Layout:
    """The stage count of every pipeline instance of a job now, and where every stage process
    ever numbered sits (``places``: (instance, stage); empty: instance by instance -- module doc)."""

    counts: tuple[int, ...]
    places: tuple[tuple[int, int], ...] = ()
    _starts: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.counts or any(not isinstance(c, int) or c < 1 for c in self.counts):
            raise ConfigError(f"a pipeline job needs instances of >= 1 stage each, got {list(self.counts)}")
        places = self.places or tuple((r, i) for r, c in enumerate(self.counts) for i in range(c))
        object.__setattr__(self, "places", tuple((int(r), int(i)) for r, i in places))
        if any(not 0 <= r < len(self.counts) or i < 0 for r, i in self.places):
            raise ConfigError(
                f"a pipeline layout's places must name instances 0..{len(self.counts) - 1} and stages "
                f">= 0, got {[list(p) for p in self.places]}"
            )
        # (each instance's processes now: the last numbered run of its stages 0 .. count - 1)
        starts = []
        for r, count in enumerate(self.counts):
            first = max((g for g, p in enumerate(self.places) if p == (r, 0)), default=-1)
            if first < 0 or self.places[first : first + count] != tuple((r, i) for i in range(count)):
                raise ConfigError(
                    f"a pipeline layout's places must number instance {r}'s {count} stage(s) "
                    f"consecutively, got {[list(p) for p in self.places]}"
                )
            starts.append(first)
        object.__setattr__(self, "_starts", tuple(starts))

    def reformed(self, instance: int, count: int) -> Layout:
        """``instance`` formed again on ``count`` new processes, numbered after every existing
        one; its old ones retired (module doc)."""
        if not 0 <= instance < self.num_instances or count < 1:
            raise ConfigError(
                f"cannot form instance {instance} again on {count} stage(s): the job has "
                f"{self.num_instances} instance(s), and an instance needs >= 1 stage"
            )
        counts = self.counts[:instance] + (count,) + self.counts[instance + 1 :]
        return Layout(counts, self.places + tuple((instance, i) for i in range(count)))

    def current(self, index: int) -> bool:
        """Whether stage process ``index`` belongs to its instance now (not retired)."""
        place = self.place(index)
        return index in self.processes(place.replica)

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
        """Stage processes ever numbered (retired ones included)."""
        return len(self.places)

    @property
    def is_uniform(self) -> bool:
        return len(set(self.counts)) == 1

    def first(self, instance: int) -> int:
        """The process of ``instance``'s stage 0 (now)."""
        return self._starts[instance]

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
        replica, stage = self.places[index]
        return StagePlace(index, stage, replica)

    def instance_of(self, index: int) -> int:
        return self.place(index).replica

    def describe(self, index: int, names: Sequence[str]) -> str:
        """``w1 (stage 1 of instance 0)`` (``, retired)`` for a process of an instance formed again)."""
        place = self.place(index)
        retired = "" if self.current(index) else ", retired"
        return f"{names[index]} (stage {place.stage} of instance {place.replica}{retired})"

    def _counts_text(self) -> str:
        if self.is_uniform:
            return str(self.counts[0])
        return "/".join(str(c) for c in self.counts)
