"""preprocessing.h5format, the prepared file's contract: what writers store and what
the reader accepts (the engine's DataError messages are tested in test_engine_shard.py)."""
import json

import h5py
import numpy as np
import pytest

from engine.bench import synthetic
from preprocessing import h5format
from preprocessing.errors import PrepError


def test_attributes_are_stored_as_the_contract_says(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        h5format.write_attributes(f.attrs, {**h5format.identity(), "sources": [{"a": 1}],
                                            "drop_counts": {"x": 2}, "seed": 7, "like": None})
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert f.attrs["format"] == h5format.FORMAT
        assert f.attrs["format_version"] == h5format.FORMAT_VERSION
        assert f.attrs["sources"] == '[{"a":1}]' and json.loads(f.attrs["drop_counts"]) == {"x": 2}
        assert f.attrs["seed"] == 7 and "like" not in f.attrs  # None: left out
    assert set(h5format.REQUIRED) <= set(h5format.ATTRIBUTES)


def test_the_reader_describes_a_written_file(tmp_path):
    path = synthetic.write(tmp_path / "d.h5", rows=40, features=5, test_rows=10, n_classes=3)
    info = h5format.read_info(path)
    assert info.rows == {"train": 40, "test": 10}
    assert info.splits == ("train", "test") and not info.has_val  # an older file
    assert (info.n_features, info.n_classes, info.task) == (5, 3, "synthetic")
    assert len(info.feature_names) == 5
    with h5py.File(path, "r") as f:
        assert info.fingerprint == h5format.fingerprint(f.attrs["encoding"])
        for split in h5format.REQUIRED_SPLITS:
            assert f[h5format.x_name(split)].dtype == np.dtype(h5format.X_DTYPE)
            assert f[h5format.y_name(split)].dtype == np.dtype(h5format.Y_DTYPE)


def test_a_bad_file_is_a_format_error_a_user_can_act_on(tmp_path):
    with pytest.raises(h5format.FormatError, match="does not exist") as missing:
        h5format.read_info(str(tmp_path / "missing.h5"))
    assert isinstance(missing.value, PrepError) and missing.value.exit_code == 2
    with pytest.raises(h5format.FormatError, match="is a directory; give the HDF5 file"):
        h5format.read_info(str(tmp_path))
    (tmp_path / "text.h5").write_text("not HDF5")
    with pytest.raises(h5format.FormatError, match=r"text.h5 is not a readable HDF5 file "
                       r"\(.*signature.*\); make it with `mpidp prep`") as text:
        h5format.read_info(str(tmp_path / "text.h5"))
    assert "\n" not in str(text.value)
    bad = synthetic.write(tmp_path / "v.h5", rows=8, features=3, attrs={"format_version": 9})
    with pytest.raises(h5format.FormatError, match=r"format_version=9 is not supported"):
        h5format.read_info(bad)


def _rewritten(path, name, value=None, group=False):
    """``path`` with ``name`` replaced by a dataset of ``value`` or an empty group."""
    with h5py.File(path, "a") as f:
        del f[name]
        if group:
            f.create_group(name)
        else:
            f[name] = value
    return path


def test_a_hand_written_file_of_another_layout_is_a_format_error(tmp_path):
    """What a user writing the file without `mpidp prep` gets wrong: a group where a
    dataset goes (or a dataset where the split's group goes), no feature columns.
    Each was a traceback (AttributeError, ZeroDivisionError) from deep in a reader."""
    def fresh(name, **kw):
        return synthetic.write(tmp_path / name, rows=8, features=3, test_rows=4, **kw)

    cases = [
        (_rewritten(fresh("x.h5"), "train/X", group=True),
         r"missing /train/X or /train/y \(datasets, not groups\)"),
        (_rewritten(fresh("y.h5"), "test/y", group=True), "missing /test/X or /test/y"),
        (_rewritten(fresh("split.h5"), "train", np.zeros(3)), "missing /train/X"),
        (_rewritten(_rewritten(fresh("f0.h5"), "train/X", np.zeros((8, 0), np.float32)),
                    "test/X", np.zeros((4, 0), np.float32)),
         r"/train/X has no feature columns \(shape \(8, 0\)\); a model needs at least one"),
    ]
    households = fresh("keys.h5")
    with h5py.File(households, "r") as f:
        assert f.attrs["format_version"] >= 2 and "train/household" in f
    cases.append((_rewritten(households, "train/household", group=True),
                  "/train/household must be integer .N. like /train/y; found a group"))
    for path, words in cases:
        with pytest.raises(h5format.FormatError, match=words):
            h5format.read_info(str(path))


def test_the_val_split_is_optional_and_checked_when_present(tmp_path):
    path = synthetic.write(tmp_path / "v.h5", rows=40, features=5, test_rows=10, val_rows=6)
    info = h5format.read_info(path)
    assert info.rows == {"train": 40, "val": 6, "test": 10}
    assert info.splits == h5format.SPLITS == ("train", "val", "test") and info.has_val
    assert info.summary()["rows"]["val"] == 6
    with h5py.File(path, "r") as f:  # no new format version: older readers ignore /val
        assert f.attrs["format_version"] == h5format.FORMAT_VERSION
        assert f[h5format.household_name("val")].shape == (6,)
    empty = h5format.read_info(synthetic.write(tmp_path / "e.h5", rows=40, features=5,
                                               val_rows=0))
    assert empty.rows["val"] == 0 and empty.has_val
    for damage, message in ((lambda f: f.__delitem__("val/y"), r"missing /val/X or /val/y"),
                            (lambda f: f.__delitem__("val/household"), r"/val/household is "
                             "missing"),
                            (lambda f: (f.__delitem__("val/X"), f.create_dataset(
                                "val/X", data=np.zeros((6, 4), np.float32))),
                             r"/train/X has 5 features but /val/X has 4")):
        bad = synthetic.write(tmp_path / "bad.h5", rows=40, features=5, val_rows=6)
        with h5py.File(bad, "r+") as f:
            damage(f)
        with pytest.raises(h5format.FormatError, match=message):
            h5format.read_info(bad)


def test_group_columns_are_described_and_checked_in_every_split(tmp_path):
    """/s/groups/NAME with the groups attribute's labels; a file without them
    reads as before (no groups); a listed column missing from a split is refused."""
    shares = {"SEX": {1: 0.5, 2: 0.5}, "RAC1P": {1: 0.8, 2: 0.15, 6: 0.05}}
    path = synthetic.write(tmp_path / "g.h5", rows=40, features=5, test_rows=10, val_rows=6,
                           group_columns=shares)
    info = h5format.read_info(path)
    assert set(info.groups) == {"SEX", "RAC1P"}
    assert info.groups["RAC1P"].labels == {1: "RAC1P 1", 2: "RAC1P 2", 6: "RAC1P 6"}
    with h5py.File(path, "r") as f:
        for split, n in info.rows.items():
            codes = f[h5format.group_name(split, "RAC1P")][:]
            assert codes.shape == (n,) and codes.dtype == np.dtype(h5format.GROUP_DTYPE)
            assert set(codes.tolist()) <= {1, 2, 6}
        assert f.attrs["format_version"] == h5format.FORMAT_VERSION  # no new version
    plain = h5format.read_info(synthetic.write(tmp_path / "p.h5", rows=40, features=5))
    assert plain.groups == {}
    with h5py.File(path, "r+") as f:
        del f[h5format.group_name("val", "SEX")]
    with pytest.raises(h5format.FormatError, match=r"groups lists SEX, but /val/groups/SEX "
                       r"is missing, not integer \[6\]"):
        h5format.read_info(path)
    with h5py.File(path, "r+") as f:
        f.attrs["groups"] = "[1, 2]"
    with pytest.raises(h5format.FormatError, match="attribute groups is not a JSON table"):
        h5format.read_info(path)
