"""What the launcher hands every stage process (``<run_dir>/pipeline_job.json``): ``StageJob`` --
the run configuration, the store, the split (one for every pipeline instance, or one per instance:
HetPipe's virtual workers, each cut over its own devices), the stages' names and speeds, the job's
length, where output goes, and the resume point and checkpoint plan (``ResumePoint``,
``StageCheckpointPlan``); typed, validated on construction, JSON both ways.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flotilla.core.errors import ConfigError
from flotilla.pipeline.layout import Layout, StagePlace, process_name

__all__ = ["ResumePoint", "StageCheckpointPlan", "StageJob"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumePoint:
    """Where the stages resume: the newest step every stage of the checkpointed split wrote under
    ``dir``; ``layer_ends`` and ``split_points`` describe THAT split (the job may run another: a
    resume onto a different number of stages re-partitions, ``pipeline_checkpoint``)."""

    dir: Path
    step: int
    layer_ends: tuple[int, ...]
    fingerprint: str
    split_points: tuple[str, ...] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCheckpointPlan:
    """Every stage writes its part under ``root/stage<i>`` every ``every_steps`` steps, keeps ``keep``."""

    root: Path
    every_steps: int
    keep: int
    fingerprint: str

    def __post_init__(self) -> None:
        if self.every_steps < 1 or self.keep < 1:
            raise ConfigError(
                f"checkpoint every_steps and keep must be >= 1, got {self.every_steps}, {self.keep}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageJob:
    """What the launcher hands every stage process (module doc)."""

    config: dict[str, Any]  # the validated run configuration (RunConfig.to_dict())
    store_host: str
    store_port: int
    layer_ends: tuple[int, ...]  # every instance's split (with ``instance_ends``: instance 0's)
    # one per stage PROCESS, instance by instance (pipeline/layout.py: with one split for all,
    # process g is stage g % num_stages of instance g // num_stages)
    stage_names: tuple[str, ...]
    speeds: tuple[float, ...]
    total_steps: int
    run_dir: Path
    report_dir: Path | None = None
    resume: ResumePoint | None = None
    checkpoint: StageCheckpointPlan | None = None
    replicas: int = 1  # pipeline instances (PP x DP: pipeline/replicas.py)
    # the strategy's services the stages reach (JSON data; sync/stage_plug.py: e.g. hetpipe's
    # parameter-server addresses)
    services: dict[str, Any] = field(default_factory=dict)
    # each instance's own split (HetPipe's placed virtual workers); empty: ``layer_ends`` for all
    instance_ends: tuple[tuple[int, ...], ...] = ()
    # (instance, stage) of every stage process ever numbered, once an instance was formed again on
    # other processes (pipeline/layout.py: ``reformed``); empty: instance by instance
    process_places: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        r = self.replicas
        if self.instance_ends and (len(self.instance_ends) != r or self.instance_ends[0] != self.layer_ends):
            raise ConfigError(
                f"a pipeline job's instance_ends must hold one split per instance ({r}), the "
                f"first equal to layer_ends; got {len(self.instance_ends)}"
            )
        for ends in self.instance_ends or (self.layer_ends,):
            if not ends or any(b <= a for a, b in zip(ends, ends[1:], strict=False)) or ends[0] < 1:
                raise ConfigError(f"a pipeline split needs increasing layer ends >= 1, got {list(ends)}")
            if ends[-1] != self.layer_ends[-1]:
                raise ConfigError(
                    f"every instance's split must end at layer {self.layer_ends[-1]}, got {list(ends)}"
                )
        n = sum(len(e) for e in self.instance_ends) if self.instance_ends else len(self.layer_ends) * r
        if self.process_places:
            if not self.instance_ends:
                raise ConfigError(
                    "a pipeline job's process_places need instance_ends (one split per instance)"
                )
            n = len(self.process_places)
            self.layout  # noqa: B018  (ConfigError: places that do not fit the splits)
        if r < 1 or len(self.stage_names) != n or len(self.speeds) != n:
            raise ConfigError(
                f"a pipeline job needs one name and speed per stage process: {n} processes "
                f"({r} instance(s)), {len(self.stage_names)} names, {len(self.speeds)} speeds"
            )
        if len(set(self.stage_names)) != n:
            raise ConfigError(
                f"a pipeline job's stage processes need distinct names, got {list(self.stage_names)}"
            )
        if self.total_steps < 1:
            raise ConfigError(f"a pipeline job needs total_steps >= 1, got {self.total_steps}")

    @property
    def layout(self) -> Layout:
        """Where every stage process sits (``pipeline/layout.py``)."""
        if self.instance_ends:
            return Layout(tuple(len(e) for e in self.instance_ends), self.process_places)
        return Layout.uniform(len(self.layer_ends), self.replicas)

    @property
    def num_stages(self) -> int:
        """Stages per pipeline instance; ConfigError when the instances differ (use ``layout``)."""
        if not self.layout.is_uniform:
            raise ConfigError("this pipeline job's instances have different stage counts: no one num_stages")
        return len(self.layer_ends)

    @property
    def num_processes(self) -> int:
        """Stage processes, all instances."""
        return len(self.stage_names)

    def place_of(self, index: int) -> StagePlace:
        return self.layout.place(index)

    def ends_of(self, instance: int) -> tuple[int, ...]:
        """``instance``'s split."""
        return self.instance_ends[instance] if self.instance_ends else self.layer_ends

    def names_of(self, instance: int) -> tuple[str, ...]:
        """``instance``'s stage processes' names, stage 0 first."""
        r = self.layout.processes(instance)
        return self.stage_names[r.start : r.stop]

    def reformed(
        self, instance: int, devices: tuple[str, ...], speeds: tuple[float, ...], ends: tuple[int, ...]
    ) -> StageJob:
        """The job with ``instance`` formed again: one new stage process per device of
        ``devices`` (named ``process_name(device, index)``, with its speed), cut at ``ends``;
        its old processes retired (``pipeline/layout.py``)."""
        if len(devices) != len(ends) or len(speeds) != len(ends):
            raise ConfigError(
                f"an instance formed again needs one device and speed per stage, got {devices}, {ends}"
            )
        layout = self.layout.reformed(instance, len(ends))
        first = self.num_processes
        splits = list(self.instance_ends or (self.layer_ends,) * self.replicas)
        splits[instance] = tuple(ends)
        return replace(
            self,
            layer_ends=splits[0],
            stage_names=self.stage_names + tuple(process_name(d, first + i) for i, d in enumerate(devices)),
            speeds=self.speeds + tuple(float(v) for v in speeds),
            instance_ends=tuple(splits),
            process_places=layout.places,
        )

    @property
    def first_step(self) -> int:
        """The step the stages start at (the resume point's, else 0)."""
        return self.resume.step if self.resume is not None else 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (paths as strings)."""
        return _plain(asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> StageJob:
        """The job of :meth:`to_json`; ConfigError (one line) for anything else."""
        try:
            raw = dict(json.loads(text))
            resume, ck, report = (
                raw.pop("resume", None),
                raw.pop("checkpoint", None),
                raw.pop("report_dir", None),
            )
            raw.update(
                layer_ends=tuple(int(e) for e in raw["layer_ends"]),
                stage_names=tuple(str(n) for n in raw["stage_names"]),
                speeds=tuple(float(v) for v in raw["speeds"]),
                run_dir=Path(raw["run_dir"]),
                replicas=int(raw.get("replicas", 1)),
                services=dict(raw.get("services", {})),
                instance_ends=tuple(tuple(int(e) for e in ends) for ends in raw.get("instance_ends", ())),
                process_places=tuple((int(r), int(i)) for r, i in raw.get("process_places", ())),
            )
            return cls(
                **raw,
                report_dir=Path(report) if report else None,
                resume=_resume_point(resume) if resume else None,
                checkpoint=StageCheckpointPlan(**{**ck, "root": Path(ck["root"])}) if ck else None,
            )
        except ConfigError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"not a pipeline stage job: {type(exc).__name__}: {exc}") from None


def _resume_point(raw: dict[str, Any]) -> ResumePoint:
    points = raw.get("split_points")
    return ResumePoint(
        dir=Path(raw["dir"]),
        step=int(raw["step"]),
        layer_ends=tuple(int(e) for e in raw["layer_ends"]),
        fingerprint=str(raw["fingerprint"]),
        split_points=tuple(str(p) for p in points) if points is not None else None,
    )


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value
