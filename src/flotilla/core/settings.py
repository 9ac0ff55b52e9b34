"""Shared pieces of every typed configuration: byte sizes, the frozen base model, error helpers.

They live in ``core`` so that a component below ``config`` (a strategy module in ``sync/``, which
declares its own settings model) can use them; ``flotilla.config.base`` re-exports them.

Custom validators raise ``PydanticCustomError(CONFIG_ERROR_TYPE, "{message}", ctx)`` where ``ctx``
may carry ``field`` (a sub-field of the failing model) so the formatter can name it precisely.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from flotilla.core.errors import ConfigError

CONFIG_ERROR_TYPE = "flotilla_config"

# ---------------------------------------------------------------------------------------- sizes

_SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
SIZE_FORMS = f"an int or a string like '512MiB', '4GiB', '1.5GB', '100kB' (units: {', '.join(_SIZE_UNITS)})"


def parse_size(value: Any) -> int:
    """Return ``value`` as a whole number of bytes: an int, or ``"<number><unit>"``.

    Units are ``B``, decimal ``kB MB GB TB`` and binary ``KiB MiB GiB TiB`` (case-sensitive, so
    the ambiguous ``KB``/``mb`` are refused).  Raises :class:`ConfigError` naming the accepted
    forms.
    """
    if isinstance(value, bool):
        raise ConfigError(f"expected {SIZE_FORMS} (got {value!r})")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    if match is None or match.group(2) not in _SIZE_UNITS | {"": 1}:
        raise ConfigError(f"expected {SIZE_FORMS} (got {value!r})")
    try:
        number = Decimal(match.group(1)) * _SIZE_UNITS.get(match.group(2), 1)
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal literals
        raise ConfigError(f"expected {SIZE_FORMS} (got {value!r})") from None
    if number != number.to_integral_value():
        raise ConfigError(f"{value!r} is not a whole number of bytes")
    return int(number)


def format_size(num_bytes: int) -> str:
    """``num_bytes`` exactly, in the largest unit dividing it (:func:`parse_size` inverts it)."""
    for unit, factor in sorted(_SIZE_UNITS.items(), key=lambda item: -item[1]):
        if num_bytes and factor > 1 and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return f"{num_bytes}B"


def _size_validator(value: Any) -> Any:
    try:
        return parse_size(value)
    except ConfigError as err:
        raise PydanticCustomError(CONFIG_ERROR_TYPE, "{message}", {"message": str(err)}) from None


Size = Annotated[int, BeforeValidator(_size_validator), Field(gt=0, le=2**50)]
"""A positive number of bytes up to 1 PiB, as an int or a size string (see :func:`parse_size`)."""


def fail(message: str, field: str | None = None) -> PydanticCustomError:
    ctx: dict[str, Any] = {"message": message}
    if field is not None:
        ctx["field"] = field
    return PydanticCustomError(CONFIG_ERROR_TYPE, "{message}", ctx)


class Settings(BaseModel):
    """The base of every settings model: unknown keys refused, frozen, finite floats."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def matching(pattern: str, what: str) -> AfterValidator:
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if compiled.fullmatch(value) is None:
            raise fail(f"must be {what} (got {value!r})")
        return value

    return AfterValidator(check)


_Model = Settings  # (the names config/ used before)
_fail = fail
_matching = matching
