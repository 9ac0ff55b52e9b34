"""Shared pieces of the typed configuration (``flotilla.core.settings``, re-exported here)."""

from flotilla.core.settings import (
    CONFIG_ERROR_TYPE,
    SIZE_FORMS,
    Settings,
    Size,
    _fail,
    _matching,
    _Model,
    _size_validator,
    fail,
    format_size,
    matching,
    parse_size,
)

__all__ = [
    "CONFIG_ERROR_TYPE",
    "SIZE_FORMS",
    "Settings",
    "Size",
    "_Model",
    "_fail",
    "_matching",
    "_size_validator",
    "fail",
    "format_size",
    "matching",
    "parse_size",
]
