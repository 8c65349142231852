"""Sleeping until a word of shared memory changes: Linux futexes through ctypes.

When a node runs more ranks than it has cores, a rank waiting for a peer in
shared memory must give its core away. Spinning steals the core from the
peer it waits for; ``sched_yield`` hands the core over but, under Linux's
EEVDF scheduler (6.6 and later), pushes the yielding task's deadline one
slice further on every call, so a rank that waited long is scheduled last
at the very moment it holds the data its neighbour needs. A futex sleeps in
the kernel and is woken by the writer: no deadline penalty, no spinning.

``wait(address, expected, timeout)`` returns when the 32-bit word at
``address`` no longer equals ``expected``, when woken, or after ``timeout``
seconds, whichever comes first (it may also return early: callers re-check
their condition). ``wake(address)`` wakes every waiter on the word. The
kernel compares the word under its own lock, so a writer that stores and
then calls ``wake`` can never leave a waiter asleep (no lost wake-up), as
long as the waiter passes the value it saw before deciding to wait.

Available on Linux x86-64 and AArch64; :func:`available` says so, and
callers fall back to polling elsewhere.
"""
from __future__ import annotations

import ctypes
import platform
import sys

__all__ = ["available", "wait", "wake"]

_SYSCALL_NUMBERS = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the word is in a shared window
_WAKE_ALL = 1 << 30


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load():
    number = _SYSCALL_NUMBERS.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or number is None:
        return None, None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None, None
    syscall.restype = ctypes.c_long
    # syscall() is variadic: without argtypes ctypes would pass the 64-bit
    # address as a C int and cut it.
    syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return syscall, number


_SYSCALL, _NUMBER = _load()


def available() -> bool:
    """True when :func:`wait` really sleeps (Linux on x86-64 or AArch64)."""
    return _SYSCALL is not None


def _as_int32(value: int) -> int:
    """The low 32 bits of ``value`` as a C int (the futex word of a little-endian int64)."""
    low = value & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


def wait(address: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``expected`` (its low
    32 bits), at most ``timeout`` seconds. Spurious returns are possible."""
    seconds = int(timeout)
    spec = _Timespec(seconds, int((timeout - seconds) * 1e9))
    _SYSCALL(_NUMBER, address, _FUTEX_WAIT, _as_int32(expected), ctypes.addressof(spec),
             None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping in :func:`wait` on the word at ``address``."""
    _SYSCALL(_NUMBER, address, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
