"""The committed data dictionary and task definitions (preprocessing/dictionary.py, tasks.py)."""
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from preprocessing import dictionary, tasks
from preprocessing.cleaning import category_names


def pums_dir() -> Path:
    """The shared real PUMS folder: $MPIDP_PUMS_DIR or ../shared/data/pums."""
    env = os.environ.get("MPIDP_PUMS_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared/data/pums"
    if not (path / "acs2018_1yr_person_zips").is_dir():
        pytest.fail(f"real PUMS files not found in {path}; set MPIDP_PUMS_DIR to the folder "
                    "holding PUMS_Data_Dictionary_2018.csv and acs2018_1yr_person_zips/")
    return path


def test_committed_dictionary_is_the_official_one_regenerated():
    official = pums_dir() / "PUMS_Data_Dictionary_2018.csv"
    variables = dictionary.parse_official(official)
    committed = dictionary.load()
    assert [v.name for v in variables] == committed.header
    assert variables == list(committed.variables.values())
    assert len(committed.header) == 286


def test_committed_labels_are_the_official_ones_regenerated():
    """pums_2018_labels.json is `python -m preprocessing.dictionary --labels` of the
    official dictionary: the words a group's codes are shown with."""
    official = dictionary.parse_labels(pums_dir() / "PUMS_Data_Dictionary_2018.csv")
    committed = dictionary.load_labels()
    assert official == committed and len(committed) == 286
    assert committed["SEX"].codes == {1: "Male", 2: "Female"}
    assert committed["RAC1P"].codes[1] == "White alone" and len(committed["RAC1P"].codes) == 9
    assert committed["ST"].codes[44] == "Rhode Island/RI" and len(committed["ST"].codes) == 52
    assert committed["AGEP"].codes == {} and committed["AGEP"].description == "Age"
    assert committed["ESR"].blank == "N/A (less than 16 years old)"


def test_header_is_the_header_of_every_real_file():
    header = ",".join(dictionary.load().header)
    for path in sorted((pums_dir() / "acs2018_1yr_person_zips").glob("*.zip")):
        with zipfile.ZipFile(path) as archive:
            member = next(n for n in archive.namelist() if n.endswith(".csv"))
            with archive.open(member) as stream:
                assert stream.readline().decode().strip() == header, path.name


def test_variables_from_the_dictionary_text():
    book = dictionary.load()
    assert book["AGEP"].ranges == ((0, 99),) and not book["AGEP"].blank_allowed
    assert book["ESR"].codes() == [1, 2, 3, 4, 5, 6] and book["ESR"].na_below_age == 16
    assert book["MIL"].na_below_age == 17 and book["DREM"].na_below_age == 5
    assert book["SCHL"].codes() == list(range(1, 25)) and book["SCHL"].width == 2
    assert book["ESP"].blank_allowed and book["ESP"].na_below_age is None
    assert book["RELP"].codes() == list(range(0, 18))
    assert ("2018HU0000001", "2018HU9999999") in book["SERIALNO"].strings
    valid = book["ST"].valid(np.array([1, 3, 10, 72, 73]))
    assert valid.tolist() == [True, False, True, True, False]


def test_category_names_are_padded_codes_then_blank():
    book = dictionary.load()
    assert category_names(book["SCHL"])[:2] == ["01", "02"]
    assert category_names(book["SCHL"])[-1] == "blank"
    assert category_names(book["SEX"]) == ["1", "2"]
    assert category_names(book["RELP"])[0] == "00"


def test_employment_task_is_folktables_acsemployment():
    task = tasks.TASKS["employment"]
    assert [f.name for f in task.features] == [
        "AGEP", "SCHL", "MAR", "RELP", "DIS", "ESP", "CIT", "MIG", "MIL", "ANC",
        "NATIVITY", "DEAR", "DEYE", "DREM", "SEX", "RAC1P"]
    assert str(task.label) == "ESR==1"
    assert [str(c) for c in task.universe] == ["AGEP>=16"]
    assert task.feature("AGEP").kind == "numeric"


def test_income_task_is_folktables_acsincome():
    task = tasks.TASKS["income"]
    assert [f.name for f in task.features] == [
        "AGEP", "COW", "SCHL", "MAR", "OCCP", "POBP", "RELP", "WKHP", "SEX", "RAC1P"]
    assert str(task.label) == "PINCP>50000"
    assert [str(c) for c in task.universe] == ["AGEP>16", "PINCP>100", "WKHP>0", "PWGTP>=1"]
    book = dictionary.load()
    for name in task.columns():
        assert name in book


def test_relp_reads_relshipp_from_2019_on_into_2018_codes():
    relp = tasks.TASKS["employment"].feature("RELP")
    assert [s.column for s in relp.sources] == ["RELP", "RELSHIPP"]
    recode = relp.sources[1].recode
    assert sorted(recode) == list(range(20, 39))
    assert set(recode.values()) <= set(dictionary.load()["RELP"].codes())
    assert recode[20] == 0 and recode[37] == 16 and recode[38] == 17


def test_parse_conditions():
    conditions = tasks.parse_conditions("agep>=18, PINCP > 100,WKHP!=0")
    assert [str(c) for c in conditions] == ["AGEP>=18", "PINCP>100", "WKHP!=0"]
    assert conditions[0].holds(np.array([17, 18])).tolist() == [False, True]
    with pytest.raises(ValueError, match="AGEP>=16"):
        tasks.parse_conditions("AGEP >= sixteen")
    task = tasks.TASKS["employment"].with_universe(conditions[:1])
    assert [str(c) for c in task.universe] == ["AGEP>=18"]
