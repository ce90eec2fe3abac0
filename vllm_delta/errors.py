"""Exceptions. Every message names the version (and tensor, where there is one).

The HTTP layer maps them to status codes through `http_status`; nothing else should need to
know which is which.
"""

from __future__ import annotations

import reprlib

_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 8
_REPR.maxlevel = 2


def short(value: object) -> str:
    """repr() of client or file input for an error message: bounded length and depth (a 10 MB field is
    quoted as its first few dozen characters)."""
    return _REPR.repr(value)


class DeltaError(Exception):
    """Base class of every error vllm-delta raises on purpose."""

    http_status = 500

    def __init__(self, message: str, *, version: int | None = None, tensor: str | None = None):
        where = []
        if version is not None:
            where.append(f"version {version}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.version = version
        self.tensor = tensor


class VersionNotFoundError(DeltaError):
    """The store holds no committed version with that number."""

    http_status = 404


class VersionExistsError(DeltaError):
    """A version number is written once; publishing it again is refused."""

    http_status = 409


class NotSuccessorError(DeltaError):
    """The delta's base is not what the reader holds (version or base checksum differ)."""

    http_status = 409


class MissingBaseError(DeltaError):
    """A delta's base (or an anchor below it) is not in the store."""

    http_status = 404


class IntegrityError(DeltaError):
    """The bytes can't be trusted: corrupt, truncated, inconsistent or failing a checksum."""

    http_status = 422


class FormatError(IntegrityError):
    """Not a readable vllm-delta version file (truncated, corrupt header, unknown format version)."""


class CodecError(IntegrityError):
    """Unknown codec, or a payload the codec cannot decode."""


class ShapeMismatchError(IntegrityError):
    """A tensor's shape or dtype differs from what the file or the base says."""


class PositionError(IntegrityError):
    """Positions out of range, unsorted or duplicated."""


class ChecksumMismatchError(IntegrityError):
    """Reconstructed weights do not match the checksum the publisher recorded."""


class UnsupportedModelError(DeltaError):
    """The target model can't take in-place updates (quantized parameters, unknown tensors...)."""

    http_status = 422


class InflightRefusedError(DeltaError):
    """An in-flight update (mode "inflight") cannot be made safe on this server; the message says why."""

    http_status = 409


class EngineSleepingError(DeltaError):
    """The engine sleeps (vLLM's sleep mode, `/sleep`): its weights are offloaded or discarded, and an update
    then would read and write memory that is not there (vLLM #57853: the engine dies). Wake it first."""

    http_status = 409


class EplbRefusedError(DeltaError):
    """The server runs with expert-parallel load balancing (`--enable-eplb`): vLLM moves expert weights
    between physical slots at run time, the plugin's layout is probed once, so no update is taken."""

    http_status = 409


class StalenessTimeoutError(DeltaError):
    """`Publisher(max_staleness=K, min_replicas=R)`: too few replicas caught up in time."""

    http_status = 504


class BadRequestError(DeltaError):
    """A malformed request: not JSON, nested too deeply, unknown or invalid fields."""

    http_status = 400


class RequestTooLargeError(BadRequestError):
    """A request body over the size limit (refused before it is read, where Content-Length says so)."""

    http_status = 413


class UnsupportedMediaTypeError(BadRequestError):
    """A request body that says it is not JSON (Content-Type); a missing Content-Type is accepted."""

    http_status = 415


class StoreTimeoutError(DeltaError):
    """A store operation (or a whole update) ran past its deadline: the store is slow or frozen."""

    http_status = 504


class StoreUnavailableError(DeltaError):
    """The store could not be reached (connection refused, reset, DNS): try again once it is back."""

    http_status = 503


class StoreAccessError(DeltaError):
    """The store refuses the operation: no write access (read-only credentials, a read-only mount)."""

    http_status = 403


class SignatureError(DeltaError):
    """A version this server may not take: not signed by a key of its `delta_trusted_keys`, a signature
    that does not parse or does not verify over the version's record (signed over other checksums, or
    the signature of another version or run). Nothing is staged or applied (403)."""

    http_status = 403


class KeyFileError(DeltaError, ValueError):
    """A key file (a Publisher's `signing_key`, a server's `delta_trusted_keys`) that is not a usable
    Ed25519 key; the message names the file."""


class MirrorLeaseError(DeltaError):
    """Another mirror holds the destination store's lease (`vllm_delta.mirror`): two mirrors must not
    write one store. The message names the holder and its last heartbeat."""

    http_status = 409


class CacheError(DeltaError):
    """The local download cache can't be written (read-only, full, missing): nothing was applied."""

    http_status = 503


class WeightVersionBehindError(DeltaError):
    """A request's `min_weight_version` is above the version the server serves, and the server did not
    reach it within its wait (409). Nothing was generated."""

    http_status = 409

    def __init__(self, message: str, *, served: int | None, required: int):
        super().__init__(message)
        self.served = served
        self.required = required


class VersionBoundConflictError(DeltaError):
    """An update to an older version while running requests need a newer one (their
    `min_weight_version`): refused (409) so that no request runs on weights older than its bound."""

    http_status = 409


class ServerBusyError(DeltaError):
    """The server could not do it now (an update holds the lock): try again (503)."""

    http_status = 503


class PublishError(DeltaError):
    """A background upload failed; the message names the version."""


class RankTimeoutError(PublishError):
    """Ranks of a sharded publisher did not arrive at an exchange within the deadline
    (`ShardingOptions.timeout_s`): a rank died, hangs, or publishes on another schedule."""

    def __init__(self, message: str, *, missing: list[int]):
        super().__init__(message)
        self.missing = missing


class ShardingError(DeltaError, ValueError):
    """The ranks of a sharded publisher disagree (version number, tensor set, shard layout). Raised
    on every rank, naming the tensor and the ranks; nothing of the version is published."""


class PatchFailedError(DeltaError):
    """An update's patch (its in-place writes) failed on some rank and every rank was rolled back (500):
    nothing changed."""

    wire_type = "CommitFailedError"  # the name HTTP answers and RPC replies carry (clients match on it)


CommitFailedError = PatchFailedError  # its name before issue 37 (the server's writes are a patch, not a commit)


class RollbackFailedError(DeltaError):
    """A patch failed and so did its rollback: the ranks may hold different weights (500). The engine
    stops scheduling and refuses later updates: restart the server."""


class EnginesDisagreeError(DeltaError):
    """The data-parallel engine cores of one server serve different versions (a rollback that failed, or a
    write past the plugin): updates are refused until the server is restarted."""


class InjectedFaultError(DeltaError):
    """The test hook's fault ("fault": "patch@<rank>" with VLLM_DELTA_TEST_FAULTS=1), after the writes."""


class WorkerError(DeltaError):
    """An error a worker rank reported across the RPC boundary, with the HTTP status it maps to."""

    def __init__(self, message: str, *, status: int = 500, rank: int | str | None = None, type_name: str = "Error"):
        # rank: a worker rank's number, or who answered in words ("engine 1 rank 0", "engine 1")
        who = f"rank {rank}" if isinstance(rank, int) else rank
        super().__init__(f"{who}: {type_name}: {message}" if who is not None else f"{type_name}: {message}")
        self.http_status = status
        self.rank = rank
        self.type_name = type_name


def error_type(error: BaseException | type[BaseException]) -> str:
    """The name an error goes by outside this process (an HTTP answer's `error.type`, an RPC reply's
    `type`): its class's, or the name a renamed class keeps for the clients that match on it
    (`wire_type`, set on that class itself)."""
    cls = error if isinstance(error, type) else type(error)
    wire = cls.__dict__.get("wire_type")
    return wire if isinstance(wire, str) else cls.__name__


def http_status(exc: BaseException) -> int:
    """The HTTP status an exception answers with: its class's for our errors, 500 for anything else."""
    return getattr(exc, "http_status", 500) if isinstance(exc, DeltaError) else 500
