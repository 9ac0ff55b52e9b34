"""What a pipeline stage reports at its end, as its host keeps it (``roles/stage_host.py``): its
weights in chunks (``stage_weights``) and its result (``stage_result``), written into the run
directory as ``stage<i>.safetensors`` and ``stage<i>.json``.

A stage sends each report again when the answer does not come (``roles/stage_link.py``), so a
repeat is answered as the first: a chunk received already, byte for byte, changes nothing
(``Upload.add``), and the same holder's same result (token, weights digest, body) is
acknowledged again; a different result from a process that reported one is refused.  Not
thread-safe: the host calls it under its lock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flotilla.core.atomic_io import atomic_write_bytes, atomic_write_json
from flotilla.core.errors import RemoteError
from flotilla.roles.stage_host_protocol import Upload

__all__ = ["StageReports"]


class StageReports:
    """The weights uploads and results of one attempt's stage processes (module doc)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._uploads: dict[int, Upload] = {}
        self._reported: dict[int, tuple[str, str | None, Any]] = {}  # process -> (token, digest, result)

    @property
    def results(self) -> set[int]:
        """The stage processes whose result is in."""
        return set(self._reported)

    def forget(self, index: int) -> None:
        """Process ``index`` goes to a newcomer: its upload and result are not the newcomer's."""
        self._reported.pop(index, None)
        self._uploads.pop(index, None)

    def weights(self, index: int, body: dict[str, Any], tensors: list[Any]) -> dict[str, Any]:
        offset, total = int(body["offset"]), int(body["total"])
        up = self._uploads.get(index)
        if up is None or offset == 0:
            up = self._uploads[index] = Upload(total)
        return {"received": up.add(offset, total, tensors[0] if tensors else None)}

    def result(self, index: int, body: dict[str, Any]) -> dict[str, Any]:
        digest = body.get("weights_sha256")
        report = (str(body["token"]), digest, body["result"])
        prior = self._reported.get(index)
        if prior == report:
            return {"ok": True}  # (sent again: its first answer was lost)
        if prior is not None:
            raise RemoteError("bad_request", "stage_result: this stage process has reported its result")
        if digest is not None:
            up = self._uploads.pop(index, None)
            if up is None or not up.whole(digest):
                raise RemoteError("bad_request", "stage_result: the weights did not arrive whole")
            atomic_write_bytes(self.run_dir / f"stage{index}.safetensors", bytes(up.data))
        atomic_write_json(self.run_dir / f"stage{index}.json", body["result"])
        self._reported[index] = report
        return {"ok": True}
