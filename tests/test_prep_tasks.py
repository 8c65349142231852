"""The prediction tasks: the built-in ones against folktables, and task files.

folktables (the `test` extra; no download: its problem definitions are
applied to a pandas frame read from the Census zip) is the independent
reference: for every built-in task, mpidp prep on real 2018 files must keep
exactly folktables' rows with folktables' labels. Rows are matched as a
multiset of (household key, age, label): the household key is the keyed
hash of SERIALNO that prep stores (recomputed here with the same
--household-secret) and the age is read back from the standardised AGEP
column, so a row kept or labelled differently shows, not only a count.
"""
import argparse
import json
import zipfile
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

from preprocessing import dictionary, households, taskfile, tasks
from preprocessing.errors import PrepError
from preprocessing.h5format import splits_in
from preprocessing.pipeline import prepare
from preprocessing.prep import add_arguments, make_settings
from test_prep_pipeline import pums_zips

#: Two small states, read together by one prep run.
STATES = ("csv_pde.zip", "csv_pnd.zip")
SECRET = bytes(range(32))


def _settings(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return make_settings(parser.parse_args(argv))


# -- (a) task files: the parser and its one-line errors ---------------------------------

GOOD = """
name = "long_commute"
description = "commute over 45 minutes of employed adults"
label = "JWMNP > 45"
universe = ["AGEP >= 18", "ESR == 1"]

[features]
AGEP = "numeric"
schl = "categorical"
RELP = "categorical"
PUMA = "numeric"
"""


def _write(folder: Path, text: str, name: str = "task.toml") -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


def test_a_task_file_defines_a_task(tmp_path):
    task = taskfile.load(_write(tmp_path, GOOD), dictionary.load())
    assert task.name == "long_commute"
    assert task.description == "commute over 45 minutes of employed adults"
    assert [(f.name, f.kind) for f in task.features] == [
        ("AGEP", "numeric"), ("SCHL", "categorical"), ("RELP", "categorical"),
        ("PUMA", "numeric")]
    assert task.feature("RELP") is tasks.RELP  # read from RELSHIPP in 2019 files
    assert str(task.label) == "JWMNP>45"
    assert [str(c) for c in task.universe] == ["AGEP>=18", "ESR==1"]
    # universe optional (everyone), or one comma-separated string; description optional
    short = _write(tmp_path, 'name = "t"\nlabel = "ESR==1"\n[features]\nSEX = "categorical"\n')
    task = taskfile.load(short, dictionary.load())
    assert task.universe == () and task.description == f"defined in {short}"
    text = GOOD.replace('["AGEP >= 18", "ESR == 1"]', '"AGEP>=18, ESR==1"')
    assert taskfile.load(_write(tmp_path, text), dictionary.load()).universe == \
        tasks.parse_conditions("AGEP>=18,ESR==1")


def _replace(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


BAD = {
    "missing_file": (None, "{p}: no such file (given to --task-file)"),
    "not_toml": ("name = long_commute\n", "{p}: not a valid TOML file (Invalid value"),
    "misspelt_field": (_replace("label =", "lable ="),
                       "{p}: unknown field 'lable' (did you mean label?); a task file has "
                       "name, label, features, description, universe"),
    "missing_label": (_replace('label = "JWMNP > 45"', ""),
                      "{p}: the field 'label' is missing"),
    "missing_features": (GOOD.split("[features]")[0], "{p}: the field 'features' is missing"),
    "empty_features": (GOOD.split("[features]")[0] + "features = {}\n",
                       "{p}: features: a table of NAME"),
    "bad_name": (_replace('"long_commute"', '"Long commute"'),
                 "{p}: name: 'Long commute' is not a task name"),
    "builtin_name": (_replace('"long_commute"', '"income"'),
                     "{p}: name: 'income' is a built-in task; use --task income"),
    "unknown_feature": (_replace("schl =", "SCL ="),
                        "{p}: features.SCL: SCL is not a column of the 2018 person file "
                        "(did you mean SCHL?)"),
    "bad_kind": (_replace('schl = "categorical"', 'schl = "categoric"'),
                 "{p}: features.schl: the kind must be \"numeric\" or \"categorical\", not "
                 "'categoric' (did you mean categorical?)"),
    "kind_not_text": (_replace('schl = "categorical"', "schl = 1"),
                      "{p}: features.schl: the kind must be"),
    "too_many_categories": (_replace('PUMA = "numeric"', 'PUMA = "categorical"'),
                            "{p}: features.PUMA: 70,202 categories in the data dictionary, "
                            "more than 1,000; declare it \"numeric\""),
    "string_codes": (_replace('PUMA = "numeric"', 'SOCP = "categorical"'),
                     "{p}: features.SOCP: SOCP has non-numeric codes"),
    "label_is_feature": (_replace('PUMA = "numeric"', 'JWMNP = "numeric"'),
                         "{p}: features.JWMNP: the label's column cannot be a feature"),
    "bad_label": (_replace('"JWMNP > 45"', '"JWMNP is long"'),
                  "{p}: label: cannot read the condition 'JWMNP is long'"),
    "two_labels": (_replace('"JWMNP > 45"', '"JWMNP > 45, AGEP > 1"'),
                   "{p}: label: one condition"),
    "label_not_text": (_replace('"JWMNP > 45"', "45"), "{p}: label: a condition in quotes"),
    "unknown_label_column": (_replace('"JWMNP > 45"', '"JWMNPP > 45"'),
                             "{p}: label: JWMNPP is not a column of the 2018 person file "
                             "(did you mean JWMNP?)"),
    "bad_universe_item": (_replace('"ESR == 1"', '"ESR = 1"'),
                          "{p}: universe[1]: cannot read the condition 'ESR = 1'"),
    "unknown_universe_column": (_replace('"ESR == 1"', '"ESRR == 1"'),
                                "{p}: universe[1]: ESRR is not a column"),
    "universe_not_list": (_replace('["AGEP >= 18", "ESR == 1"]', "18"),
                          "{p}: universe: a list of conditions"),
    "unknown_group": (_replace("[features]", 'group = "RAC1PP"\n[features]'),
                      "{p}: group: RAC1PP is not a column of the 2018 person file (did you "
                      "mean RAC1P?)"),
    "group_quantity": (_replace("[features]", 'group = "PINCP"\n[features]'),
                       "{p}: group: PINCP has no labelled codes in the data dictionary"),
    "group_not_text": (_replace("[features]", "group = 3\n[features]"),
                       "{p}: group: a column name in quotes"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_task_file_is_one_line_naming_the_file_and_field(tmp_path, case):
    text, expected = BAD[case]
    path = str(tmp_path / "task.toml") if text is None else _write(tmp_path, text)
    with pytest.raises(PrepError) as error:
        taskfile.load(path, dictionary.load())
    message = str(error.value)
    assert message.startswith(expected.format(p=path)), message
    assert "\n" not in message


def test_a_task_file_names_its_group_column(tmp_path):
    """folktables' group column: RAC1P unless the file names another; it is kept
    beside SEX, RAC1P, AGEP in bands and ST, and read like any column."""
    task = taskfile.load(_write(tmp_path, GOOD), dictionary.load())
    assert task.group == "RAC1P" and [a.name for a in task.groups()] == [
        "SEX", "RAC1P", "AGEP", "ST"]
    task = taskfile.load(_write(tmp_path, GOOD.replace("[features]", 'group = "dis"\n'
                                                       "[features]")), dictionary.load())
    assert task.group == "DIS" and [a.name for a in task.groups()][-1] == "DIS"
    assert task.columns()[-1] == "DIS"


def test_built_in_tasks_group_like_folktables():
    import folktables

    problems = {"employment": folktables.ACSEmployment, "income": folktables.ACSIncome,
                "public_coverage": folktables.ACSPublicCoverage,
                "mobility": folktables.ACSMobility, "travel_time": folktables.ACSTravelTime,
                "income_poverty_ratio": folktables.ACSIncomePovertyRatio,
                "health_insurance": folktables.ACSHealthInsurance}
    for name, task in tasks.TASKS.items():
        assert task.group == problems[name].group == "RAC1P", name


def test_every_built_in_task_passes_the_task_file_checks():
    codebook = dictionary.load()
    assert list(tasks.TASKS) == ["employment", "income", "public_coverage", "mobility",
                                 "travel_time", "income_poverty_ratio", "health_insurance"]
    for task in tasks.TASKS.values():
        taskfile.check_task(task, codebook, task.name)
        assert task.description.startswith("ACS")


def test_task_file_with_task_is_refused(tmp_path):
    path = _write(tmp_path, GOOD)
    with pytest.raises(PrepError, match="--task income and --task-file .*: give one of them"):
        _settings([str(pums_zips() / STATES[0]), "--out", str(tmp_path / "o.h5"), "--task",
                   "income", "--task-file", path])


def test_prep_help_lists_every_task_and_says_where_it_differs():
    from engine.cli import build_parser

    subparsers = next(a for a in build_parser("prep")._actions
                      if isinstance(a, argparse._SubParsersAction))
    text = subparsers.choices["prep"].format_help()
    text = " ".join(text.split())
    for task in tasks.TASKS.values():
        assert f"{task.name}: {task.description}" in text
    assert "differs from folktables: persons aged 16 and over only" in text
    assert "--task-file FILE.toml" in text


# -- (b) every built-in task against folktables, on real files ---------------------------

def _folktables_problem(name: str):
    import folktables  # the `test` extra

    return {"employment": folktables.ACSEmployment, "income": folktables.ACSIncome,
            "public_coverage": folktables.ACSPublicCoverage,
            "mobility": folktables.ACSMobility, "travel_time": folktables.ACSTravelTime,
            "income_poverty_ratio": folktables.ACSIncomePovertyRatio,
            "health_insurance": folktables.ACSHealthInsurance}[name]


@pytest.fixture(scope="module")
def persons():
    """The persons of STATES as folktables reads them (its dtypes), one frame."""
    import pandas as pd  # folktables' dependency
    frames = []
    for state in STATES:
        with zipfile.ZipFile(pums_zips() / state) as archive:
            member = next(n for n in archive.namelist() if n.endswith(".csv"))
            with archive.open(member) as handle:
                frames.append(pd.read_csv(handle, dtype={"SERIALNO": str, "PINCP": "float64",
                                                         "RT": str, "SOCP": str,
                                                         "NAICSP": str}))
    return pd.concat(frames, ignore_index=True)


def _household_keys(serials) -> np.ndarray:
    """prep's key of each SERIALNO (2018HU0001234: year, HU/GQ, number)."""
    ids = np.array([int(s[:4]) * 10**8 + (s[4:6] == "GQ") * 10**7 + int(s[6:])
                    for s in serials], dtype=np.int64)
    return households.household_keys(ids, SECRET)


def _reference(problem, persons) -> Counter:
    """folktables' rows: (household key, age, label) with their multiplicity."""
    frame = problem._preprocess(persons)
    labels = problem.target_transform(frame[problem.target]).to_numpy().astype(int)
    keys = _household_keys(frame["SERIALNO"])
    return Counter(zip(keys.tolist(), frame["AGEP"].astype(int).tolist(), labels.tolist()))


def _prepared(path: str) -> Counter:
    """mpidp's rows: (household key, AGEP read back from its column, label)."""
    with h5py.File(path, "r") as handle:
        spec = json.loads(handle.attrs["encoding"])["features"][0]
        assert spec["name"] == "AGEP" and spec["kind"] == "numeric"
        column = json.loads(handle.attrs["feature_names"]).index("AGEP")
        rows = Counter()
        for split in splits_in(handle):
            age = np.rint(handle[f"{split}/X"][:, column].astype(np.float64) * spec["std"]
                          + spec["mean"]).astype(int)
            rows.update(zip(handle[f"{split}/household"][:].tolist(), age.tolist(),
                            handle[f"{split}/y"][:].astype(int).tolist()))
    return rows


def _prep(comm, tmp: Path, name: str, *extra: str):
    """prepare() on ``comm`` for the task on STATES, with SECRET; (report, path)."""
    secret, out = tmp / "secret", str(tmp / f"{name}.h5")
    if comm.Get_rank() == 0:
        secret.write_bytes(SECRET)
    argv = [*(str(pums_zips() / s) for s in STATES), "--out", out, "--task", name,
            "--household-secret", str(secret), "--quiet", *extra]
    settings = _settings(argv) if comm.Get_rank() == 0 else None
    return prepare(comm, comm.bcast(settings, root=0), threads=1, version="test"), out


# Printed with -s: the numbers of the report (kept rows, positive rate).
def _show(name: str, rows: Counter) -> None:
    kept, positive = sum(rows.values()), sum(n for (_, _, y), n in rows.items() if y)
    print(f"\n{name}: {kept} rows, {positive} positive ({positive / kept:.3f})")


@pytest.mark.parametrize("name", [n for n in tasks.TASKS if n != "travel_time"])
def test_built_in_task_keeps_folktables_rows_and_labels(tmp_path, persons, name):
    """Every built-in task (travel_time: below, on every rank count): the same
    rows with the same labels as folktables. employment with folktables'
    universe (every age), then mpidp's own (16 and over)."""
    from collectives.runtime import MPI

    problem = _folktables_problem(name)
    extra = ["--universe", "AGEP>=0"] if name == "employment" else []
    report, out = _prep(MPI.COMM_SELF, tmp_path, name, *extra)
    expected = _reference(problem, persons)
    _show(name, expected)
    assert report.kept == sum(expected.values())
    assert _prepared(out) == expected
    with h5py.File(out, "r") as handle:
        features = json.loads(handle.attrs["encoding"])["features"]
        assert handle.attrs["task"] == name
    assert [f["name"] for f in features] == list(problem.features)
    if name == "employment":
        report, out = _prep(MPI.COMM_SELF, tmp_path, name)
        adults = Counter({row: n for row, n in expected.items() if row[1] >= 16})
        assert report.kept == sum(adults.values()) == int((persons["AGEP"] >= 16).sum())
        assert _prepared(out) == adults


@pytest.mark.mpi(min_size=1)
def test_travel_time_keeps_folktables_rows_and_labels(comm, shared_tmp, persons):
    """ACSTravelTime, with its numeric PUMA/POWPUMA and blank JWMNP (a
    negative), on the ranks of the test job."""
    report, out = _prep(comm, shared_tmp, "travel_time")
    if comm.Get_rank() != 0:
        return
    problem = _folktables_problem("travel_time")
    expected = _reference(problem, persons)
    _show("travel_time", expected)
    assert report.kept == sum(expected.values())
    assert _prepared(out) == expected
    with h5py.File(out, "r") as handle:
        names = json.loads(handle.attrs["feature_names"])
    assert {"PUMA", "POWPUMA", "POWPUMA=blank", "POVPIP", "ST=10", "ST=38"} <= set(names)
    assert not any(n.startswith("PUMA=") for n in names)


# -- RELP of a 2019 file in a universe or label, whatever the features ----------------

#: RELP (2018) -> RELSHIPP (2019) as the Census Bureau's two dictionaries define
#: them, written here independently of tasks.RELSHIPP_TO_RELP: roomers and
#: boarders (11) became other nonrelatives (36), unmarried partners (13) 22.
RELP_TO_RELSHIPP = {0: 20, 1: 21, 2: 25, 3: 26, 4: 27, 5: 28, 6: 29, 7: 30, 8: 31, 9: 32,
                    10: 33, 11: 36, 12: 34, 13: 22, 14: 35, 15: 36, 16: 37, 17: 38}


@pytest.fixture(scope="module")
def delaware_2019(tmp_path_factory) -> Path:
    """STATES[0] as a 2019 file: RELP renamed RELSHIPP, its codes the 2019 ones."""
    import pandas as pd  # folktables' dependency

    with zipfile.ZipFile(pums_zips() / STATES[0]) as archive:
        member = next(n for n in archive.namelist() if n.endswith(".csv"))
        with archive.open(member) as handle:
            frame = pd.read_csv(handle, dtype=str, keep_default_na=False)
    frame["RELP"] = [str(RELP_TO_RELSHIPP[int(v)]) for v in frame["RELP"]]
    path = tmp_path_factory.mktemp("y2019") / "psam_p10.csv"
    frame.rename(columns={"RELP": "RELSHIPP"}).to_csv(path, index=False)
    return path


def _prep_file(tmp: Path, source: Path, name: str, *extra: str):
    """prepare() on one rank of ``source`` with SECRET; (report, path)."""
    from collectives.runtime import MPI

    secret, out = tmp / "secret", str(tmp / f"{name}.h5")
    secret.write_bytes(SECRET)
    argv = [str(source), "--out", out, "--household-secret", str(secret), "--quiet", *extra]
    return prepare(MPI.COMM_SELF, _settings(argv), threads=1, version="test"), out


@pytest.mark.parametrize("task", ["public_coverage", "employment"])
def test_a_universe_on_relp_reads_relshipp_whatever_the_features(tmp_path, persons,
                                                                 delaware_2019, task):
    """--universe RELP==0 on a 2019 file (RELSHIPP): the reference persons of the
    2018 file, counted by pandas, for a task without RELP as a feature
    (public_coverage: refused before, 'the header lacks RELP') and one with it."""
    report, out = _prep_file(tmp_path, delaware_2019, task, "--task", task,
                             "--universe", "RELP==0")
    state = persons[persons["ST"] == 10]
    heads = state[state["RELP"] == 0]
    label = (heads["PUBCOV"] == 1) if task == "public_coverage" else (heads["ESR"] == 1)
    expected = Counter(zip(_household_keys(heads["SERIALNO"]).tolist(),
                           heads["AGEP"].astype(int).tolist(), label.astype(int).tolist()))
    assert 1000 < report.kept == len(heads)
    assert _prepared(out) == expected


def test_a_label_on_relp_reads_relshipp(tmp_path, persons, delaware_2019):
    """A task file labelling the reference person (RELP == 0), RELP no feature:
    on a 2019 file the labels of the 2018 file, with the recode's note."""
    from preprocessing.prep import year_notes

    text = ('name = "householder"\nlabel = "RELP == 0"\nuniverse = "AGEP >= 18"\n'
            '[features]\nAGEP = "numeric"\nSEX = "categorical"\n')
    path = _write(tmp_path, text)
    report, out = _prep_file(tmp_path, delaware_2019, "householder", "--task-file", path)
    state = persons[persons["ST"] == 10]
    adults = state[state["AGEP"] >= 18]
    expected = Counter(zip(_household_keys(adults["SERIALNO"]).tolist(),
                           adults["AGEP"].astype(int).tolist(),
                           (adults["RELP"] == 0).astype(int).tolist()))
    assert report.kept == len(adults) and 0 < report.label_counts[1] < report.kept
    assert _prepared(out) == expected
    settings = _settings([str(delaware_2019), "--out", str(tmp_path / "o.h5"),
                          "--task-file", path])
    assert year_notes(settings) == ["  note    psam_p10.csv: RELP read from RELSHIPP (the 2019 "
                                    "survey and later), recoded to the 2018 codes; not exact: "
                                    "no roomer or boarder (2018 code 11), spouses and partners "
                                    "of either sex merged"]


def test_relp_is_read_through_its_sources_only_where_a_task_reads_it():
    """Task.feature: RELP's reading for a label, universe or group on RELP;
    None for a column the task does not read, or one without other years' names."""
    coverage = tasks.TASKS["public_coverage"]
    assert coverage.feature("RELP") is None
    assert coverage.with_universe(tasks.parse_conditions("RELP==0")).feature("RELP") \
        is tasks.RELP
    label = tasks.Task("t", "", coverage.features, tasks.Condition("RELP", "==", 0))
    assert label.feature("RELP") is tasks.RELP and label.feature("PUBCOV") is None
    grouped = tasks.Task("t", "", coverage.features, coverage.label, group="RELP")
    assert grouped.feature("RELP") is tasks.RELP
    assert grouped.notes({"RELP": "RELSHIPP"}) == [tasks.RELP.note_for("RELSHIPP")]
    assert coverage.notes({"RELP": "RELSHIPP"}) == []


# -- a task file end to end, with --like ------------------------------------------------

def test_task_file_prepares_a_file_and_like_needs_the_same_task(tmp_path):
    from collectives.runtime import MPI

    zips = pums_zips()
    path = _write(tmp_path, GOOD)
    out, again = str(tmp_path / "commute.h5"), str(tmp_path / "again.h5")
    report = prepare(MPI.COMM_SELF, _settings([str(zips / STATES[0]), "--out", out,
                                                 "--task-file", path, "--quiet"]),
                     threads=1, version="test")
    with h5py.File(out, "r") as handle:
        assert handle.attrs["task"] == "long_commute"
        assert handle.attrs["label"] == "JWMNP>45"
        assert handle.attrs["universe"] == "AGEP>=18,ESR==1"
        names = json.loads(handle.attrs["feature_names"])
        y = np.concatenate([handle[f"{split}/y"][:] for split in splits_in(handle)])
    assert names[0] == "AGEP" and "SCHL=01" in names and "PUMA" in names
    assert report.kept == len(y) > 1000 and 0 < y.mean() < 0.5
    assert report.label_counts == (int((y == 0).sum()), int((y == 1).sum()))
    # --like: the task file again; without it, or with another task, refused
    prepare(MPI.COMM_SELF, _settings([str(zips / STATES[1]), "--out", again, "--like", out,
                                      "--task-file", path, "--quiet"]),
            threads=1, version="test")
    with h5py.File(out, "r") as a, h5py.File(again, "r") as b:
        assert a.attrs["encoding_fingerprint"] == b.attrs["encoding_fingerprint"]
    common = [str(zips / STATES[1]), "--out", again, "--like", out]
    with pytest.raises(PrepError, match="task 'long_commute' is not built in; give the "
                       "--task-file that defines it"):
        _settings(common)
    other = _write(tmp_path, GOOD.replace('"long_commute"', '"short_commute"'), "other.toml")
    with pytest.raises(PrepError, match="defines task 'short_commute', but .* holds task "
                       "'long_commute'"):
        _settings([*common, "--task-file", other])
    fewer = _write(tmp_path, GOOD.replace('PUMA = "numeric"\n', ""), "fewer.toml")
    with pytest.raises(PrepError, match="its encoding has the features AGEP, SCHL, RELP, "
                       "PUMA, but task 'long_commute' has AGEP, SCHL, RELP"):
        _settings([*common, "--task-file", fewer])


@pytest.mark.parametrize("label, only, when", [("JWMNP > 99999", 0, "never"),
                                               ("WKHP >= 0", 1, "always")])
def test_a_label_that_is_never_or_always_true_is_noted(tmp_path, label, only, when):
    """A task file whose label holds for no kept record (or every one) makes a file
    a model learns nothing from, at a perfect accuracy: the summary says so."""
    from collectives.runtime import MPI
    from preprocessing.prep import summary

    text = GOOD.replace('label = "JWMNP > 45"', f'label = "{label}"')
    assert text != GOOD
    argv = [str(pums_zips() / STATES[0]), "--out", str(tmp_path / "o.h5"), "--task-file",
            _write(tmp_path, text), "--quiet"]
    settings = _settings(argv)
    report = prepare(MPI.COMM_SELF, settings, threads=1, version="test")
    assert report.label_counts[only] == report.kept > 0 and report.label_counts[1 - only] == 0
    notes = [line for line in summary(report, settings, 1).splitlines() if "note" in line]
    condition = label.replace(" ", "")
    assert notes == [f"  note    every kept record has label {only}: the label {condition} is "
                     f"{when} true in these records, so a model trained on this file learns "
                     "nothing (check the task's label condition)"]


# -- (c) the command line: a bad task file is exit 2, one line, no output ----------------

def test_bad_task_file_under_mpiexec_exits_2_with_one_line_and_no_output(tmp_path):
    from launcher import mpidp

    path = _write(tmp_path, _replace("schl =", "SCL ="))
    result = mpidp(1, "prep", str(pums_zips() / STATES[0]), "--out", str(tmp_path / "o.h5"),
                   "--task-file", path, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert errors == [f"mpidp: error: {path}: features.SCL: SCL is not a column of the 2018 "
                      "person file (did you mean SCHL?)"], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task.toml"]


def test_task_file_feature_absent_from_the_header_is_one_clear_error(tmp_path):
    """The header is checked against the task file's columns, not employment's."""
    extract = tmp_path / "extract.csv"
    extract.write_text("SERIALNO,AGEP,SCHL,RELP,JWMNP,ESR\n2018HU0000001,40,21,0,30,1\n")
    path = _write(tmp_path, GOOD)
    with pytest.raises(PrepError) as error:
        _settings([str(extract), "--out", str(tmp_path / "o.h5"), "--task-file", path])
    assert str(error.value).startswith(f"{extract}, line 1: the header lacks PUMA"), error.value
    assert not list(tmp_path.glob("*.h5"))
