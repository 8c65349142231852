"""kernels.files: the one cache-file rule and the one atomic replace every package uses."""
import os

import pytest

from kernels import files


def test_a_cache_file_follows_its_variable_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("MPIDP_TEST_FILE", raising=False)
    assert files.cache_file("x.json", "MPIDP_TEST_FILE") == \
        tmp_path / "home" / ".cache" / "mpidp" / "x.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty: as unset
    assert files.cache_file("x.json", "MPIDP_TEST_FILE").parent == \
        tmp_path / "home" / ".cache" / "mpidp"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert files.cache_file("x.json", "MPIDP_TEST_FILE") == tmp_path / "xdg" / "mpidp" / "x.json"
    monkeypatch.setenv("MPIDP_TEST_FILE", "~/mine.json")
    assert files.cache_file("x.json", "MPIDP_TEST_FILE") == tmp_path / "home" / "mine.json"
    monkeypatch.setenv("MPIDP_TEST_FILE", " None ")
    assert files.cache_file("x.json", "MPIDP_TEST_FILE") is None


def test_the_allreduce_tuning_file_follows_the_rule(tmp_path, monkeypatch):
    from collectives.auto import tuning

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MPIDP_ALLREDUCE_TUNING_FILE", raising=False)
    assert tuning.tuning_file() == tmp_path / "mpidp" / "allreduce-tuning.json"


def test_replace_file_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "out.json"
    files.replace_file(path, "old")
    files.replace_file(path, b"new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary left
    with pytest.raises(OSError):
        files.replace_file(tmp_path / "missing" / "out.json", "x")
    os.mkdir(tmp_path / "dir")
    with pytest.raises(OSError):  # renaming a file over a directory fails
        files.replace_file(tmp_path / "dir", "x", sync_directory=True)
    assert (tmp_path / "dir").is_dir() and path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "out.json"]


def test_replacing_renames_on_success_and_removes_on_failure(tmp_path):
    path = tmp_path / "data.h5"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with files.replacing(path) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".data.h5.")
            tmp.write_text("half")
            raise RuntimeError("writer failed")
    assert path.read_text() == "old" and sorted(tmp_path.iterdir()) == [path]
    with files.replacing(path) as tmp:
        tmp.write_text("new")
    assert path.read_text() == "new" and sorted(tmp_path.iterdir()) == [path]


def test_move_into_place_removes_the_temporary_when_it_cannot_rename(tmp_path):
    temporary = tmp_path / ".t.tmp"
    temporary.write_text("done")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "inside").write_text("")
    with pytest.raises(OSError):
        files.move_into_place(temporary, tmp_path / "dir")  # a non-empty directory
    assert not temporary.exists()
    temporary.write_text("done")
    files.move_into_place(temporary, tmp_path / "final")
    assert (tmp_path / "final").read_text() == "done" and not temporary.exists()


def test_a_tag_names_the_temporary_file(tmp_path):
    assert files.temporary_name(tmp_path / "lock", "n0nce") == tmp_path / ".lock.n0nce.tmp"
    assert files.temporary_name(tmp_path / "x").name == f".x.{os.getpid()}.tmp"
    files.replace_file(tmp_path / "lock", "{}\n", tag="n0nce")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock"]


def test_only_this_module_renames_over_a_file():
    """Every package replaces its outputs through kernels.files (docs/contributing.md)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = [str(path.relative_to(root))
             for package in ("engine", "collectives", "kernels", "preprocessing", "tools")
             for path in sorted((root / package).rglob("*.py"))
             if "os.replace(" in path.read_text(encoding="utf-8")]
    assert found == ["kernels/files.py"], found
