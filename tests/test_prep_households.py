"""preprocessing.households: the keyed household keys, against AES's published vectors."""
import hashlib

import numpy as np

from preprocessing import households


def test_the_block_cipher_is_aes_256_by_its_published_vector(monkeypatch):
    """FIPS 197 appendix C.3: key 00..1f, plaintext 00112233..ff. The key
    derivation is bypassed to check the cipher and the block layout alone."""
    monkeypatch.setattr(households, "aes_key", lambda secret: bytes(range(32)))
    monkeypatch.setattr(households, "_TAG", int.from_bytes(bytes.fromhex("8899aabbccddeeff"),
                                                           "little"))
    ids = np.array([int.from_bytes(bytes.fromhex("0011223344556677"), "little", signed=True)])
    got = households.household_keys(ids, b"ignored")
    want = bytes.fromhex("8ea2b7ca516745bfeafc49904b496089")[:8]
    assert got[0] == int.from_bytes(want, "little")


def test_equal_ids_share_a_key_and_the_secret_decides_them():
    rng = np.random.default_rng(0)
    ids = rng.integers(-2**62, 2**62, 2000)
    ids = np.concatenate([ids, ids[:500]])
    a = households.household_keys(ids, b"s" * 32)
    assert a.dtype == np.uint64 and np.array_equal(a[2000:], a[:500])
    assert len(np.unique(a[:2000])) == len(np.unique(ids[:2000]))
    assert not np.array_equal(a, households.household_keys(ids, b"t" * 32))
    assert np.array_equal(a, households.household_keys(ids.copy(), b"s" * 32))
    # any secret length gives an AES-256 key: SHA-256 of the personalisation and it
    assert households.aes_key(b"s" * 16) == hashlib.sha256(b"mpidp-household" + b"s" * 16).digest()
    assert households.household_keys(ids[:3], b"s" * 16).shape == (3,)
    assert households.household_keys(np.zeros(0, np.int64), b"s" * 32).shape == (0,)


def test_a_drawn_secret_stays_drawn_across_the_broadcast():
    """Rank 0 draws the secret and broadcasts the settings (pickled): every
    rank must see it as drawn, so that none keys the split with it (the
    ranks would then disagree on the order), and a given one as given."""
    import pickle

    drawn = households.new_secret()
    again = pickle.loads(pickle.dumps(drawn, protocol=pickle.HIGHEST_PROTOCOL))
    assert isinstance(again, households.DrawnSecret) and again == drawn
    assert households.order_key(again, 0) is None
    assert households.aes_key(again) == households.aes_key(bytes(drawn))  # keys as bytes
    given = pickle.loads(pickle.dumps(bytes(drawn)))
    assert households.order_key(given, 0) is not None
