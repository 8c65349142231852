"""collectives.futex: sleeping on a word of shared memory (serial)."""
import mmap
import threading
import time

import numpy as np
import pytest

from collectives.channels import futex

pytestmark = pytest.mark.skipif(not futex.available(), reason="futex needs Linux x86-64/AArch64")


@pytest.fixture
def word():
    """An int64 in a shared anonymous mapping (freed with its last view), and its address."""
    raw = np.frombuffer(mmap.mmap(-1, 4096), dtype=np.int64)
    return raw, raw.ctypes.data


def test_wait_returns_at_once_when_the_word_already_changed(word):
    raw, address = word
    raw[0] = 7
    start = time.monotonic()
    futex.wait(address, 6, timeout=5.0)
    assert time.monotonic() - start < 1.0


def test_wait_sleeps_until_the_timeout_when_nobody_writes(word):
    raw, address = word
    start = time.monotonic()
    futex.wait(address, 0, timeout=0.05)
    assert 0.04 <= time.monotonic() - start < 2.0


def test_a_writer_wakes_the_sleeper_long_before_its_timeout(word):
    raw, address = word
    woke = []

    def sleeper():
        start = time.monotonic()
        while raw[0] == 0:
            futex.wait(address, 0, timeout=10.0)
        woke.append(time.monotonic() - start)

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.05)  # the sleeper is in the kernel by now
    raw[0] = 1
    futex.wake(address)
    thread.join(timeout=5.0)
    assert woke and woke[0] < 5.0


def test_only_the_low_32_bits_are_compared(word):
    """The futex word of a little-endian int64 is its low half: a counter past
    2**32 still compares right (it would sleep 5 s if it did not)."""
    raw, address = word
    raw[0] = (1 << 32) + 5
    start = time.monotonic()
    futex.wait(address, (1 << 32) + 4, timeout=5.0)
    assert time.monotonic() - start < 1.0
    futex.wait(address, (1 << 32) + 5, timeout=0.01)  # equal: sleeps, times out
