"""Running the trials of ``mpidp tune``: side by side on sub-communicators.

With p ranks and P parallel trials, the ranks split into P groups of
contiguous ranks (``comm.Split(color=rank * P // p)``: on a launcher that
places ranks by blocks a group stays on one node). The trials are assigned
to the groups before any runs, largest first to the least loaded group
(an estimate of each trial's work: epochs x parameters, with a per-step
overhead), and each group runs its trials one after another with
``engine.train(data, comm=group, quiet=True, ...)``, then scores the
returned model on the ``val`` split over the same group (:func:`score`).

A trial that fails with an error raised alike on every rank of its group
(a bad combination of settings, a privacy target out of reach, a model
whose loss became NaN or infinite) is recorded as failed with its message,
and the group goes on with its next trial. Anything else — an error on
some ranks only, an MPI error, a rank that dies — is not caught: it ends
the whole job (:func:`engine.spmd.run_spmd`), as in every mpidp command.

Each finished trial (done or failed) is one line of ``OUT/trials.jsonl``,
written by its group's first rank in one ``write`` with ``O_APPEND`` and
flushed to disk (``fsync``) before the next trial starts; a line cut short
by a crash is ignored when the file is read back. A re-run of the same
search skips the trials the file holds (keyed by a hash of the trial's
number and settings). Stop signals are acted on between trials and at the
trainer's step boundaries: the group stops, the finished trials stay.
A trial's ``best.pt`` is written inside :func:`engine.checkpoint.tune_trial`:
it states the trial's own epsilon as no guarantee (one trial of a search
that has not ended) until the search's end rewrites the chosen trial's file
with the epsilon including the tuning (:func:`engine.tune.report.publish`).

The val score: accuracy over the group's shards of ``val``, all-reduced.
For a private random search whose val split is not declared public, the
released score carries Gaussian noise of standard deviation
``score_std`` on the count of correct predictions (sensitivity 1: one
person; with ``--privacy-unit household`` the count is the sum over
households of each one's fraction of correct predictions, sensitivity 1
household), drawn by the group's first rank and shared; only that noisy
score is recorded, never the exact one.

``--select-on worst_group_val_accuracy`` scores each trial by its worst
``--group-by`` group of at least ``--min-group-size`` validation rows
(:mod:`engine.groups`). Privately, the released vector is each group's
count of rows and of correct predictions, every entry with Gaussian noise
of standard deviation ``score_std``: one person changes one group's two
counts by at most 1 each, an L2 sensitivity of sqrt(2)
(:data:`GROUP_SENSITIVITY`); the worst group (among those whose noisy row
count reaches the threshold) and the val accuracy (the noisy counts
summed) are computed from that vector alone, and nothing else is
recorded. Only for the person unit: a household may span groups.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass

import numpy as np

import collectives
from collectives import MPI
from engine.errors import DataError, MpidpError, WriteFailed, agree
from engine.stopping import StartupInterrupted, check_startup, signal_count
from engine.tune.space import describe_point, from_plain, plain, settings_key

TRIALS_FILE = "trials.jsonl"
STATE_FILE = "search.json"
REPORT_FILE = "tune.json"
TRIALS_DIR = "trials"
#: Rows scored at a time.
CHUNK_ROWS = 65536
#: L2 sensitivity of the per-group counts (rows, correct) a private worst-group
#: score releases: one person moves one group's two counts by at most 1 each.
GROUP_SENSITIVITY = 2 ** 0.5


@dataclass
class Trial:
    """One trial of the plan: its number (1-based), key, settings and seed."""

    number: int
    key: str
    settings: dict
    seed: int | None

    @classmethod
    def make(cls, number: int, settings: dict, seed: int | None) -> "Trial":
        return cls(number, settings_key(number, settings), plain(settings),
                   trial_seed(seed, number))

    def to_json(self) -> dict:
        return {"trial": self.number, "key": self.key, "settings": self.settings,
                "seed": self.seed}

    @classmethod
    def from_json(cls, data: dict) -> "Trial":
        return cls(int(data["trial"]), str(data["key"]), dict(data["settings"]),
                   None if data.get("seed") is None else int(data["seed"]))

    def directory(self, out: str) -> str:
        return os.path.join(out, TRIALS_DIR, f"trial-{self.number:04d}")


def trial_seed(seed: int | None, number: int) -> int | None:
    """Trial ``number``'s seed from the search's ``--seed`` (None: each trial random)."""
    if seed is None:
        return None
    state = np.random.SeedSequence([int(seed) % 2 ** 63, number]).generate_state(1, np.uint64)
    return int(state[0] >> np.uint64(2))


def plan_rng(seed: int | None) -> np.random.Generator:
    """The generator that draws the plan (rank 0; the plan is then broadcast)."""
    if seed is None:
        return np.random.default_rng(secrets.randbits(128))
    return np.random.default_rng([int(seed) % 2 ** 63, 0x7E5])


# -- results ----------------------------------------------------------------------------

def read_results(path: str) -> dict[str, dict]:
    """The records of ``trials.jsonl`` by key (a missing file: none); lines that
    are not complete JSON records (a write cut short) are skipped."""
    found: dict[str, dict] = {}
    try:
        with open(path, "rb") as handle:
            lines = handle.read().split(b"\n")
    except FileNotFoundError:
        return found
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("key"), str) \
                and record.get("status") in ("ok", "failed"):
            found[record["key"]] = record
    return found


def rewrite_results(path: str, records: list[dict]) -> None:
    """``trials.jsonl`` with exactly ``records`` (a torn last line dropped), atomically."""
    from engine.outputs import replace_file

    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    replace_file(path, text, lambda reason: f"--out: cannot write {path}: {reason}",
                 mode=0o600)  # every trial's exact scores: as private as the data


def append_result(path: str, record: dict) -> None:
    """Append one record as one line (one ``write`` with ``O_APPEND``), flushed to disk.

    Raises:
        WriteFailed: the line could not be written.
    """
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # private
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise WriteFailed(f"--out: cannot append to {path}: {exc.strerror}; the trials "
                          "recorded before are intact (re-run to continue)") from None


# -- scoring ----------------------------------------------------------------------------

def score(model, shard, comm, algorithm: str = "auto", cells: np.ndarray | None = None,
          n_cells: int = 0) -> dict:
    """Collective over ``comm``: the model's val counts over all ranks' shards.

    Args:
        cells: each local row's group cell (:meth:`engine.groups.Cells.index`),
            to count rows and correct predictions per group as well.

    Returns ``{"rows", "correct", "loss", "units", "unit_score"}``: rows and
    correct predictions, mean cross-entropy, and the privacy units with their
    score (rows and correct predictions for the person unit; households and
    the sum of each one's fraction of correct predictions when the shard has
    ``groups``); with ``cells``, ``"group_rows"`` and ``"group_correct"``
    (int64 ``[n_cells]``).
    """
    import torch  # deferred: keeps `mpidp tune --help` fast

    correct = np.zeros(shard.n_local, dtype=np.float64)
    loss_sum = 0.0
    if shard.n_local:
        model.eval()
        device = next(iter(model.parameters()), torch.empty(0)).device
        with torch.no_grad():
            for start in range(0, shard.n_local, CHUNK_ROWS):
                # a copy: a model may change its input in place, and X is the data
                xb = torch.from_numpy(shard.X[start:start + CHUNK_ROWS, :-1]).to(device,
                                                                                copy=True)
                yb = torch.from_numpy(shard.y[start:start + CHUNK_ROWS]).to(device)
                out = model(xb)
                correct[start:start + yb.shape[0]] = (out.argmax(1) == yb).cpu().numpy()
                loss_sum += float(torch.nn.functional.cross_entropy(
                    out.double(), yb, reduction="sum"))
    if shard.groups is not None and shard.n_local:
        sizes = np.diff(shard.groups)
        unit_score = float((np.add.reduceat(correct, shard.groups[:-1]) / sizes).sum())
        units = int(sizes.shape[0])
    else:
        unit_score, units = float(correct.sum()), shard.n_local
    sums = np.array([shard.n_local, correct.sum(), loss_sum, units, unit_score],
                    dtype=np.float64)
    if cells is not None:  # exact integers in float64 (fewer than 2^53 rows)
        sums = np.concatenate([sums, np.bincount(cells, minlength=n_cells),
                               np.bincount(cells, weights=correct, minlength=n_cells)])
    collectives.allreduce(sums, comm, algorithm=algorithm)
    rows = int(sums[0])
    out = {"rows": rows, "correct": int(round(sums[1])),
           "loss": float(sums[2] / rows) if rows else float("nan"),
           "units": int(sums[3]), "unit_score": float(sums[4])}
    if cells is not None:
        out["group_rows"] = np.rint(sums[5:5 + n_cells]).astype(np.int64)
        out["group_correct"] = np.rint(sums[5 + n_cells:]).astype(np.int64)
    return out


def worst_group(rows: np.ndarray, correct: np.ndarray, labels, min_size: int
                ) -> tuple[float | None, str | None]:
    """The lowest accuracy of the groups with at least ``min_size`` rows, and the
    group's label; (None, None) when none has (counts may be noisy floats)."""
    scored = np.flatnonzero(np.asarray(rows) >= min_size)
    if not scored.size:
        return None, None
    accuracy = np.clip(np.asarray(correct, dtype=np.float64)[scored]
                       / np.asarray(rows, dtype=np.float64)[scored], 0.0, 1.0)
    at = int(np.argmin(accuracy))
    return float(accuracy[at]), labels[int(scored[at])]


# -- assignment -------------------------------------------------------------------------

def trial_cost(settings: dict, n_features: int, n_classes: int) -> float:
    """A rough relative cost of a trial (for balancing groups only): epochs x
    parameters of its MLP, with an overhead per step that grows as batches shrink."""
    hidden = tuple(settings.get("hidden", (128, 128)))
    if settings.get("model") == "logreg":
        hidden = ()
    dims = (n_features, *hidden, n_classes)
    params = sum((a + 1) * b for a, b in zip(dims[:-1], dims[1:]))
    batch = max(1, int(settings.get("batch_size", 256)))
    return float(settings.get("epochs", 10)) * (params + 64) * (1 + 256 / batch)


def assign(trials: list[Trial], sizes: list[int], cost) -> list[list[Trial]]:
    """Trials per group: each trial, largest first, to the group that would
    finish it soonest (load / ranks); every list in trial order."""
    loads = [0.0] * len(sizes)
    groups: list[list[Trial]] = [[] for _ in sizes]
    for trial in sorted(trials, key=lambda t: (-cost(t), t.number)):
        c = cost(trial)
        best = min(range(len(sizes)), key=lambda g: ((loads[g] + c) / sizes[g], g))
        loads[best] += c
        groups[best].append(trial)
    return [sorted(g, key=lambda t: t.number) for g in groups]


# -- running ----------------------------------------------------------------------------

@dataclass
class Settings:
    """What every trial of the search shares."""

    data: str
    out: str
    base: dict  # TrainConfig options common to every trial
    score_std: float | None  # noise on the released score (None: exact)
    seed: int | None
    total: int  # trials in the plan
    shown: list[str]  # the settings a progress line names
    unit: str  # privacy unit
    objective: str = "val_accuracy"  # or worst_group_val_accuracy (--select-on)
    group_by: str | None = None  # the attribute of worst_group_val_accuracy
    min_group_size: int = 100  # the smallest validation group it scores


class GroupRunner:
    """Runs trials on one group (a sub-communicator); collective over it."""

    def __init__(self, settings: Settings, comm, color: int, val_shard, cells=None) -> None:
        self.s = settings
        self.comm = comm
        self.color = color
        self.val = val_shard
        #: worst_group_val_accuracy: (the groups' Cells, each val row's cell)
        self.cells = cells
        self.rank = comm.Get_rank()
        self.stop = False  # a stop signal came during the last trial, after its last step

    def _noise(self, trial: Trial) -> float:
        value = 0.0
        if self.rank == 0 and self.s.score_std is not None:
            rng = (np.random.default_rng([int(self.s.seed) % 2 ** 63, trial.number, 0x5C0])
                   if self.s.seed is not None
                   else np.random.default_rng(secrets.randbits(128)))
            value = float(rng.normal(0.0, self.s.score_std))
        return float(self.comm.bcast(value, root=0))

    def _group_noise(self, trial: Trial, n: int) -> np.ndarray:
        """The noise of a private worst-group score: ``2 n`` normals (rows, then
        correct, per group), drawn by the group's first rank and shared."""
        value = np.zeros(2 * n)
        if self.rank == 0:
            rng = (np.random.default_rng([int(self.s.seed) % 2 ** 63, trial.number, 0x6A0])
                   if self.s.seed is not None
                   else np.random.default_rng(secrets.randbits(128)))
            value = rng.normal(0.0, self.s.score_std, size=2 * n)
        return np.asarray(self.comm.bcast(value, root=0), dtype=np.float64)

    def _group_score(self, result: dict, trial: Trial) -> dict:
        """The record's scores of worst_group_val_accuracy (exact, or from the
        noisy per-group counts alone)."""
        cells, _ = self.cells
        rows = result["group_rows"].astype(np.float64)
        correct = result["group_correct"].astype(np.float64)
        if self.s.score_std is not None:
            noise = self._group_noise(trial, len(cells))
            rows, correct = rows + noise[:len(cells)], correct + noise[len(cells):]
            total = float(rows.sum())
            accuracy = float(np.clip(correct.sum() / total, 0.0, 1.0)) if total > 0 else None
            extra = {"val_accuracy": accuracy, "val_loss": None,
                     "val_noise_std": self.s.score_std, "val_units": None}
        else:
            extra = {}
        worst, label = worst_group(rows, correct, cells.labels, self.s.min_group_size)
        return {**extra, "val_worst_group_accuracy": worst, "val_worst_group": label,
                "group_by": self.s.group_by}

    def run(self, trial: Trial) -> dict | None:
        """Collective: train and score ``trial``; its record (on every rank of the
        group), or None when a stop signal ended it (nothing recorded)."""
        import engine  # deferred: torch and the trainer
        from engine import checkpoint as ckpt

        try:
            check_startup(self.comm, stop_on_any=True)
        except StartupInterrupted:
            return None
        settings = from_plain(trial.settings)
        options = {**self.s.base, **settings}
        epochs = int(options.get("epochs", 10))
        options.update(seed=trial.seed, eval_every=epochs, checkpoint_every=epochs,
                       checkpoint_dir=trial.directory(self.s.out), progress=False)
        record = {"trial": trial.number, "key": trial.key, "settings": trial.settings,
                  "group": self.color, "ranks": self.comm.Get_size()}
        start = time.perf_counter()
        signals = signal_count()
        try:
            # its best.pt says it is one trial of an unfinished search, not a
            # guarantee, until the search's end rewrites the chosen one
            with ckpt.tune_trial(self.s.out, trial.number):
                run = engine.train(self.s.data, comm=self.comm, quiet=True, **options)
        except StartupInterrupted:
            return None
        except MpidpError as exc:
            if not getattr(exc, "collective", False):
                raise  # raised on some ranks only: the job must end (module docstring)
            record.update(status="failed", message=f"{type(exc).__name__}: {exc}",
                          wall_s=time.perf_counter() - start)
            self._finish(record, trial)
            self.stop = bool(self.comm.allreduce(int(signal_count() > signals), op=MPI.MAX))
            return record
        if run.exit_code != 0:  # stopped by a signal: not finished, nothing kept
            if self.rank == 0:
                shutil.rmtree(trial.directory(self.s.out), ignore_errors=True)
            return None
        cells, index = self.cells if self.cells is not None else (None, None)
        result = score(run.model, self.val, self.comm, self.s.base.get("allreduce", "auto"),
                       index, len(cells) if cells is not None else 0)
        last = run.history[-1] if run.history else {}
        record.update(status="ok", message=None, epsilon=run.epsilon, delta=run.delta,
                      noise_multiplier=last.get("noise_multiplier"), steps=last.get("step"),
                      epochs_done=len(run.history), train_time_s=last.get("train_time_s"),
                      test_accuracy=last.get("test_accuracy"), val_rows=result["rows"])
        if self.s.score_std is None:
            record.update(val_accuracy=result["correct"] / result["rows"] if result["rows"]
                          else None, val_loss=result["loss"], val_noise_std=None)
        else:
            noisy = result["unit_score"] + self._noise(trial)
            # clipped to [0, 1]: post-processing of the noisy count, private as it is
            record.update(val_accuracy=min(1.0, max(0.0, noisy / result["units"]))
                          if result["units"] else None,
                          val_loss=None, val_noise_std=self.s.score_std,
                          val_units=result["units"])
        if self.cells is not None:  # --select-on worst_group_val_accuracy
            record.update(self._group_score(result, trial))
        record["wall_s"] = time.perf_counter() - start
        self._finish(record, trial)
        # A signal after the trial's last step finished it, and the trainer forgot
        # it on the way out: the group stops after recording it.
        self.stop = bool(self.comm.allreduce(int(signal_count() > signals), op=MPI.MAX))
        return record

    def _finish(self, record: dict, trial: Trial) -> None:
        """The group's first rank appends the record and prints the progress line."""
        record["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        if self.rank != 0:
            return
        append_result(os.path.join(self.s.out, TRIALS_FILE), record)
        what = describe_point(trial.settings, self.s.shown) or "(fixed settings)"
        if record["status"] == "ok":
            eps = record.get("epsilon")
            acc = record.get("val_accuracy")
            worst = record.get("val_worst_group_accuracy")
            tail = (f"val accuracy {acc:.4f}" if acc is not None else "val accuracy n/a") \
                + (f", worst group {worst:.4f} ({record['val_worst_group']})"
                   if worst is not None else "") \
                + (f", epsilon {eps:.3f}" if eps is not None else "") \
                + f", {record['wall_s']:.1f} s"
        else:
            tail = f"FAILED ({record['message']})"
        print(f"tune: trial {trial.number}/{self.s.total} [group {self.color}] {what}: {tail}",
              flush=True)


def run_search(settings: Settings, info, pending: list[Trial], parallel: int, comm
               ) -> tuple[list[dict], bool]:
    """Collective over ``comm``: run ``pending`` on ``parallel`` groups.

    Returns (the records of this invocation, on rank 0 of ``comm``; an empty
    list elsewhere; whether a stop signal ended the search early).
    """
    from engine.shard import read_shard  # deferred: h5py

    size, rank = comm.Get_size(), comm.Get_rank()
    color = rank * parallel // size
    sub = comm.Split(color, rank)
    sizes = [sum(1 for r in range(size) if r * parallel // size == g) for g in range(parallel)]
    cost = lambda t: trial_cost(from_plain(t.settings), info.n_features,  # noqa: E731
                                info.n_classes)
    mine = assign(pending, sizes, cost)[color]
    unit = "household" if settings.unit == "household" else "person"
    val = read_shard(info, "val", sub, min_rows_per_rank=0, unit=unit)
    cells = None
    if settings.objective == "worst_group_val_accuracy":
        from engine.groups import Cells, Grouping
        from engine.shard import read_group_columns  # deferred: h5py

        attribute = settings.group_by
        grouping = Cells.of(Grouping((attribute,)), {attribute: info.groups[attribute].labels})
        index = grouping.index(read_group_columns(info, "val", val, [attribute], sub))
        agree(sub, DataError(f"{info.path}: /val/groups/{attribute} holds a code its groups "
                             "attribute does not label; re-run mpidp prep")
              if (index < 0).any() else None)
        cells = (grouping, index)
    runner = GroupRunner(settings, sub, color, val, cells)
    records, stopped = [], False
    for i, trial in enumerate(mine):
        record = runner.run(trial)
        if record is None:
            stopped = True
            break
        records.append(record)
        if runner.stop and i + 1 < len(mine):
            stopped = True
            break
    # Not in a `finally`: freeing is collective, and after an error some ranks
    # would wait in it while the job should end.
    sub.Free()
    gathered = comm.gather((records if runner.rank == 0 else [], stopped), root=0)
    if rank == 0:
        out = [r for recs, _ in gathered for r in recs]
        any_stopped = any(s for _, s in gathered)
    else:
        out, any_stopped = [], None
    return out, bool(comm.bcast(any_stopped, root=0))
