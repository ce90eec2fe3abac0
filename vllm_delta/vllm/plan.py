"""Which versions an update applies, given what the server serves: the successor rule.

A request for version T from a server at S applies the deltas after S on T's chain, in order, in
one pause. If T's chain does not pass through S (T is older, or on another anchor line), or S is
unknown (a server not started with --load-format delta), the update would have to re-anchor:
replay T's whole chain, anchor included, over the live weights. That is refused with 409 unless
the request says `"allow_reanchor": true`, because it silently discards whatever S was. A delta
whose recorded base checksum differs from S's checksum is refused with 409 whatever the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NotSuccessorError
from ..store import DeltaStore


@dataclass
class UpdatePlan:
    target: int
    versions: list[int]  # to stage, in order ([] if the server already serves the target)
    reanchor: bool
    nnz: int = 0  # changed elements the applied versions record (anchors: all elements)
    bytes: int = 0  # size of the applied version files


def plan_update(
    store: DeltaStore,
    served_version: int | None,
    served_checksum: str | None,
    requested: int | str,
    allow_reanchor: bool = False,
) -> UpdatePlan:
    target = store.resolve(requested)
    if served_version == target:
        return UpdatePlan(target, [], False)
    records = store.plan(served_version, target)
    first = records[0]
    successor = served_version is not None and first.kind == "delta" and first.base == served_version
    if successor and first.base_checksum and served_checksum and first.base_checksum != served_checksum:
        raise NotSuccessorError(
            f"delta {first.version} expects base checksum {first.base_checksum}, the served version "
            f"{served_version} has {served_checksum}",
            version=first.version,
        )
    if not successor and not allow_reanchor:
        if served_version is None:
            why = "the served version is unknown (the server was not started with --load-format delta)"
        elif target < served_version:
            why = f"it is older than the served version {served_version}"
        else:
            why = f"its chain does not pass through the served version {served_version}"
        raise NotSuccessorError(
            f'version {target} is not a successor: {why}; send "allow_reanchor": true to replay its whole chain',
            version=target,
        )
    return UpdatePlan(
        target,
        [r.version for r in records],
        not successor,
        nnz=sum(r.nnz for r in records),
        bytes=sum(r.bytes for r in records),
    )
