"""The exception hierarchy shared by every layer.

Failure is normal control flow in flotilla: a step is committed or discarded, a call times out,
a peer is rejected.  Each of these has its own exception type so callers can react precisely.
"""


class FlotillaError(Exception):
    """Base class of every error flotilla raises on purpose."""


class OutOfMemory(FlotillaError):
    """A device ran out of memory training this job: not a transient fault, so the job stops (no
    restart, no replacement); its process exits with :data:`EXIT_OUT_OF_MEMORY`."""


EXIT_OUT_OF_MEMORY = 6  # a worker or stage process that ran out of memory (the launcher stops the job)
EXIT_TASK_ERROR = 7  # a pipeline stage whose task raised, under job.on_error: stop (the job stops)


class ConfigError(FlotillaError, ValueError):
    """An invalid configuration; the message names the field and the allowed values."""


class CommError(FlotillaError):
    """A communication failure (either plane)."""


class CallTimeout(CommError):
    """A blocking call did not complete within its timeout."""


class PeerDisconnected(CommError):
    """A call's connection dropped while it waited for the reply: the server's process died
    (``comm/msgplane.py``: clients made with ``fail_on_disconnect``)."""


class RemoteError(CommError):
    """The peer answered a request with an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class MessageRejected(CommError):
    """An incoming message failed authentication, replay, size or schema checks."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class CollectiveError(CommError):
    """A collective (all-reduce, broadcast, send/recv) failed or timed out."""


class StepAborted(FlotillaError):
    """A training step was discarded on every replica (atomic step, SPEC §7)."""


class MembershipChanged(FlotillaError):
    """The membership view changed; the caller must rebuild its group before continuing."""
