"""Write a synthetic ACS PUMS person file in the official 2018 format.

The file has the full 286-column 2018 header and codes inside the data
dictionary's ranges; it needs neither the Census data nor internet access
(the header and ranges come from the committed dictionary, the marginals
from committed frequency tables: preprocessing/synth_tables.py).

What makes it realistic enough for demos and benchmarks:
  * households (SERIALNO, SPORDER; about 5% group quarters) in real states
    and PUMAs; ages with the real age distribution;
  * demographics drawn within the person's age band, so structural blanks
    follow age as in the dictionary (ESR blank exactly when AGEP < 16, MIL
    blank under 17, SCHL blank under 3, ...);
  * employment (ESR) drawn from its real distribution given age band,
    schooling, disability and sex: a model can learn it; hours, class of
    worker, occupation and income follow employment and schooling;
  * the other columns hold codes drawn from their dictionary ranges.

Households are numbered from 0000001 (SERIALNO 2018HU0000001 or 2018GQ...)
whatever the seed, so files of different seeds share serial numbers and
``mpidp prep`` refuses them together (it cannot tell them from one person
given twice): write one file with more rows instead.

--corrupt-fraction F replaces that share of the lines by damaged ones (text
in a numeric column, a code outside the dictionary, a blank where none is
allowed, a line cut short) to exercise `mpidp prep`'s cleaning.

--out FILE.csv is plain CSV; a name ending in .gz (psam_p98.csv.gz) is
written gzip-compressed, as the Census Bureau's .csv.gz files are, which
`mpidp prep` reads. Other compressed names (.zip, .bz2, .xz, ...) are
refused: the file would be plain CSV under a name that says otherwise.

example:
  mpidp synth --rows 1200000 --out synth.csv --seed 1
  mpidp synth --rows 10000 --out psam_p98.csv.gz
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import os
import sys
import time

import numpy as np

from collectives import MPI
from preprocessing import atomic, dictionary, synth_tables
from preprocessing.errors import PrepError

#: Columns generated with their own logic (every other column is filler).
GENERATED = ["RT", "SERIALNO", "DIVISION", "SPORDER", "PUMA", "REGION", "ST", "ADJINC",
             "PWGTP", "AGEP", "ESR", "WKHP", "COW", "OCCP", "POBP", "PINCP"]
#: Households are numbered with 7 digits (SERIALNO 2018HU0000001 ...).
MAX_HOUSEHOLDS = 9_999_999
#: The most rows ``--rows`` may ask for, refused up front above it: the
#: households hold 2.2305 persons on average (the committed household sizes,
#: group quarters of one), so MAX_HOUSEHOLDS of them hold about 22,304,900
#: rows, give or take about 4,500 (one standard deviation); 22 million stays
#: 68 of those below. The check in ``_households`` remains as a backstop.
MAX_ROWS = 22_000_000
#: Rows generated and written at a time.
BATCH_ROWS = 200_000
#: Random filler texts per run of filler columns and age band.
POOL = 48
#: Columns that may be damaged by --corrupt-fraction, and codes outside the
#: dictionary for them.
_CORRUPTIBLE = {"AGEP": "104", "SCHL": "31", "MAR": "7", "SEX": "3", "RAC1P": "0",
                "DIS": "9", "CIT": "8"}
#: Names of compressed files that synth does not write (suffix -> format):
#: ``.gz`` is written as gzip, anything else is plain CSV.
NOT_WRITTEN = {".zip": "a zip archive", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd",
               ".7z": "7-Zip", ".tar": "a tar archive", ".tgz": "a gzipped tar archive",
               ".lz4": "lz4"}
#: gzip's level for a ``.gz`` output: zlib's default, several times faster than
#: Python's (9) for a file a few percent larger.
GZIP_LEVEL = 6


def check_out_name(path: str) -> None:
    """Raise PrepError (collective, one line) when ``path`` names a compressed
    format synth does not write (:data:`NOT_WRITTEN`): its CSV under that name
    was refused by `mpidp prep` as a damaged archive."""
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix in NOT_WRITTEN:
        raise PrepError(f"--out {path}: mpidp synth writes CSV, or gzip for a name ending in "
                        f".gz, not {NOT_WRITTEN[suffix]} ({suffix}): name it .csv or .csv.gz",
                        collective=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, required=True, help="number of person records")
    parser.add_argument("--out", required=True, metavar="FILE.csv",
                        help="the CSV to write (gzip-compressed for a name ending in .gz)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--corrupt-fraction", type=float, default=0.0, metavar="F",
                        help="share of lines to damage on purpose (default: 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")


def _pad(variable) -> int:
    return variable.width if (not variable.numeric or variable.name == "SPORDER") else 0


def _draw(rng: np.random.Generator, pairs: list, n: int) -> np.ndarray:
    """n codes from ``[[code or None, count], ...]``; blank -> -1."""
    codes = np.array([-1 if c is None else c for c, _ in pairs], dtype=np.int64)
    weights = np.array([w for _, w in pairs], dtype=np.float64)
    return codes[rng.choice(len(codes), size=n, p=weights / weights.sum())]


def _by_group(rng, groups: np.ndarray, table_of) -> np.ndarray:
    """One code per row, drawn from ``table_of(group)`` for its integer group."""
    out = np.full(len(groups), -1, dtype=np.int64)
    order = np.argsort(groups, kind="stable")
    keys, starts = np.unique(groups[order], return_index=True)
    bounds = list(starts) + [len(groups)]
    for i, key in enumerate(keys):
        rows = order[bounds[i]:bounds[i + 1]]
        out[rows] = _draw(rng, table_of(int(key)), len(rows))
    return out


class Generator:
    """Draws person records batch by batch (one random stream per seed)."""

    def __init__(self, seed: int) -> None:
        self.codebook = dictionary.load()
        self.t = synth_tables.load()
        self.rng = np.random.default_rng(seed)
        # Damage is drawn from its own stream: the same seed gives the same
        # records with or without --corrupt-fraction (except the damaged ones).
        self.damage_rng = np.random.default_rng([seed, 1])
        self.bands = self.t["bands"]
        self.band_of_age = np.array([next(i for i, (lo, hi) in enumerate(self.bands)
                                          if lo <= a <= hi) for a in range(100)])
        self.households = 0
        sizes = self.t["household_sizes"]
        mean_size = sum(s * c for s, c in sizes) / sum(c for _, c in sizes)
        g = self.t["gq_share"]
        self.gq_household_share = g * mean_size / (1 - g + g * mean_size)
        # ESR by (band, schooling group, DIS, SEX) cell; by band alone for
        # (rare) cells the tables never saw.
        self.esr = {}
        merged: dict[int, dict] = {}
        for cell, pairs in self.t["esr"].items():
            band, group, dis, sex = (int(x) for x in cell.split("|"))
            self.esr[self._cell(band, group, dis, sex)] = pairs
            into = merged.setdefault(band, {})
            for code, count in pairs:
                into[code] = into.get(code, 0) + count
        self.esr_by_band = {b: [[c, w] for c, w in m.items()] for b, m in merged.items()}
        self.runs = self._filler_runs()
        self.pools = self._filler_pools()

    @staticmethod
    def _cell(band, group, dis, sex):
        return ((band * 4 + group) * 3 + dis) * 3 + sex

    # -- households and people ------------------------------------------------
    def _households(self, n: int):
        rng, t = self.rng, self.t
        estimate = int(n / 1.5) + 16
        while True:
            is_gq = rng.random(estimate) < self.gq_household_share
            size = np.where(is_gq, 1, _draw(rng, t["household_sizes"], estimate))
            if size.sum() >= n:
                break
            estimate *= 2
        ends = np.cumsum(size)
        count = int(np.searchsorted(ends, n)) + 1
        size, is_gq = size[:count], is_gq[:count]
        size[-1] -= int(ends[count - 1] - n)  # the last household is cut to fit
        numbers = self.households + 1 + np.arange(count)
        self.households += count
        if self.households > MAX_HOUSEHOLDS:
            raise ValueError("too many households for 7-digit serial numbers; "
                             f"write at most {MAX_ROWS:,} rows")
        geo = np.array(t["geo"], dtype=np.int64)
        where = rng.choice(len(geo), size=count, p=geo[:, 4] / geo[:, 4].sum())
        first_person = np.repeat(np.cumsum(size) - size, size)
        sporder = np.arange(n) - first_person + 1
        return (np.repeat(numbers, size), np.repeat(is_gq, size), sporder,
                np.repeat(geo[where], size, axis=0))

    def _ages(self, n: int, first: np.ndarray) -> np.ndarray:
        """Ages from the real distribution of first persons of housing units
        (``first``) and of everyone else."""
        age = np.empty(n, dtype=np.int64)
        for mask, table in ((first, "age_first"), (~first, "age_others")):
            weights = np.array(self.t[table], dtype=np.float64)
            age[mask] = self.rng.choice(100, size=int(mask.sum()), p=weights / weights.sum())
        return age

    def batch(self, n: int) -> dict[str, np.ndarray]:
        """n persons as integer codes per generated column (-1 = blank)."""
        rng, t = self.rng, self.t
        serial, is_gq, sporder, geo = self._households(n)
        age = self._ages(n, (sporder == 1) & ~is_gq)
        band = self.band_of_age[age]
        v: dict[str, np.ndarray] = {"SERIALNO": serial, "__gq": is_gq.astype(np.int64),
                                    "SPORDER": sporder, "ST": geo[:, 0], "PUMA": geo[:, 1],
                                    "DIVISION": geo[:, 2], "REGION": geo[:, 3], "AGEP": age}
        for name, per_band in t["by_band"].items():
            v[name] = _by_group(rng, band, lambda b, per_band=per_band: per_band[b])
        self._relationships(v, band, is_gq, sporder)
        # Nativity follows citizenship (1-3 born a citizen, 4-5 foreign born).
        v["NATIVITY"] = np.where(v["CIT"] >= 4, 2, 1)
        v["POBP"] = _by_group(rng, v["NATIVITY"], lambda n: t["pobp"][str(n)])
        highs = np.array([high for _, high in t["schl_groups"]])
        group = np.searchsorted(highs, np.where(v["SCHL"] < 0, 0, v["SCHL"]))
        cells = self._cell(band, group, v["DIS"], v["SEX"])
        v["ESR"] = _by_group(rng, cells, lambda c: self.esr.get(c) or
                             self.esr_by_band[c // 36])
        employed = np.isin(v["ESR"], [1, 2, 4, 5])
        adult = age >= 16
        key = {1: "True", 0: "False"}
        v["WKHP"] = np.where(adult, _by_group(rng, employed.astype(np.int64),
                                              lambda e: t["wkhp"][key[e]]), -1)
        v["COW"] = np.where(adult, _by_group(rng, employed.astype(np.int64),
                                             lambda e: t["cow"][key[e]]), -1)
        v["OCCP"] = np.where(v["COW"] >= 0, _draw(rng, t["occp"], n), -1)
        v["PINCP"] = self._income(group, employed, age)
        q = np.array(t["pwgtp"], dtype=np.float64)
        v["PWGTP"] = np.maximum(1, np.interp(rng.random(n), np.linspace(0, 1, len(q)), q)
                                .astype(np.int64))
        return v

    def _relationships(self, v, band, is_gq, sporder) -> None:
        """RELP: 00 for the first person of a housing unit, 16/17 in group
        quarters, another household relationship otherwise."""
        rng = self.rng
        relp = v["RELP"]
        head = ~is_gq & (sporder == 1)
        relp[head] = 0
        others = np.flatnonzero(~is_gq & (sporder > 1))
        for b in np.unique(band[others]):
            rows = others[band[others] == b]
            pairs = [[c, w] for c, w in self.t["by_band"]["RELP"][b] if c not in (0, 16, 17)]
            relp[rows] = _draw(rng, pairs or [[2, 1]], len(rows))
        gq = np.flatnonzero(is_gq)
        relp[gq] = np.where(rng.random(len(gq)) < 0.5, 16, 17)

    def _income(self, group, employed, age) -> np.ndarray:
        rng, t = self.rng, self.t
        income = np.full(len(age), -1, dtype=np.int64)
        for g in np.unique(group):
            for e in (False, True):
                rows = np.flatnonzero((group == g) & (employed == e) & (age >= 15))
                q = np.array(t["pincp"].get(f"{g}|{e}", t["pincp"]["0|False"]), np.float64)
                income[rows] = np.interp(rng.random(len(rows)), np.linspace(0, 1, len(q)),
                                         q).astype(np.int64)
        return income

    # -- filler columns ---------------------------------------------------------
    def _filler_runs(self) -> list[tuple[str, list[str]]]:
        """The header as pieces: ("col", name) or ("run", [filler names])."""
        generated = set(GENERATED) | set(self.t["by_band"])
        pieces: list = []
        for name in self.codebook.header:
            if name in generated:
                pieces.append(("col", name))
            elif pieces and pieces[-1][0] == "run":
                pieces[-1][1].append(name)
            else:
                pieces.append(("run", [name]))
        return pieces

    def _filler_column(self, variable, ages: np.ndarray) -> list[str]:
        """Random in-range texts of one filler column, one per age in ``ages``:
        blank below the age where the dictionary's N/A starts, else (when N/A
        is allowed for other reasons) blank half the time."""
        rng, m = self.rng, len(ages)
        limit = variable.na_below_age
        if not variable.blank_allowed:
            blank = np.zeros(m, dtype=bool)
        elif limit is not None:
            blank = ages < limit
        else:
            blank = rng.random(m) < 0.5
        if variable.ranges:
            spans = np.array([min(h - lo + 1, 1000) for lo, h in variable.ranges], np.float64)
            which = rng.choice(len(spans), size=m, p=spans / spans.sum())
            low = np.array([r[0] for r in variable.ranges])[which]
            high = np.array([r[1] for r in variable.ranges])[which]
            if variable.numeric:
                # Quantities (dollars, weights): small magnitudes are the common case.
                base = np.where((low <= 0) & (high >= 0), 0, low)
                step = np.expm1(rng.random(m) * np.log1p(high - base)).astype(np.int64)
                values = np.where(high - low > 100, base + step,
                                  rng.integers(low, high + 1))
            else:
                values = rng.integers(low, high + 1)
            pad = _pad(variable)
            texts = [str(v).zfill(pad) if v >= 0 else str(v) for v in values.tolist()]
        else:
            texts = [variable.strings[i][0] for i in rng.integers(len(variable.strings), size=m)]
        return ["" if b else t for b, t in zip(blank.tolist(), texts)]

    def _filler_pools(self) -> list[list[str]]:
        """For each run: POOL random texts per age band (band-major)."""
        ages = np.repeat([low for low, _ in self.bands], POOL)
        pools = []
        for kind, names in self.runs:
            if kind == "run":
                columns = [self._filler_column(self.codebook[name], ages) for name in names]
                pools.append([",".join(row) for row in zip(*columns)])
        return pools

    # -- text -----------------------------------------------------------------------
    def lines(self, v: dict[str, np.ndarray]):
        """The CSV lines of a batch, as a polars String Series."""
        import polars as pl  # deferred: keeps `mpidp synth --help` fast

        n = len(v["AGEP"])
        band = self.band_of_age[v["AGEP"]]
        exprs, run_index = [], 0
        frame: dict[str, object] = {}
        for kind, what in self.runs:
            if kind == "col":
                frame[what] = self._column_text(what, v, n)
                exprs.append(pl.col(what))
            else:
                pool = pl.Series(self.pools[run_index], dtype=pl.String)
                pick = band * POOL + self.rng.integers(0, POOL, size=n)
                frame[f"__run{run_index}"] = pool.gather(pick)
                exprs.append(pl.col(f"__run{run_index}"))
                run_index += 1
        return pl.DataFrame(frame).select(
            pl.concat_str(exprs, separator=",").alias("line")).get_column("line")

    def _column_text(self, name: str, v: dict, n: int):
        import polars as pl  # deferred: keeps `mpidp synth --help` fast

        if name == "RT":
            return pl.repeat("P", n, eager=True, dtype=pl.String)
        if name == "ADJINC":
            return pl.repeat("1013097", n, eager=True, dtype=pl.String)
        if name == "SERIALNO":
            kind = pl.Series(np.where(v["__gq"] == 1, "2018GQ", "2018HU"))
            return kind + pl.Series(v["SERIALNO"]).cast(pl.String).str.zfill(7)
        variable = self.codebook[name]
        values = pl.Series(v[name])
        text = values.cast(pl.String)
        pad = _pad(variable)
        if pad:
            text = text.str.zfill(pad)
        return pl.select(pl.when(values < 0).then(pl.lit("")).otherwise(text)).to_series() \
            if variable.blank_allowed else text

    def corrupt(self, lines, fraction: float):
        """Damage a random share of the lines; returns (lines, damaged count)."""
        import polars as pl  # deferred: keeps `mpidp synth --help` fast

        if fraction <= 0:
            return lines, 0
        rng = self.damage_rng
        rows = np.flatnonzero(rng.random(len(lines)) < fraction)
        if len(rows) == 0:
            return lines, 0
        header = self.codebook.header
        position = {name: header.index(name) for name in _CORRUPTIBLE}
        names = sorted(_CORRUPTIBLE)
        damaged = []
        for text, kind, pick, cut in zip(lines.gather(rows).to_list(),
                                         rng.integers(0, 4, len(rows)),
                                         rng.integers(0, len(names), len(rows)),
                                         rng.integers(12, 100, len(rows))):
            fields = text.split(",")
            name = names[pick]
            if kind == 0:
                fields[position[name]] = "x" + fields[position[name]][:1] + "?"
            elif kind == 1:
                fields[position[name]] = _CORRUPTIBLE[name]
            elif kind == 2:
                fields[position["SEX" if pick % 2 else "AGEP"]] = ""
            else:
                fields = fields[:cut]
            damaged.append(",".join(fields))
        return lines.scatter(rows, pl.Series(damaged, dtype=pl.String)), len(rows)


def rows_problem(rows: int) -> str | None:
    """Why ``--rows rows`` is refused (one line), or None: below 0, or above
    :data:`MAX_ROWS` (more households than 7-digit serial numbers can number)."""
    if rows < 0:
        return f"--rows {rows}: must be >= 0"
    if rows > MAX_ROWS:
        return (f"--rows {rows:,}: mpidp synth writes at most {MAX_ROWS:,} rows (households "
                f"are numbered with 7 digits, up to {MAX_HOUSEHOLDS:,}); ask for fewer")
    return None


def write(path: str, rows: int, seed: int = 0, corrupt_fraction: float = 0.0,
          progress: bool = False) -> int:
    """Write ``rows`` synthetic person records to ``path`` (atomically): CSV,
    gzip-compressed when ``path`` ends in ``.gz`` (any case).

    Returns:
        The number of lines damaged on purpose.

    Raises:
        ValueError: ``rows`` refused by :func:`rows_problem`, before anything
            is written.
    """
    import polars as pl  # deferred: keeps `mpidp synth --help` fast

    problem = rows_problem(rows)
    if problem is not None:
        raise ValueError(problem)

    generator = Generator(seed)
    temporary = atomic.temporary_name(path)
    bar = None
    if progress:
        from tqdm import tqdm  # deferred: only a terminal shows a bar

        bar = tqdm(total=rows, unit="rows", unit_scale=True, desc="synth", leave=False)
    damaged = 0
    try:
        with open(temporary, "wb") as raw, _compressed(raw, path) as handle:
            handle.write((",".join(generator.codebook.header) + "\n").encode())
            done = 0
            while done < rows:
                n = min(BATCH_ROWS, rows - done)
                lines = generator.lines(generator.batch(n))
                lines, hurt = generator.corrupt(lines, corrupt_fraction)
                damaged += hurt
                pl.DataFrame({"line": lines}).write_csv(handle, include_header=False,
                                                        quote_style="never")
                done += n
                if bar is not None:
                    bar.update(n)
        atomic.commit(temporary, path)
    except BaseException:
        atomic.discard(temporary)
        raise
    finally:
        if bar is not None:
            bar.close()
    return damaged


def _compressed(raw, path: str):
    """``raw`` (a binary file) as written for ``path``: a gzip stream over it for
    a name ending in ``.gz`` (its header names the final file, not the
    temporary one, and no time: the same seed gives the same bytes), else
    ``raw`` itself."""
    if str(path).lower().endswith(".gz"):
        return gzip.GzipFile(os.path.basename(str(path)), "wb", GZIP_LEVEL, raw, mtime=0)
    return contextlib.nullcontext(raw)


def run(args: argparse.Namespace) -> int:
    """Rank 0 writes the file; the other ranks wait for its verdict.

    Raises:
        PrepError: bad options or an output that cannot be written (collective).
    """
    comm = MPI.COMM_WORLD
    problem = rows_problem(args.rows)
    if problem is not None:  # up front: nothing written
        raise PrepError(problem, collective=True)
    if args.seed < 0:
        raise PrepError(f"--seed {args.seed}: must be >= 0", collective=True)
    if not 0.0 <= args.corrupt_fraction <= 1.0:
        raise PrepError(f"--corrupt-fraction {args.corrupt_fraction}: must be in [0, 1]",
                        collective=True)
    check_out_name(args.out)
    if comm.Get_rank() != 0:  # one writer; the other ranks have nothing to do
        comm.bcast(None, root=0)
        return 0
    error = None
    try:
        atomic.check_writable(args.out, example="persons.csv")
        started = time.perf_counter()
        damaged = write(args.out, args.rows, args.seed, args.corrupt_fraction,
                        progress=not args.quiet and sys.stderr.isatty())
    except (PrepError, ValueError) as exc:
        error = str(exc)
    comm.bcast(error, root=0)
    if error is not None:
        raise PrepError(error, collective=True)
    if not args.quiet:
        seconds = time.perf_counter() - started
        size = os.path.getsize(args.out)
        print(f"mpidp synth: wrote {args.out}: {args.rows:,} records, {size / 1e6:.0f} MB "
              f"in {seconds:.1f} s" + (f"; {damaged:,} lines damaged on purpose"
                                        if args.corrupt_fraction else ""), flush=True)
    return 0
