"""Cleaning and encoding: drop reasons, category codes, exact statistics, one-hot."""
import json

import numpy as np
import pytest

from preprocessing import dictionary, encoding as enc
from preprocessing.cleaning import NUMERIC_BLANK, Cleaner, category_names, reason_names
from preprocessing.parse import BlockParser
from preprocessing.tasks import TASKS

BOOK = dictionary.load()
EMPLOYMENT = TASKS["employment"]
HEADER = ("SERIALNO", *EMPLOYMENT.columns())


def _columns(rows: list[dict], header=HEADER):
    """Parse records given as {column: text} (missing columns are blank)."""
    text = "".join(",".join(row.get(c, "") for c in header) + "\n" for row in rows)
    parser = BlockParser(header, [c for c in header if c != "SERIALNO"], "SERIALNO")
    return parser.parse(text.encode())


def _adult(**overrides) -> dict:
    row = {"SERIALNO": "2018HU0000001", "AGEP": "40", "SCHL": "21", "MAR": "1",
           "RELP": "00", "DIS": "2", "CIT": "1", "MIG": "1", "MIL": "4", "ANC": "1",
           "NATIVITY": "1", "DEAR": "2", "DEYE": "2", "DREM": "2", "SEX": "2",
           "RAC1P": "1", "ST": "10", "ESR": "1"}
    row.update(overrides)
    return row


def _sources(task=EMPLOYMENT, header=HEADER):
    return {name: name for name in task.columns()}


def test_reasons_first_problem_wins_in_a_fixed_order():
    rows = [_adult(), _adult(AGEP="12", SCHL="99"), _adult(SCHL="99"), _adult(SEX=""),
            _adult(AGEP="x"), _adult(SERIALNO="junk"), _adult(ESP="3", ESR=""),
            _adult(MAR="7", SEX="")]
    cleaned = Cleaner(EMPLOYMENT, BOOK, _sources()).clean(_columns(rows))
    names = reason_names(EMPLOYMENT)
    assert [names[r] for r in cleaned.reason] == [
        "kept", "universe", "invalid:SCHL", "blank:SEX", "non_numeric:AGEP",
        "invalid:SERIALNO", "kept", "invalid:MAR"]
    assert cleaned.first_bad == (2, "SCHL", "99")
    # ESR blank is allowed by the dictionary: the negative class.
    assert cleaned.label.tolist() == [1, 0]


def test_structural_blanks_are_a_category_and_codes_follow_the_dictionary():
    rows = [_adult(ESP="", MIL="", SCHL="01"), _adult(ESP="8", MIL="1", SCHL="24", RELP="17")]
    cleaned = Cleaner(EMPLOYMENT, BOOK, _sources()).clean(_columns(rows))
    esp = category_names(BOOK["ESP"])
    assert [esp[i] for i in cleaned.codes["ESP"]] == ["blank", "8"]
    assert [category_names(BOOK["SCHL"])[i] for i in cleaned.codes["SCHL"]] == ["01", "24"]
    assert [category_names(BOOK["RELP"])[i] for i in cleaned.codes["RELP"]] == ["00", "17"]
    assert cleaned.codes["AGEP"].tolist() == [40, 40]
    assert cleaned.codes["SCHL"].dtype == np.uint8


def test_relshipp_files_are_recoded_to_relp():
    header = tuple("RELSHIPP" if c == "RELP" else c for c in HEADER)
    sources = {**_sources(), "RELP": "RELSHIPP"}
    rows = [_adult(RELSHIPP="20"), _adult(RELSHIPP="38"), _adult(RELSHIPP="17")]
    cleaned = Cleaner(EMPLOYMENT, BOOK, sources).clean(_columns(rows, header))
    names = reason_names(EMPLOYMENT)
    assert [names[r] for r in cleaned.reason] == ["kept", "kept", "invalid:RELP"]
    assert [category_names(BOOK["RELP"])[i] for i in cleaned.codes["RELP"]] == ["00", "17"]


def test_a_universe_on_relp_reads_relshipp_in_2018_codes():
    """A 2019+ file gives RELP as RELSHIPP (codes 20-38): the feature was
    recoded, but --universe RELP==0 read the raw 20 and kept nobody (and
    RELP!=0 kept the reference persons)."""
    from preprocessing.tasks import parse_conditions

    header = tuple("RELSHIPP" if c == "RELP" else c for c in HEADER)
    sources = {**_sources(), "RELP": "RELSHIPP"}
    rows = [_adult(RELSHIPP="20"), _adult(RELSHIPP="38"), _adult(RELSHIPP="21")]
    names = reason_names(EMPLOYMENT)
    for universe, kept in (("RELP==0", [True, False, False]), ("RELP!=0", [False, True, True]),
                           ("RELP==20", [False, False, False])):
        task = EMPLOYMENT.with_universe(parse_conditions(universe))
        cleaned = Cleaner(task, BOOK, sources).clean(_columns(rows, header))
        assert [names[r] == "kept" for r in cleaned.reason] == kept, universe


def test_universe_with_several_conditions_and_blank_values():
    task = TASKS["income"]
    header = ("SERIALNO", *task.columns())
    base = {"SERIALNO": "2018HU0000001", "AGEP": "30", "COW": "1", "SCHL": "21", "MAR": "1",
            "OCCP": "0010", "POBP": "006", "RELP": "00", "WKHP": "40", "SEX": "1",
            "RAC1P": "1", "PINCP": "60000", "PWGTP": "10", "ST": "44"}
    rows = [base, {**base, "WKHP": ""}, {**base, "PINCP": "50"}, {**base, "AGEP": "16"},
            {**base, "PINCP": "40000"}]
    cleaned = Cleaner(task, BOOK, {n: n for n in task.columns()}).clean(_columns(rows, header))
    names = reason_names(task)
    assert [names[r] for r in cleaned.reason] == ["kept", "universe", "universe",
                                                  "universe", "kept"]
    assert cleaned.label.tolist() == [1, 0]
    assert cleaned.codes["OCCP"].dtype == np.uint16


def test_group_attributes_are_checked_and_kept_as_codes():
    """SEX, RAC1P, AGEP in bands and ST are kept per record, whether features or
    not (ST is not an employment feature); a group column outside the
    dictionary drops the record like any column the task reads."""
    rows = [_adult(AGEP="16", SEX="1", RAC1P="9", ST="44"), _adult(AGEP="99", ST="72"),
            _adult(AGEP="24"), _adult(ST="03"), _adult(AGEP="75", RAC1P="6", ST="")]
    cleaned = Cleaner(EMPLOYMENT, BOOK, _sources()).clean(_columns(rows))
    names = reason_names(EMPLOYMENT)
    assert [names[r] for r in cleaned.reason] == ["kept", "kept", "kept", "invalid:ST",
                                                  "blank:ST"]
    assert set(cleaned.groups) == {"SEX", "RAC1P", "AGEP", "ST"}
    assert cleaned.groups["AGEP"].tolist() == [16, 75, 16]
    assert cleaned.groups["SEX"].tolist() == [1, 2, 2]
    assert cleaned.groups["RAC1P"].tolist() == [9, 1, 1]
    assert cleaned.groups["ST"].tolist() == [44, 72, 10]
    assert cleaned.groups["ST"].dtype == np.int16


def test_exact_statistics_match_numpy_and_do_not_depend_on_the_split():
    rng = np.random.default_rng(3)
    values = rng.integers(-19998, 4209995, size=200_001).astype(np.int32)
    values[::7] = NUMERIC_BLANK
    parts = np.array_split(values, 5)
    sums = [enc.local_sums(p) for p in parts]
    total = tuple(sum(s[i] for s in sums) for i in range(3))
    assert total == enc.local_sums(values)
    mean, std = enc.mean_std(*total)
    kept = values[values != NUMERIC_BLANK].astype(np.float64)
    assert mean == pytest.approx(kept.mean(), rel=1e-12)
    assert std == pytest.approx(kept.std(), rel=1e-9)
    assert enc.mean_std(0, 0, 0) == (0.0, 1.0)
    assert enc.mean_std(3, 15, 75) == (5.0, 1.0)  # constant: std 0 -> 1


def _naive_row(spec_features, codes: dict, i: int) -> list[float]:
    row = []
    for spec in spec_features:
        value = codes[spec["name"]][i]
        if spec["kind"] == "categorical":
            names = category_names(BOOK[spec["name"]])
            row += [1.0 if c == names[value] else 0.0 for c in spec["categories"]]
        else:
            blank = value == NUMERIC_BLANK
            row.append(0.0 if blank else (value - spec["mean"]) / spec["std"])
            if spec["blank"]:
                row.append(1.0 if blank else 0.0)
    return row


@pytest.mark.parametrize("task_name", ["employment", "income"])
def test_encoder_matches_a_naive_one_hot(task_name):
    task = TASKS[task_name]
    rng = np.random.default_rng(7)
    n = 300
    codes = {}
    for f in task.features:
        if f.kind == "numeric":
            v = rng.integers(1, 99, n).astype(np.int32)
            v[::5] = NUMERIC_BLANK if BOOK[f.name].blank_allowed else v[::5]
            codes[f.name] = v
        else:
            codes[f.name] = rng.integers(0, len(category_names(BOOK[f.name])), n)
    stats = {f.name: enc.local_sums(codes[f.name]) for f in task.features
             if f.kind == "numeric"}
    encoding = enc.build(task, BOOK, stats)
    out = np.full((n, encoding.n_features), 7.0, dtype=np.float32)
    enc.Encoder(encoding, task, BOOK).encode(codes, out)
    expected = np.array([_naive_row(encoding.features, codes, i) for i in range(n)])
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    assert len(encoding.feature_names) == encoding.n_features == out.shape[1]


def test_encoding_json_roundtrip_and_fingerprint():
    encoding = enc.build(EMPLOYMENT, BOOK, {"AGEP": (4, 100, 2600)})
    text = encoding.to_json()
    again = enc.Encoding.from_json(text)
    assert again == encoding and again.fingerprint == encoding.fingerprint
    assert json.loads(text)["features"][0] == {"name": "AGEP", "kind": "numeric",
                                               "mean": 25.0, "std": 5.0, "blank": False}
    names = encoding.feature_names
    assert names[:3] == ["AGEP", "SCHL=01", "SCHL=02"] and "ESP=blank" in names
    assert encoding.n_features == 99


def test_like_encoding_must_fit_the_task():
    encoding = enc.build(EMPLOYMENT, BOOK, {"AGEP": (4, 100, 2600)})
    enc.check_compatible(encoding, EMPLOYMENT, BOOK, "a.h5")
    with pytest.raises(enc.PrepError, match="a.h5: its encoding has the features"):
        enc.check_compatible(encoding, TASKS["income"], BOOK, "a.h5")
