"""Which ranks' processes are gone: the name a lost connection does not give.

Why: a rank killed outright (SIGKILL, the OOM killer) reports nothing; its peers see only a
closed connection, whose error names a socket address, not a rank. At W = 2 the peer is obvious;
at W > 2 the rank that lost the connection may not even talk to the dead one (it lost a rank that
failed *because* of the dead one). So every rank publishes its host and process id in the job's
store when its groups are built (:func:`publish`), and a rank that lost a connection with no
failure reported asks which of the ranks on its own host have exited (:func:`gone`): a check of
the process table, no waiting and no message to anyone. Ranks on other hosts cannot be checked
this way and are not named.
"""

from __future__ import annotations

import os
import socket
from contextlib import suppress
from pathlib import Path
from typing import Any

_KEY = "lightning_gsched/process/"


def publish(store: Any, rank: int) -> None:
    """Record this process as ``rank``'s (host and pid) in the job's store; never raises."""
    with suppress(Exception):
        if store is not None:
            store.set(_KEY + str(rank), f"{socket.gethostname()} {os.getpid()}")


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process: it exists and is not a zombie (a killed child that
    its launcher has not reaped yet is one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    with suppress(OSError, IndexError):
        # /proc/<pid>/stat: "pid (comm) state ...": comm may hold spaces and parentheses
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    return True


def gone(store: Any, world_size: int) -> list[tuple[int, int]]:
    """``(rank, pid)`` of every rank of ``world_size`` published on this host whose process has
    exited, in rank order; ranks elsewhere or never published are left out (never raises)."""
    if store is None:
        return []
    host, found = socket.gethostname(), []
    for rank in range(world_size):
        with suppress(Exception):
            if not store.check([_KEY + str(rank)]):
                continue
            where, pid = store.get(_KEY + str(rank)).decode().rsplit(" ", 1)
            if where == host and int(pid) != os.getpid() and not _running(int(pid)):
                found.append((rank, int(pid)))
    return found


def gone_text(store: Any, world_size: int) -> str:
    """A sentence naming the exited ranks for a fault message, or "" when none is known."""
    ranks = gone(store, world_size)
    if not ranks:
        return ""
    named = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in ranks)
    verb = "has" if len(ranks) == 1 else "have"
    return (f"{named} {verb} exited without reporting a failure (killed: SIGKILL, the OOM "
            "killer, or an exit outside Python; see the system log)")
