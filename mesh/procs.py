"""Processes of this machine, as files name them: a writer that left a temporary file or a
staging directory behind is either still at work or dead, and only a dead one's leftovers are
litter (checkpoint saves and `data prepare` both sweep theirs)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
