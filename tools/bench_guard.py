"""Compare a benchmark's ratios with the last run on the same kind of machine.

    mpidp bench dpsgd --json new.json ...
    python tools/bench_guard.py new.json            # compare; exit 1 if a ratio moved
    python tools/bench_guard.py new.json --store    # and keep it as the machine's latest

Results are kept per machine in ``results/machines/<key>/<bench>-<date>.json``;
the key is the CPU model and its vector extensions (the two things that make
a ratio differ between machines), ``__limited`` added for a run under
``tools/as_avx2.sh``, so a run is compared only with runs on the same kind of
CPU. Only ratios measured side by side in one run are compared
(``dp_over_nondp``, ``generic_over_fused``, ...: every key with a
``<key>_spread`` of [min, max] over the run's rounds), never absolute times.
A ratio has moved when the new median lies outside the old run's spread
widened by the new run's half-width: the run-to-run noise both runs show.
Not a timed test: run it by hand, on a quiet machine, after a benchmark.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "results" / "machines"


def machine_key(document: dict) -> str:
    """``amd-epyc__avx2-avx512f...``: the CPU model and vector extensions of a run."""
    machine = document.get("machine") or (document.get("provenance") or {}).get("machine") or {}
    cpu = re.sub(r"[^a-z0-9]+", "-", str(machine.get("cpu", "unknown")).lower()).strip("-")
    vectors = "-".join(v for v in machine.get("vector_extensions", []) if "avx" in v) or "novec"
    limited = "__limited" if machine.get("isa_limit") else ""  # tools/as_avx2.sh
    return f"{cpu}__{vectors}{limited}"


def ratios(document: dict) -> dict[str, tuple[float, float, float]]:
    """``key -> (median, low, high)`` of every ratio with a spread, also those of
    a per-model document (``models -> name -> ...``, keys ``name/key``)."""
    found = {}

    def scan(prefix: str, part: dict) -> None:
        for key, value in part.items():
            spread = part.get(f"{key}_spread")
            if isinstance(value, (int, float)) and isinstance(spread, list) and len(spread) == 2:
                found[prefix + key] = (float(value), float(spread[0]), float(spread[1]))

    scan("", document)
    for name, part in (document.get("models") or {}).items():
        if isinstance(part, dict):
            scan(f"{name}/", part)
    return found


def kind_of(path: Path, document: dict) -> str:
    """Which benchmark wrote it, and at how many threads (files of one kind
    are compared: a 2-thread run never with a 1-thread one)."""
    kind = "dpsgd-models" if "models" in document else path.stem.split("-")[0] or "bench"
    threads = document.get("threads")
    return f"{kind}-{threads}t" if isinstance(threads, int) else kind


def latest(key: str, kind: str) -> Path | None:
    folder = STORE / key
    runs = sorted(folder.glob(f"{kind}-*.json")) if folder.is_dir() else []
    return runs[-1] if runs else None


def compare(old: dict, new: dict) -> list[str]:
    """Lines for the ratios of both runs; those that moved start with ``MOVED``."""
    lines = []
    before, after = ratios(old), ratios(new)
    for key in sorted(set(before) & set(after)):
        m0, lo0, hi0 = before[key]
        m1, lo1, hi1 = after[key]
        half = (hi1 - lo1) / 2
        moved = not (lo0 - half <= m1 <= hi0 + half)
        lines.append(f"{'MOVED' if moved else 'same '} {key}: {m0:.3f} [{lo0:.3f}, {hi0:.3f}]"
                     f" -> {m1:.3f} [{lo1:.3f}, {hi1:.3f}]")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a benchmark's --json file")
    parser.add_argument("--kind", default=None,
                        help="what to compare it with (default: the file name's first word, "
                        "or dpsgd-models for bench dpsgd --models)")
    parser.add_argument("--store", action="store_true",
                        help="keep it as this machine's latest run of its kind")
    args = parser.parse_args(argv)
    new = json.loads(args.result.read_text(encoding="utf-8"))
    key, kind = machine_key(new), args.kind or kind_of(args.result, new)
    previous = latest(key, kind)
    moved = False
    if previous is None:
        print(f"no earlier {kind} run on {key}: nothing to compare")
    else:
        print(f"{args.result} against {previous.relative_to(ROOT)} ({key}):")
        lines = compare(json.loads(previous.read_text(encoding="utf-8")), new)
        print("\n".join(lines) if lines else "no ratio in common")
        moved = any(line.startswith("MOVED") for line in lines)
    if args.store:
        target = STORE / key / f"{kind}-{date.today().isoformat()}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.result, target)
        print(f"stored as {target.relative_to(ROOT)}")
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
