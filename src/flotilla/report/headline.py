"""The headline metric of a run: which evaluation result a report shows first, and which way is better.

A task declares it as a class (or instance) attribute ``headline = ("rmse", "min")``: the name of
one of its evaluation results (``loss``, a key of ``metrics()`` or of ``summarize()``) and
``"max"`` or ``"min"``.  Without a declaration the headline is, in this order: the metric of the
task's ``target`` when the evaluation has it, ``accuracy`` (max) when the evaluation has it, else
the task ``loss`` (min).  The live progress line, ``summary.json``, ``evals.jsonl`` and the plots
show it.

Report fields of an evaluation (:func:`eval_fields`): ``test_<name>`` for every evaluation result
(``test_loss`` always; ``test_accuracy`` only when the task has an accuracy metric), plus
``headline`` (the metric's name) and ``headline_mode`` (``"max"``/``"min"``); the headline's value
is ``record["test_" + record["headline"]]`` (:func:`headline_value`).

Records written before the headline existed (or by a writer that does not know the task) carry
``test_accuracy: None`` for a task without accuracy and no ``headline``: :func:`normalize_eval`
drops the ``None`` and names the default headline, so every report reads the same shape.

Pure: dicts and strings in, dicts out; no torch, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HEADLINE",
    "HEADLINE_MODE",
    "MODES",
    "Headline",
    "declared_headline",
    "eval_fields",
    "headline_from_record",
    "headline_of",
    "headline_value",
    "normalize_eval",
]

HEADLINE = "headline"
HEADLINE_MODE = "headline_mode"
MODES = ("max", "min")
TEST_PREFIX = "test_"


@dataclass(frozen=True, slots=True)
class Headline:
    """An evaluation result's name (``rmse``; its report field is ``test_rmse``) and its direction."""

    metric: str
    mode: str  # "max": higher is better; "min": lower is better

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"headline metric must be a non-empty string, got {self.metric!r}")
        if self.mode not in MODES:
            raise ValueError(f"headline mode of {self.metric!r} must be 'max' or 'min', got {self.mode!r}")

    @property
    def field(self) -> str:
        """The report field holding its value: ``test_<metric>``."""
        return TEST_PREFIX + self.metric

    @property
    def label(self) -> str:
        """``rmse (lower is better)``."""
        return f"{self.metric} ({'higher' if self.mode == 'max' else 'lower'} is better)"

    def better(self, a: float, b: float) -> bool:
        """Whether ``a`` is strictly better than ``b``."""
        return a > b if self.mode == "max" else a < b

    def fields(self) -> dict[str, str]:
        return {HEADLINE: self.metric, HEADLINE_MODE: self.mode}


ACCURACY = Headline("accuracy", "max")
LOSS = Headline("loss", "min")


def _parse(raw: Any, what: str) -> Headline:
    if isinstance(raw, Headline):
        return raw
    if not isinstance(raw, (tuple, list)) or len(raw) != 2:
        raise ValueError(f"task {what} must be (metric, 'max' or 'min'), e.g. ('rmse', 'min'); got {raw!r}")
    return Headline(raw[0], raw[1])


def declared_headline(task: object) -> Headline | None:
    """The task's own ``headline`` attribute, checked (ValueError in one line); None if it has none."""
    raw = getattr(task, HEADLINE, None)
    return None if raw is None else _parse(raw, "headline")


def _from_target(task: object, names: frozenset[str]) -> Headline | None:
    target = getattr(task, "target", None)
    if isinstance(target, (tuple, list)) and len(target) == 3 and target[0] in names and target[2] in MODES:
        return Headline(target[0], target[2])
    return None


def headline_of(task: object, metrics: Iterable[str]) -> Headline:
    """The task's headline among the evaluation results named ``metrics`` (module doc has the rule).

    ValueError (one line) when the task declares a malformed headline or one its evaluation lacks.
    """
    names = frozenset(metrics)
    declared = declared_headline(task)
    if declared is not None:
        if declared.metric not in names:
            raise ValueError(
                f"task headline {declared.metric!r} is not one of its evaluation results {sorted(names)}"
            )
        return declared
    return _from_target(task, names) or (ACCURACY if ACCURACY.metric in names else LOSS)


def eval_fields(task: object, ev: Mapping[str, float | None]) -> dict[str, Any]:
    """An evaluation's report fields: ``test_<name>`` for every result that has a value, plus
    ``headline``/``headline_mode`` (no ``test_accuracy`` for a task without accuracy)."""
    values = {k: v for k, v in ev.items() if v is not None}
    head = headline_of(task, values)
    return {**{TEST_PREFIX + k: v for k, v in values.items()}, **head.fields()}


def headline_from_record(record: Mapping[str, Any]) -> Headline | None:
    """The headline a record names; for a record without one, the default from its ``test_``
    fields (accuracy when it has a value, else loss when present); None when neither."""
    name, mode = record.get(HEADLINE), record.get(HEADLINE_MODE)
    if isinstance(name, str) and mode in MODES:
        return Headline(name, str(mode))
    if record.get(ACCURACY.field) is not None:
        return ACCURACY
    return LOSS if LOSS.field in record else None


def headline_value(record: Mapping[str, Any]) -> tuple[Headline, float | None] | None:
    """The record's headline and its value (None if the record lacks it); None without a headline."""
    head = headline_from_record(record)
    if head is None:
        return None
    value = record.get(head.field)
    return head, None if value is None else float(value)


def normalize_eval(record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an evaluation record (or a final result) in the current shape: a ``None``
    ``test_accuracy`` dropped, ``headline``/``headline_mode`` present whenever it names a result."""
    out = dict(record)
    if ACCURACY.field in out and out[ACCURACY.field] is None:
        del out[ACCURACY.field]
    head = headline_from_record(out)
    if head is not None and HEADLINE not in out:
        out.update(head.fields())
    return out
