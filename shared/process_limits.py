"""The limits a server process raises for itself at start: open files.

A gateway holds a socket per client connection (a streaming client keeps its one for the
whole answer), a worker one per peer it moves KV with. The soft limit on open files most
Linux systems start a process with (1,024) had the gateway refuse clients past it: accept
fails with EMFILE, and the client sees its connection reset. As vLLM's API server does, each
service raises its soft limit toward the hard one, which only root may raise.
"""

from __future__ import annotations

import resource

from shared.logs import get_logger

log = get_logger(__name__)

OPEN_FILES_WANTED = 65536
# Below this after raising, a busy gateway may still refuse connections: said at start.
OPEN_FILES_LOW = 4096


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft limit on open files to `wanted`, or to the hard limit
    where that is lower (never lowered); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # macOS caps the soft limit below "unlimited"
            log.warning("process.open_files_limit_kept", soft_limit=soft, wanted=target,
                        error=str(exc))
            return soft
        soft = target
    if soft != resource.RLIM_INFINITY and soft < OPEN_FILES_LOW:
        log.warning("process.open_files_limit_low", soft_limit=soft, hard_limit=hard,
                    hint="raise the hard limit (ulimit -Hn, LimitNOFILE=, a pod's runtime): "
                         "each client connection holds one")
    return soft
