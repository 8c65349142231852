"""Frequency tables that make ``mpidp synth`` look like real PUMS data.

Run once against real person files; the result, ``synth_tables.json``, is
committed and holds only counts (marginals by age band, conditional tables),
never a record::

    python -m preprocessing.synth_tables ../shared/data/pums/acs2018_1yr_person_zips/*.zip

Tables (all counts over the records read):

* ``age_first``, ``age_others``: persons by age 0..99, for the first person
  of a housing unit and for everyone else; ``household_sizes``: housing units by size;
  ``gq_share``: share of persons in group quarters; ``geo``: (ST, PUMA,
  DIVISION, REGION) combinations.
* ``by_band``: for each demographic variable, its codes (``null`` = blank)
  within each age band; the bands split at every age where a dictionary
  N/A starts or ends (1, 3, 5, 15, 16, 17), so blanks stay consistent with age.
* ``esr``: employment status by (age band, schooling group, DIS, SEX): the
  label depends on the features the way it does in the real data.
* ``wkhp``, ``cow``: hours and class of worker, employed or not; ``occp``;
  ``pobp`` by NATIVITY; ``pincp``: income quantiles by (schooling group,
  employed); ``pwgtp``: weight quantiles.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: Age bands (inclusive) used for every conditional table.
BANDS = [(0, 0), (1, 2), (3, 4), (5, 14), (15, 15), (16, 16), (17, 17), (18, 24),
         (25, 34), (35, 44), (45, 54), (55, 64), (65, 74), (75, 99)]
#: Variables sampled from their distribution within the person's age band.
BY_BAND = ["SCHL", "MAR", "RELP", "DIS", "ESP", "CIT", "MIG", "MIL", "ANC", "DEAR",
           "DEYE", "DREM", "SEX", "RAC1P", "NATIVITY"]
#: Schooling groups: < high school (or blank), high school, some college, degree.
SCHL_GROUPS = [(0, 15), (16, 17), (18, 20), (21, 24)]
EMPLOYED = (1, 2, 4, 5)
TABLES = Path(__file__).with_name("synth_tables.json")


def band_of(age: int) -> int:
    return next(i for i, (low, high) in enumerate(BANDS) if low <= age <= high)


def schl_group(code: int | None) -> int:
    if code is None:
        return 0
    return next(i for i, (low, high) in enumerate(SCHL_GROUPS) if low <= code <= high)


def _counts(series) -> list:
    frame = series.value_counts(sort=False).sort(series.name, nulls_last=False)
    return [[None if v is None else int(v), int(c)]
            for v, c in zip(frame[series.name].to_list(), frame["count"].to_list())]


def fit(paths: list[str]) -> dict:
    """Build the tables from real person files (CSV or zip)."""
    import io
    import zipfile

    import polars as pl  # deferred: keeps `mpidp synth --help` fast

    frames = []
    for path in paths:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                for name in archive.namelist():
                    if name.lower().endswith(".csv"):
                        frames.append(pl.read_csv(io.BytesIO(archive.read(name)),
                                                  infer_schema=False))
        else:
            frames.append(pl.read_csv(path, infer_schema=False))
    text = pl.concat(frames)
    numeric = [c for c in BY_BAND + ["AGEP", "ESR", "WKHP", "COW", "OCCP", "POBP", "PINCP",
                                     "PWGTP", "SPORDER"]]
    df = text.with_columns([pl.col(c).cast(pl.Int64) for c in numeric])
    df = df.with_columns(
        pl.col("AGEP").map_elements(band_of, return_dtype=pl.Int64).alias("band"),
        pl.col("SCHL").map_elements(schl_group, return_dtype=pl.Int64,
                                    skip_nulls=False).alias("sg"),
        pl.col("ESR").is_in(list(EMPLOYED)).fill_null(False).alias("employed"),
    )
    tables: dict = {"records": df.height, "bands": BANDS, "schl_groups": SCHL_GROUPS}
    first = (pl.col("SPORDER") == 1) & (pl.col("SERIALNO").str.slice(4, 2) == "HU")
    tables["age_first"] = [int(df.filter(first & (pl.col("AGEP") == a)).height)
                           for a in range(100)]
    tables["age_others"] = [int(df.filter(~first & (pl.col("AGEP") == a)).height)
                            for a in range(100)]
    sizes = text.filter(pl.col("SERIALNO").str.slice(4, 2) == "HU").group_by("SERIALNO").len()
    tables["household_sizes"] = _counts(sizes["len"])
    tables["gq_share"] = float((text["SERIALNO"].str.slice(4, 2) == "GQ").mean())
    geo = text.group_by(["ST", "PUMA", "DIVISION", "REGION"]).len().sort(["ST", "PUMA"])
    tables["geo"] = [[int(s), int(p), int(d), int(r), int(n)] for s, p, d, r, n in geo.rows()]
    tables["by_band"] = {var: [_counts(df.filter(pl.col("band") == b)[var])
                               for b in range(len(BANDS))] for var in BY_BAND}
    esr = {}
    for (band, sg, dis, sex), part in df.group_by(["band", "sg", "DIS", "SEX"]):
        esr[f"{band}|{sg}|{dis}|{sex}"] = _counts(part["ESR"])
    tables["esr"] = dict(sorted(esr.items()))
    adults = df.filter(pl.col("AGEP") >= 16)
    tables["wkhp"] = {str(e): _counts(adults.filter(pl.col("employed") == e)["WKHP"])
                      for e in (True, False)}
    tables["cow"] = {str(e): _counts(adults.filter(pl.col("employed") == e)["COW"])
                     for e in (True, False)}
    tables["occp"] = _counts(df["OCCP"].drop_nulls())
    tables["pobp"] = {str(n): _counts(df.filter(pl.col("NATIVITY") == n)["POBP"])
                      for n in (1, 2)}
    quantiles = [q / 20 for q in range(21)]
    pincp = {}
    for (sg, employed), part in df.filter(pl.col("AGEP") >= 15).group_by(["sg", "employed"]):
        values = part["PINCP"].drop_nulls()
        pincp[f"{sg}|{employed}"] = [int(values.quantile(q, "nearest")) for q in quantiles]
    tables["pincp"] = dict(sorted(pincp.items()))
    tables["pwgtp"] = [int(df["PWGTP"].quantile(q, "nearest")) for q in quantiles]
    return tables


def load(path: Path = TABLES) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fit synth_tables.json from real PUMS files.")
    parser.add_argument("files", nargs="+", help="person files (psam_pNN.csv or csv_pXX.zip)")
    parser.add_argument("-o", "--out", default=str(TABLES))
    args = parser.parse_args(argv)
    tables = fit(args.files)
    tables["source"] = ("ACS 2018 1-year PUMS person files: "
                        + ", ".join(Path(p).name for p in args.files))
    Path(args.out).write_text(json.dumps(tables, separators=(",", ":")) + "\n",
                              encoding="utf-8")
    print(f"{args.out}: tables from {tables['records']:,} records", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
