"""Import a user's object by name: ``"package.module:attr"`` or ``"path/to/file.py:attr"``.

Tasks (``job.task``) and strategies (``strategy.kind``) are named this way.  A file is imported
as ``python file.py`` would run it: its directory goes first on ``sys.path`` (once, in every
process that loads it), so it imports the modules next to it; the module is cached under a name
derived from its absolute path, so loading it twice gives the same objects.  Every failure is one
error line (of the caller's class) naming what was asked for and the cause.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from flotilla.core.errors import ConfigError

__all__ = ["is_import_name", "import_by_name", "why"]


def why(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def is_import_name(name: str) -> bool:
    """Whether ``name`` looks like ``module:attr`` or ``file.py:attr`` (not a registered name)."""
    where, sep, attr = name.rpartition(":")
    return bool(sep and where and attr)


def _script_dir_on_path(path: Path) -> None:
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
        importlib.invalidate_caches()


def _import_file(path: Path, label: str, error: type[ConfigError]) -> Any:
    if not path.is_file():
        raise error(f"{label}: file {str(path)!r} does not exist")
    digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()
    mod_name = f"flotilla_user_{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise error(f"{label}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    _script_dir_on_path(path)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise error(f"{label}: importing {str(path)!r} failed: {why(exc)}") from exc
    return module


def _import_module(dotted: str, label: str, error: type[ConfigError]) -> Any:
    try:
        return importlib.import_module(dotted)
    except Exception as exc:
        raise error(f"{label}: cannot import module {dotted!r}: {why(exc)}") from exc


def import_by_name(
    name: str,
    *,
    label: str,
    base_dir: Path | None = None,
    error: type[ConfigError] = ConfigError,
    example: str = "Class",
) -> Any:
    """The object named ``"module:attr"`` or ``"file.py:attr"`` (a relative file: to
    ``base_dir``, else the current directory); ``label`` starts every error line."""
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        raise error(f"{label}: expected 'package.module:{example}' or 'path/to/file.py:{example}'")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        module = _import_file(path, label, error)
    else:
        module = _import_module(where, label, error)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{label}: {where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
