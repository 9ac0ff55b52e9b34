"""Finding, checking and feeding a user task (:mod:`flotilla.trainer.task`).

- :func:`load_task` builds a task from its name -- ``"pkg.module:Class"`` or
  ``"path/to/file.py:Class"`` (relative to ``base_dir``, usually the config file's directory) --
  and keyword arguments.  A task file is imported as ``python file.py`` would run it: its
  directory goes first on ``sys.path`` (in every process that loads it), so it imports the
  modules next to it.  Every failure is one :class:`TaskError` line naming the task and what is
  wrong; nothing is started before the task loaded and passed :func:`check_task`.
- :class:`TaskData` gives a data source (tensors or a map-style dataset) the one access pattern
  flotilla needs: a batch for a list of sample indices chosen by the global-batch sampler.
- :func:`evaluate_task` computes the task loss and metrics over a data source, weighted by batch size.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import default_collate

from flotilla.core.errors import ConfigError
from flotilla.core.imports import import_by_name, why
from flotilla.data.tree import BatchError, batch_len, check_batch, take, to_device
from flotilla.trainer.task import DataSource, Task, missing_methods


class TaskError(ConfigError):
    """A task that cannot be imported, built or used; the message names the task and the cause."""


def resolve_task_class(name: str, base_dir: Path | None = None) -> Any:
    """The class (or factory) named ``"module:attr"`` or ``"file.py:attr"``."""
    return import_by_name(name, label=f"task {name!r}", base_dir=base_dir, error=TaskError)


def load_task(name: str, args: Mapping[str, Any] | None = None, *, base_dir: Path | None = None) -> Task:
    """Build the task ``name`` with keyword arguments ``args`` and check it has the task methods."""
    factory = resolve_task_class(name, base_dir)
    try:
        task = factory(**dict(args or {}))
    except Exception as exc:
        raise TaskError(f"task {name!r}: constructing it with {dict(args or {})} failed: {why(exc)}") from exc
    return require_task(task, name)


def call_task(task: Any, method: str, *args: Any) -> Any:
    """``task.method(*args)``; a failure becomes one :class:`TaskError` line naming the task."""
    try:
        return getattr(task, method)(*args)
    except TaskError:
        raise
    except Exception as exc:
        raise TaskError(f"task {type(task).__name__}: {method}() failed: {why(exc)}") from exc


def require_task(task: Any, name: str) -> Task:
    """``task`` itself if it has every required method, else a :class:`TaskError` naming them."""
    missing = missing_methods(task)
    if missing:
        raise TaskError(f"task {name!r}: {type(task).__name__} lacks the method(s) {', '.join(missing)}")
    return task


def task_name_of(task: object) -> str:
    """The name that rebuilds ``task``'s class (or ``task`` itself, a class) in another process:
    ``"package.module:Class"`` for installed code, the file's path (``"/abs/file.py:Class"``) for a
    user's own module or script, whatever directory the other process starts in."""
    cls = task if isinstance(task, type) else type(task)
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    installed = path is not None and any(
        Path(path).resolve().is_relative_to(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix}
    )
    if path is not None and not installed and "." not in cls.__module__:
        return f"{Path(path).resolve()}:{cls.__qualname__}"
    if cls.__module__ == "__main__" or path is None and cls.__module__.startswith("flotilla_user_"):
        raise TaskError(f"task {cls.__name__}: defined interactively; put it in a file or a module")
    return f"{cls.__module__}:{cls.__qualname__}"


class TaskData:
    """Batches of a data source by sample index (tensors are indexed, datasets collated)."""

    def __init__(self, source: DataSource, what: str = "data") -> None:
        self._tensors: tuple[Any, Any] | None = None
        if isinstance(source, tuple):
            if len(source) != 2:
                raise TaskError(f"{what}: expected a Dataset or a pair of tensors (inputs, targets)")
            try:  # (each side a tensor, or tuples/lists/dicts of tensors: data/tree.py)
                n_in, n_out = check_batch(source[0], "the inputs"), check_batch(source[1], "the targets")
            except BatchError as exc:
                raise TaskError(
                    f"{what}: expected a Dataset or a pair of tensors (inputs, targets); {exc}"
                ) from None
            if n_in != n_out:
                raise TaskError(f"{what}: inputs have {n_in} samples but targets {n_out}")
            self._tensors = (source[0], source[1])
            self.num_samples = n_in
        else:
            if not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
                raise TaskError(f"{what}: expected a map-style Dataset (with __len__ and __getitem__)")
            self._dataset = source
            self.num_samples = len(source)
        if self.num_samples < 1:
            raise TaskError(f"{what}: holds no samples")

    def batch(self, indices: Sequence[int] | Any) -> tuple[Any, Any]:
        """``(inputs, targets)`` of the samples ``indices`` (a sequence or a numpy/torch array);
        each a tensor, or the tuples/lists/dicts of tensors a dataset's items collate into."""
        if self._tensors is not None:
            idx = torch.as_tensor(indices, dtype=torch.long)
            return take(self._tensors[0], idx), take(self._tensors[1], idx)
        many = getattr(self._dataset, "__getitems__", None)  # (Subset and friends: one call)
        keys = indices.tolist() if hasattr(indices, "tolist") else [int(i) for i in indices]
        if not keys:  # (more workers than samples in an epoch's short last batch: no rows, same shapes)
            x, y = default_collate([self._dataset[0]])
            none = torch.empty(0, dtype=torch.long)
            return take(x, none), take(y, none)
        items = many(keys) if callable(many) else [self._dataset[i] for i in keys]
        x, y = default_collate(items)
        return x, y


@torch.no_grad()
def evaluate_task(task: Task, model: nn.Module, data: TaskData, batch: int = 1024) -> dict[str, float]:
    """Task loss and metrics over ``data``: batch means weighted by batch size, then ``summarize``."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for start in range(0, data.num_samples, batch):
        x, y = data.batch(range(start, min(start + batch, data.num_samples)))
        x, y = to_device(x, device), to_device(y, device)
        out = model(x)
        n = batch_len(y)
        values = {"loss": float(task.loss(out, y)), **_metric_values(task, out, y)}
        for key, value in values.items():
            sums[key] = sums.get(key, 0.0) + value * n
    model.train(was_training)
    means = {key: total / data.num_samples for key, total in sums.items()}
    summarize = getattr(task, "summarize", None)  # optional hook
    return {**means, **(summarize(means) if callable(summarize) else {})}


def _metric_values(task: Task, out: Any, y: Any) -> dict[str, float]:
    """``task.metrics(out, y)`` as numbers by name; anything else is one :class:`TaskError` line
    naming the task (and the metric), never a traceback."""
    got = call_task(task, "metrics", out, y)
    name = type(task).__name__
    if not isinstance(got, Mapping):
        got_type = type(got).__name__
        raise TaskError(f"task {name}: metrics() must return a dict of name -> number, got {got_type}")
    values = {}
    for key, value in got.items():
        try:
            values[str(key)] = float(value)
        except (TypeError, ValueError, RuntimeError):  # (RuntimeError: a tensor of several values)
            raise TaskError(f"task {name}: metrics() gave {key!r} = {value!r:.60}, not a number") from None
    return values


CHECK_SAMPLES = 4
"""How many training samples the pre-flight check runs the model and the loss on."""

_OUTPUT, _TARGET = frozenset({"output"}), frozenset({"target"})


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors_in(item)]
    return []


def _is_loss_function(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return getattr(func, "__module__", None) == "torch.nn.functional" and (
        "loss" in name or "entropy" in name or name == "kl_div"
    )


class _ShapeWatch(TorchFunctionMode):
    """While the loss runs: which tensors derive from the outputs only, which from the targets
    only, and the first torch call that meets one of each with shapes that do not pair up --
    a loss function given the same number of elements in two shapes (``mse_loss`` of ``(N, 1)``
    and ``(N,)``), or an elementwise op whose result is larger than both (``(N, 1) - (N,)`` is
    ``(N, N)``).  Legit pairs pass: ``(N, C)`` logits with ``(N,)`` classes, ``(N, T, V)`` with
    ``(N, T)`` tokens, a mask ``(N, T, 1)`` on ``(N, T, V)``, ``output.view_as(target)``."""

    def __init__(self, output: Any, target: Any) -> None:
        super().__init__()
        self._tags: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        self.found: tuple[str, tuple[int, ...], tuple[int, ...]] | None = None
        for t in _tensors_in(output):
            self._tags[id(t)] = (t, _OUTPUT)
        for t in _tensors_in(target):
            self._tags[id(t)] = (t, _TARGET)

    def _tag(self, t: torch.Tensor) -> frozenset[str]:
        entry = self._tags.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else frozenset()

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        tensors = _tensors_in([list(args), dict(kwargs or {})])
        tags = frozenset().union(*(self._tag(t) for t in tensors))
        if tags:
            if self.found is None:
                self._check(func, tensors, result)
            for t in _tensors_in(result):
                self._tags[id(t)] = (t, tags)
        return result

    def _check(self, func: Any, tensors: list[torch.Tensor], result: Any) -> None:
        outputs = [t for t in tensors if self._tag(t) == _OUTPUT and t.dim() > 0]
        targets = [t for t in tensors if self._tag(t) == _TARGET and t.dim() > 0]
        for a in outputs:
            for b in targets:
                if a.shape == b.shape:
                    continue
                same_count = _is_loss_function(func) and a.numel() == b.numel()
                if same_count or _broadcast_grows(a, b, result):
                    self.found = (getattr(func, "__name__", str(func)), tuple(a.shape), tuple(b.shape))
                    return


def _broadcast_grows(a: torch.Tensor, b: torch.Tensor, result: Any) -> bool:
    """``result`` is ``a`` and ``b`` broadcast against each other into more elements than either."""
    if not isinstance(result, torch.Tensor):
        return False
    shape = _broadcast(tuple(a.shape), tuple(b.shape))
    if shape is None:
        return False
    return tuple(result.shape) == shape and result.numel() > max(a.numel(), b.numel())


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """NumPy/torch broadcasting of two shapes (None: they do not broadcast).  Written out:
    the first ``torch.broadcast_shapes`` call imports sympy (~0.9 s of every job's start-up)."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            return None
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _run_loss(task: Task, model: nn.Module, x: Any, y: Any, name: str) -> tuple[Any, str | None]:
    """The loss on one batch, and what is wrong with the shapes as the loss saw them (or None)."""
    try:
        with torch.enable_grad():  # (a graph over CHECK_SAMPLES samples: whether the loss has one)
            output = model(x)
            watch = _ShapeWatch(output, y)
            with warnings.catch_warnings(record=True) as caught, watch:
                warnings.simplefilter("always")
                loss = task.loss(output, y)
    except Exception as exc:
        raise TaskError(f"task {name!r}: loss(model(inputs), targets) failed: {why(exc)}") from exc
    if watch.found is not None:
        func, out_shape, target_shape = watch.found
        return loss, f"outputs of shape {out_shape} and targets of shape {target_shape} in {func}"
    for w in caught:
        if "broadcast" in str(w.message):
            shapes = f"outputs of shape {_shape_of(output)} and targets of shape {_shape_of(y)}"
            return loss, f"{shapes} ({str(w.message).splitlines()[0]})"
    return loss, None


def _shape_of(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def check_task(task: Task, model: nn.Module, data: TaskData, name: str) -> None:
    """Run the model and the loss on the first :data:`CHECK_SAMPLES` training samples: a model
    whose output does not fit the loss, a loss that broadcasts outputs against targets of
    another shape (which trains silently to nothing), or a loss that is not a scalar fails here
    with one line, before any process starts training."""
    try:
        x, y = data.batch(range(min(CHECK_SAMPLES, data.num_samples)))
    except Exception as exc:
        raise TaskError(f"task {name!r}: reading the first training samples failed: {why(exc)}") from exc
    try:
        check_batch(x, "the inputs")
        n = check_batch(y, "the targets")
    except BatchError as exc:
        raise TaskError(f"task {name!r}: {exc}") from None
    if not any(p.requires_grad for p in model.parameters()):
        raise TaskError(
            f"task {name!r}: the model has no trainable parameters (none, or all with "
            "requires_grad=False): there is nothing to train"
        )
    loss, broadcast = _run_loss(task, model, x, y, name)
    if broadcast is not None:
        raise TaskError(
            f"task {name!r}: the loss broadcasts {broadcast} (a batch of {n} samples); "
            "give outputs and targets the same shape, e.g. output.squeeze(-1) or target.view_as(output)"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise TaskError(f"task {name!r}: loss must return a scalar tensor (the batch mean), got {got}")
    if not loss.requires_grad and any(p.requires_grad for p in model.parameters()):
        raise TaskError(
            f"task {name!r}: the loss does not depend on the model's trainable parameters (no "
            "gradient flows back from it): compute it from the output, without .detach(), .item(), "
            "torch.no_grad() or a new tensor"
        )
