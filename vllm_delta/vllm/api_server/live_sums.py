"""The live sums: the value (the checksum the API process keeps current, so that GET /v1/delta/status never
calls a worker). When they are recomputed and what is done with a recomputation is live_checks.py's
(`LiveChecks`, their one writer).

The live per-tensor sums over all ranks (checksums.py: Σ w(p)(bits + 1) per Hugging Face tensor) are

    recomputed   a full pass over every rank's live parameters: at start-up, on
                 GET /v1/delta/status?verify=true, by the background audit (`delta_audit_s`)
    patched      at every patch, by adding the ranks' staged partials Σ w(p)(new − old) over the
                 changed elements (computed by the workers while staging, O(changed elements); O(tensors
                 touched) here). When the sums were the served version's recorded ones, the result is
                 exactly the target header's: that is what the verification before the patch checked
    forgotten    when the workers report a version no patch of this process made (an update past the
                 plugin): unknown until the next recomputation

A recomputation is compared with what was kept current: a tensor whose sums differ was written behind
the plugin's back since the last recomputation; a live checksum that is not the served version's
recorded one means the weights are not that version's. Either is a failed `Verification`.

Data parallelism: each engine core holds its own copy of the weights (or, MoE engines, one copy
split among them), so a recomputation has one set of sums per copy (`LiveCopy`). The sums kept
current are one set for all of them: every update is verified against each copy with the same
served sums and target, so every copy's sums move by the same partials. A recomputation compares
every copy with them; a copy that differs (from them or from the others) fails the verification,
naming its engines and tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ...checksums import Sums, add_sums, combine, to_hex
from ...server_api import MISMATCHED_NAMES, EngineChecksum, Verification, VerifyTrigger
from ..shared.messages import WorkerStatus
from ..shared.two_phase import worlds


@dataclass(frozen=True)
class LiveCopy:
    """The live per-tensor sums of one copy of the weights: the ranks of one world, on these engines."""

    engines: list[int]
    sums: Sums

    @property
    def checksum(self) -> str:
        return to_hex(combine(self.sums.items()))


@dataclass
class LiveSums:
    """The live sums over all ranks as last recomputed or kept current, and the version they are of."""

    version: int | None = None
    sums: Sums | None = None
    as_of: float | None = None  # unix time of the recomputation or patch that established them
    _checksum: str | None = None

    def known_for(self, version: int | None) -> bool:
        return self.sums is not None and self.version == version

    @property
    def checksum(self) -> str | None:
        """The whole-model checksum of the sums (16 hex digits), None while unknown."""
        if self._checksum is None and self.sums is not None:
            self._checksum = to_hex(combine(self.sums.items()))
        return self._checksum

    def _set(self, version: int | None, sums: Sums | None) -> None:
        self.version, self.sums, self._checksum = version, sums, None
        self.as_of = time.time() if sums is not None else None

    def applied(self, served: int | None, target: int, partials: list[Sums], target_sums: Sums) -> None:
        """A patch from `served` to `target` whose ranks staged `partials`: the sums kept current plus the
        partials when they were known for `served`, else the target's recorded sums (what the patch's
        verification established, given the served version's recorded sums)."""
        if self.known_for(served):
            assert self.sums is not None
            self._set(target, add_sums([self.sums, *partials]))
        else:
            self._set(target, dict(target_sums))

    def forget(self) -> None:
        self._set(None, None)

    def recomputed(
        self,
        version: int | None,
        copies: Sums | list[LiveCopy],
        *,
        version_checksum: str | None,
        trigger: VerifyTrigger,
        ms: float,
    ) -> Verification:
        """A full recomputation of the live sums (of every copy of the weights: one per world), compared with
        those kept current (and the served version's recorded checksum), then kept: those of the first copy
        that is not the served version's, else the first copy's."""
        if not isinstance(copies, list):
            copies = [LiveCopy([0], copies)]
        expected = self.checksum if self.known_for(version) else None
        kept = self.sums if self.sums is not None and self.known_for(version) else copies[0].sums
        mismatched = sorted(
            {n for c in copies for n in c.sums.keys() | kept.keys() if c.sums.get(n, 0) != kept.get(n, 0)}
        )
        checksums = [c.checksum for c in copies]
        off = [i for i, c in enumerate(checksums) if version_checksum is not None and c != version_checksum]
        chosen = copies[off[0] if off else 0]
        self._set(version, dict(chosen.sums))
        checksum = self.checksum
        assert checksum is not None
        ok = not mismatched and not off
        return Verification(
            trigger=trigger,
            time=time.time(),
            version=version,
            ok=ok,
            checksum=checksum,
            expected=expected,
            mismatched=mismatched[:MISMATCHED_NAMES],
            ms=ms,
            engines=(
                [EngineChecksum(e, c.checksum) for c in copies for e in c.engines]
                if len(copies) > 1 or copies[0].engines != [0]
                else None
            ),
        )


def live_copies(ranks: list[WorkerStatus], engines: int) -> list[LiveCopy] | None:
    """The live sums of every world in `ranks` (every rank's status in (engine, rank) order), each with the
    engines it spans; None if a rank did not report its share."""
    if any(r.live_sums is None for r in ranks):
        return None
    per_engine = len(ranks) // max(engines, 1)
    return [
        LiveCopy(
            engines=sorted({i // per_engine for i in world}) if engines > 1 else [0],
            sums=add_sums(ranks[i].live_sums or {} for i in world),
        )
        for world in worlds(ranks)
    ]
