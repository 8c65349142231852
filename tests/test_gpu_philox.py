"""The GPU noise stream's host side: Philox4x64-10 is numpy's, the normals are normal."""
import numpy as np
import pytest

from kernels.common import philox
from normality import assert_standard_normal


@pytest.mark.parametrize("key", [(0, 0), (12345, 678), (2**64 - 5, 2**63 + 1)])
@pytest.mark.parametrize("counter", [0, 5, 2**64 - 2, 3 * 2**64 + 7])
def test_blocks_are_numpys_philox_bit_for_bit(key, counter):
    # numpy.random.Philox(counter=c) outputs block c + 1 first.
    before = (counter - 1) % 2**256
    words = [(before >> (64 * i)) & philox.MASK64 for i in range(4)]
    generator = np.random.Philox(key=np.array(key, dtype=np.uint64),
                                 counter=np.array(words, dtype=np.uint64))
    want = generator.random_raw(12).reshape(3, 4)
    assert np.array_equal(philox.philox_blocks(counter, 3, key), want)


def test_round_keys_are_the_weyl_sequence():
    table = philox.round_keys((2**64 - 1, 7))
    assert table.shape == (philox.ROUNDS, 2) and table.dtype == np.uint64
    for r in range(philox.ROUNDS):
        assert int(table[r, 0]) == (2**64 - 1 + r * philox.W0) % 2**64
        assert int(table[r, 1]) == (7 + r * philox.W1) % 2**64


def test_uniforms_are_in_the_open_closed_unit_interval():
    u = philox.uniforms(np.array([0, 2**64 - 1, 2**11 - 1], dtype=np.uint64))
    assert u[0] == 2.0 ** -53 and u[1] == 1.0 and u[2] == 2.0 ** -53


def test_normals_are_standard_normal():
    """Seeded (no flakes): a wrong transform fails by hundreds of standard errors."""
    assert_standard_normal(philox.normals(0, 1_000_000, (3, 4)), tail_at=4.0)


def test_add_reference_rounds_once_and_advances_by_blocks():
    buf = np.arange(10, dtype=np.float32)
    z = philox.normals(7, 10, (1, 2))
    nxt = philox.add_reference(buf, 0.5, 7, (1, 2))
    assert nxt == 7 + 3
    assert np.array_equal(buf, (np.arange(10) + 0.5 * z).astype(np.float32))


def test_state_takes_blocks_round_trips_and_refuses_other_layouts():
    state = philox.PhiloxState(np.random.SeedSequence(1))
    other = philox.PhiloxState(np.random.SeedSequence(2))
    assert state.key != other.key
    assert state.take(10) == 0 and state.take(1) == 3 and state.counter == 4
    saved = state.get_state()
    assert len(saved) == philox.STATE_WORDS
    state.take(2**70)
    state.set_state(saved)
    assert state.counter == 4 and state.get_state() == saved
    for bad in ([1, 2, 3], [0] * 32, [-1, 0, 0, 0], [2**64, 0, 0, 0]):
        with pytest.raises(ValueError, match="4 64-bit words"):
            state.set_state(bad)
