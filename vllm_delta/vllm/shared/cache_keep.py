"""What a server's download cache keeps after an update succeeded (or a prefetch staged): one policy for
both paths that update a server, the API process (api_server/) and the weight-transfer backend
(worker/backend.py).

    keep   the served version's chain (its anchor .. the served version), the versions staged
           for the next update (a prefetch), and every version newer than the served one: where
           several servers share a host's cache folder, a newer copy is the one a peer that got
           ahead is staging now (and this server's next update)
    drop   every other (older) version's copies, and a dead process's partial downloads
    cap    then `cache_max_bytes`: the oldest copies beyond it, never the staged ones

A local store has no cache: nothing to do. Pruning never fails an update: the callers log a failure
and the next update prunes again. (A staging that failed an integrity check drops its versions'
copies itself: `TwoPhaseUpdate.drop_cached`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...store import DeltaStore

PRUNE_FAILED = "vllm-delta: pruning the download cache failed: %s"  # how the callers log a failure


class CacheKeeper:
    """Prunes one store's download cache after updates; remembers the served version's chain, so that
    an update along it does not read the records again."""

    def __init__(self, store: DeltaStore, max_bytes: int | None) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self._chain: list[int] | None = None  # the served version's chain, anchor first

    def applied(self, versions: Sequence[int], reanchor: bool) -> None:
        """An update applied `versions` in order: they extend the served chain (or are it: a re-anchor)."""
        if reanchor:
            self._chain = list(versions)
        elif self._chain is not None:
            self._chain += versions

    def undone(self, target: int) -> None:
        """A backward update went back to `target`, on the served chain: the chain ends there now (the
        versions undone stay in the cache, newer than the served one)."""
        chain = self._chain
        self._chain = chain[: chain.index(target) + 1] if chain is not None and target in chain else None

    def prune(self, served: int, staged: Sequence[int] = ()) -> None:
        """Keep `served`'s chain and the `staged` versions, drop the rest, then apply the size cap.
        Raises what the store raised (the caller logs it: PRUNE_FAILED)."""
        if self.store.is_local:
            return
        if self._chain is None or self._chain[-1] != served:
            self._chain = [r.version for r in self.store.chain(served)]
        keep = set(self._chain) | set(staged)
        self.store.cache.prune(keep, max_bytes=self.max_bytes, protect=set(staged), newer_than=served)
