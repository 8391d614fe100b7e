"""Children that die with their parent (Linux's parent-death signal), even when it is SIGKILLed.

A parent that is SIGKILLed cannot stop its children, and children left running would keep
their ports (the next start fails with the port taken) or, stopped, stay for ever. The kernel
sends the death signal when the parent dies; it survives exec, so a parent arms it in the child
between fork and exec (`arm_in_child`, Popen's preexec_fn) and nothing the child runs first
(importing Python modules can take seconds) is a window where it would be left behind.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def arm_in_child(parent_pid: int):
    """Popen's preexec_fn: the death signal (SIGKILL) armed in the child before it execs; None
    where prctl is missing (not Linux). libc is looked up here, in the parent, so the forked child
    only makes the call. Use only from a parent with no threads (preexec_fn is unsafe with them)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def die_with(parent_pid: int) -> None:
    """The same request, made by the child itself: the second line of defence, for a parent that
    could not arm it (arming twice is harmless)."""
    arm = arm_in_child(parent_pid)
    if arm is not None:
        arm()
