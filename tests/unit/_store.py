"""An in-memory stand-in for the rendezvous store client (``comm/store.py``): the calls the
launchers' instance watches make (``set``, ``check``, ``delete_key``), nothing dialled."""

from __future__ import annotations


class Store:
    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.kv[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.kv.pop(key, None) is not None
