"""What a server with `delta_trusted_keys` takes: versions signed by a trusted key, of the run it serves.

Checked before anything is staged, on every record an update or a start-up would apply (the plan's
records, a start-up's whole chain): each one signed by a trusted key over its own run, number, base and
checksums (store/signed.py), and all of one run: the run of the version the server serves, learnt
from the store before its first update (the served version's record, when its checksum is the served
one) or, for a server that serves no store version yet, from the first plan it takes. So a version signed for another
run of the same key (another store, or this store before it was rewritten) is refused like an unsigned
one: `SignatureError` (403), naming the version and the signature, nothing staged or applied. A
follower skips such a version, and every version built on it, until an anchor it can take, as it
skips a corrupt one (follower.py).

vLLM-free (like plan.py): the API process's service, the loader and the weight-transfer backend use it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from ...errors import SignatureError, VersionNotFoundError
from ...signatures import TrustedKeys
from ...store import DeltaStore, VersionRecord
from ...store.signed import check_signed

log = logging.getLogger(__name__)


class TrustPolicy:
    """The trusted keys of one server process, and the run it serves (pinned once known)."""

    def __init__(self, keys: TrustedKeys):
        self.keys = keys
        self.run: str | None = None
        self._learnt = False
        self._lock = threading.Lock()

    @classmethod
    def of(cls, keys: TrustedKeys | None) -> TrustPolicy | None:
        """The policy of a server with these trusted keys; None (no checks) without keys."""
        return None if keys is None else cls(keys)

    def check(self, records: Sequence[VersionRecord]) -> str | None:
        """Every record signed by a trusted key and of the pinned run (or, none pinned yet, of one run,
        which is pinned). Returns the run; SignatureError naming the first record refused."""
        signers = [check_signed(rec, self.keys) for rec in records]
        with self._lock:
            run = self.run
            for rec in records:
                if run is None:
                    run = rec.run
                elif rec.run != run:
                    raise SignatureError(
                        f"signature check failed: it is signed for run {rec.run}, and this server serves run {run} "
                        "(a version of another run, or of this store before it was rewritten)",
                        version=rec.version,
                    )
            if records and self.run is None:
                log.info("vllm-delta: serving run %s (versions signed by %s)", run, ", ".join(sorted(set(signers))))
                self.run = run
            return run

    def learn(self, store: DeltaStore, served_version: int | None, served_checksum: str | None) -> None:
        """Before the first plan: pin the run of the served version from its record in the store (when the
        record's checksum is the served one and its signature is trusted). Nothing to learn (no served
        version, its record gone): the first plan pins it."""
        with self._lock:
            if self._learnt or self.run is not None or served_version is None:
                return
        try:
            rec = store.record(served_version, fresh=True)
        except VersionNotFoundError:
            rec = None
        with self._lock:
            self._learnt = True
        if rec is not None and served_checksum is not None and rec.checksum == served_checksum:
            try:
                self.check([rec])
            except SignatureError as exc:  # not ours to refuse here: the next plan pins the run
                log.warning("vllm-delta: the served version's record does not give this server its run: %s", exc)


def check_start(keys: TrustedKeys | None, records: Sequence[VersionRecord], where: str) -> None:
    """A start-up at `records[-1]` (its chain, anchor first) with `keys` trusted: SignatureError saying the
    server does not start, naming the version and the store, when any record is refused."""
    if keys is None:
        return
    try:
        TrustPolicy(keys).check(records)
    except SignatureError as exc:
        raise SignatureError(
            f"the server does not start at version {records[-1].version} of {where}: "
            f"its chain holds a version delta_trusted_keys refuses: {exc}"
        ) from None


__all__ = ["TrustPolicy", "check_start"]
