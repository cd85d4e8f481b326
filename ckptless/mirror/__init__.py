"""ckptless.mirror: continuous peer mirroring of each rank's state image (Gemini-style).

Public API:

* :func:`compute_placement` / :class:`Placement` - who holds whose image (pure).
* :class:`MirrorConfig` - validated settings.
* :class:`PeerStore` - double-buffered replicas held for other ranks (optionally in /dev/shm);
  :meth:`PeerStore.verified_replicas` / :meth:`PeerStore.drop` for at-rest integrity.
* :func:`register_owner` / :func:`cleanup_job` / :func:`cleanup_stale` - node-local /dev/shm
  file lifetime (called by the node agent).
* :class:`MirrorEngine` - background rounds on a dedicated process group, buffer pool, commits;
  ``submit(..., pairs=...)`` for partial rounds after a recovery.
* :func:`pairs_to_send` / :data:`MISSING` - which (owner, holder) pairs a partial round moves (pure).
* :func:`committed_version` / :func:`decide` - the commit rule as pure functions.
"""

from ckptless.mirror.commit import RoundOutcome, committed_version, decide
from ckptless.mirror.config import MirrorConfig
from ckptless.mirror.mirror import MirrorEngine, RoundStats
from ckptless.mirror.partial import MISSING, pairs_to_send, placement_pairs
from ckptless.mirror.placement import Placement, compute_placement
from ckptless.mirror.shm import cleanup_job, cleanup_stale, register_owner
from ckptless.mirror.store import AtRest, PeerStore, StaleVersion, StoredImage
from ckptless.mirror.transport import MirrorTransport

__all__ = [
    "MISSING", "AtRest", "MirrorConfig", "MirrorEngine", "MirrorTransport", "PeerStore", "Placement", "RoundOutcome",
    "RoundStats", "StaleVersion", "StoredImage", "cleanup_job", "cleanup_stale", "committed_version",
    "compute_placement", "decide", "pairs_to_send", "placement_pairs", "register_owner",
]
