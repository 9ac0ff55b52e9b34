"""Finding, checking and feeding a user task (:mod:`flotilla.trainer.task`).

- :func:`load_task` builds a task from its name -- ``"pkg.module:Class"`` or
  ``"path/to/file.py:Class"`` (relative to ``base_dir``, usually the config file's directory) --
  and keyword arguments.  Every failure is one :class:`TaskError` line naming the task and what is
  wrong; nothing is started before the task loaded and passed :func:`check_task`.
- :class:`TaskData` gives a data source (tensors or a map-style dataset) the one access pattern
  flotilla needs: a batch for a list of sample indices chosen by the global-batch sampler.
- :func:`evaluate_task` computes the task loss and metrics over a data source, weighted by batch size.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from flotilla.core.errors import ConfigError
from flotilla.trainer.task import DataSource, Task, missing_methods


class TaskError(ConfigError):
    """A task that cannot be imported, built or used; the message names the task and the cause."""


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _import_file(path: Path, name: str) -> Any:
    if not path.is_file():
        raise TaskError(f"task {name!r}: file {str(path)!r} does not exist")
    digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()
    mod_name = f"flotilla_user_task_{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise TaskError(f"task {name!r}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise TaskError(f"task {name!r}: importing {str(path)!r} failed: {_why(exc)}") from exc
    return module


def _import_module(dotted: str, name: str) -> Any:
    try:
        return importlib.import_module(dotted)
    except Exception as exc:
        raise TaskError(f"task {name!r}: cannot import module {dotted!r}: {_why(exc)}") from exc


def resolve_task_class(name: str, base_dir: Path | None = None) -> Any:
    """The class (or factory) named ``"module:attr"`` or ``"file.py:attr"``."""
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        raise TaskError(f"task {name!r}: expected 'package.module:Class' or 'path/to/file.py:Class'")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        module = _import_file(path, name)
    else:
        module = _import_module(where, name)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"task {name!r}: {where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_task(name: str, args: Mapping[str, Any] | None = None, *, base_dir: Path | None = None) -> Task:
    """Build the task ``name`` with keyword arguments ``args`` and check it has the task methods."""
    factory = resolve_task_class(name, base_dir)
    try:
        task = factory(**dict(args or {}))
    except Exception as exc:
        raise TaskError(
            f"task {name!r}: constructing it with {dict(args or {})} failed: {_why(exc)}"
        ) from exc
    return require_task(task, name)


def call_task(task: Any, method: str, *args: Any) -> Any:
    """``task.method(*args)``; a failure becomes one :class:`TaskError` line naming the task."""
    try:
        return getattr(task, method)(*args)
    except TaskError:
        raise
    except Exception as exc:
        raise TaskError(f"task {type(task).__name__}: {method}() failed: {_why(exc)}") from exc


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
    if cls.__module__ == "__main__" or path is None and cls.__module__.startswith("flotilla_user_task_"):
        raise TaskError(f"task {cls.__name__}: defined interactively; put it in a file or a module")
    return f"{cls.__module__}:{cls.__qualname__}"


class TaskData:
    """Batches of a data source by sample index (tensors are indexed, datasets collated)."""

    def __init__(self, source: DataSource, what: str = "data") -> None:
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        if isinstance(source, tuple):
            if len(source) != 2 or not all(isinstance(t, torch.Tensor) for t in source):
                raise TaskError(f"{what}: expected a Dataset or a pair of tensors (inputs, targets)")
            if source[0].shape[0] != source[1].shape[0]:
                raise TaskError(
                    f"{what}: inputs have {source[0].shape[0]} samples but targets {source[1].shape[0]}"
                )
            self._tensors = (source[0], source[1])
            self.num_samples = int(source[0].shape[0])
        else:
            if not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
                raise TaskError(f"{what}: expected a map-style Dataset (with __len__ and __getitem__)")
            self._dataset = source
            self.num_samples = len(source)
        if self.num_samples < 1:
            raise TaskError(f"{what}: holds no samples")

    def batch(self, indices: Sequence[int] | Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of the samples ``indices`` (a sequence or a numpy/torch array)."""
        if self._tensors is not None:
            idx = torch.as_tensor(indices, dtype=torch.long)
            return self._tensors[0][idx], self._tensors[1][idx]
        items = [self._dataset[int(i)] for i in indices]
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
        x, y = x.to(device), y.to(device)
        out = model(x)
        n = int(y.shape[0])
        values = {"loss": float(task.loss(out, y)), **task.metrics(out, y)}
        for key, value in values.items():
            sums[key] = sums.get(key, 0.0) + float(value) * n
    model.train(was_training)
    means = {key: total / data.num_samples for key, total in sums.items()}
    summarize = getattr(task, "summarize", None)  # optional hook
    return {**means, **(summarize(means) if callable(summarize) else {})}


def check_task(task: Task, model: nn.Module, data: TaskData, name: str) -> None:
    """Run the model and the loss on two samples: a model whose output does not fit the loss fails
    here with one line, before any process starts training."""
    try:
        x, y = data.batch(range(min(2, data.num_samples)))
    except Exception as exc:
        raise TaskError(f"task {name!r}: reading two training samples failed: {_why(exc)}") from exc
    try:
        with torch.no_grad():
            loss = task.loss(model(x), y)
    except Exception as exc:
        raise TaskError(f"task {name!r}: loss(model(inputs), targets) failed: {_why(exc)}") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TaskError(f"task {name!r}: loss must return a scalar tensor (the batch mean), got {loss!r}")
