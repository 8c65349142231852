"""``mpidp tune``'s state in ``--out``: the plan of trials, ``search.json``, the
directory opened and locked.

A search is identified by its options and space (:meth:`Options.identity
<engine.tune.options.Options.identity>`); :func:`load_state` returns the
state a directory holds for this search (another search there is refused),
:func:`plan_trials` draws a new search's trials, and :func:`open_out`
creates and locks the directory and clears what unfinished trials left.
All three run on rank 0.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from engine.errors import MpidpError, OutputError
from engine.tune import space as space_mod
from engine.tune.options import Options

FORMAT = "mpidp-tune"
VERSION = 1


def load_state(out: str, identity: dict) -> dict | None:
    """Rank 0: the search state of ``out`` when it is this search's; None for a new
    directory. Raises OutputError for another search, or a directory that is not one."""
    path = Path(out) / "search.json"
    if not Path(out).exists():
        return None
    if not Path(out).is_dir():
        raise OutputError(f"--out {out}: is a file, not a directory")
    if not path.exists():
        others = sorted(p.name for p in Path(out).iterdir() if p.name != "lock")
        if others:
            raise OutputError(f"--out {out}: holds files that are not an mpidp tune search "
                              f"({', '.join(others[:3])}); choose a new directory")
        return None
    try:
        state = json.loads(path.read_text())
        if state.get("format") != FORMAT:
            raise ValueError("not an mpidp tune search")
    except (OSError, ValueError) as exc:
        raise OutputError(f"--out {out}: {path} cannot be read ({exc}); choose a new "
                          "directory") from None
    theirs = state.get("identity", {})
    if theirs != identity:
        if theirs.get("space") != identity["space"]:
            was = space_mod.Space({k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                                   for k, v in theirs.get("space", {}).items()}).describe()
            raise OutputError(f"--out {out} holds a search of another space ({was!r}); "
                              "continue it with the same space, or choose another --out")
        diffs = sorted(k for k in set(theirs) | set(identity) if theirs.get(k) != identity.get(k))
        raise OutputError(f"--out {out} holds another search (it differs in "
                          f"{', '.join(diffs)}: {theirs.get(diffs[0])!r} there, "
                          f"{identity.get(diffs[0])!r} now); continue it with the same options, "
                          "or choose another --out")
    return state


def plan_trials(points: list[dict], opts: Options) -> list[dict]:
    """Rank 0: the settings of every trial, in order (the search of
    :mod:`engine.tune.command`)."""
    from engine.tune import privacy
    from engine.tune.search import plan_rng

    rng = plan_rng(opts.seed)
    if opts.mode == "random-search":
        k = privacy.draw_trials(rng, opts.distribution, float(opts.trials), opts.eta)
        return [points[int(rng.integers(len(points)))] for _ in range(k)]
    if opts.search == "random":
        n = min(opts.trials, len(points))
        return [points[int(i)] for i in rng.choice(len(points), size=n, replace=False)]
    return list(points)


def open_out(out: str, state: dict, created_state: bool, trials, finished: dict):
    """Rank 0: create and lock ``out``, write the state, clear what unfinished
    trials left. Returns the lock."""
    from engine import checkpoint_lock, outputs
    from engine.tune import search

    created = not os.path.exists(out)
    outputs.check_directory(out, "--out")
    try:
        lock = checkpoint_lock.acquire(out, command="mpidp tune")
    except MpidpError:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    try:
        if created_state:
            outputs.write_json(Path(out) / search.STATE_FILE, state, "--out", private=True)
        (Path(out) / search.TRIALS_DIR).mkdir(exist_ok=True)
        results = Path(out) / search.TRIALS_FILE
        if results.exists():  # drop a line a crash cut short
            keep = [r for r in finished.values()]
            search.rewrite_results(str(results), sorted(keep, key=lambda r: r["trial"]))
        for trial in trials:
            if trial.key not in finished:
                shutil.rmtree(trial.directory(out), ignore_errors=True)
    except OSError as exc:
        lock.release()
        raise OutputError(f"--out {out}: {exc}") from None
    except MpidpError:
        lock.release()
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return lock
