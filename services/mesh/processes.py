"""What every child process the mesh starts does first."""

from __future__ import annotations

import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child about to run: ask Linux to SIGTERM it when its parent dies, so nothing the mesh
    started outlives it, and give it a process group of its own, so that Ctrl-C reaches only the
    launcher, which stops its children in order."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setpgrp()
