"""What a run prints: its first lines and its last.

The functions read a :class:`engine.trainer.Trainer` that has been set up
(its settings, model, engine, plan and history) and return lines; the
trainer prints them on rank 0.
"""
from __future__ import annotations

import numpy as np

from engine import checkpoint as ckpt
from engine.nn import model_names
from engine.stopping import monitored_accuracy

#: The built-in models whose layers ``--hidden`` sets; every other model
#: (``logreg``, the image models, a ``MODULE:FACTORY``) ignores it.
HIDDEN_MODELS = ("mlp", "embedding-mlp")


def hidden_unused(model: str) -> str | None:
    """Why ``--hidden`` does not shape ``--model model`` (``has no hidden
    layers``), or None where it does (:data:`HIDDEN_MODELS`)."""
    if model in HIDDEN_MODELS:
        return None
    if model == "logreg":
        return "has no hidden layers"
    if model_names.is_user_factory(model):
        return "is built by its factory from the file's features and classes alone"
    return "has a fixed architecture"


def plural(n: int, word: str) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _number(value: float | None) -> str:
    """An accuracy in a message: 4 decimals, or nan when there is none."""
    return f"{value:.4f}" if value is not None else "nan"


def unit_name(t) -> str:
    """What epsilon protects, in the run's words: ``person`` or ``household``
    (``--privacy-unit``), ``image`` for a row of an image file."""
    return "image" if t.info.is_image and t.cfg.privacy_unit == "person" \
        else t.cfg.privacy_unit


def first_line(t) -> str | None:
    """The first line of a resumed run, or of one with --allow-large-delta."""
    parts = []
    if t.resumed_from is not None:
        budget = t.resumed_from.get("budget")
        parts.append(f"resumed the run in {t.cfg.checkpoint_dir} at "
                     f"{t.resumed_from['text']}"
                     + (f" of budget {budget:.3f}" if budget is not None else ""))
        before = t.history[-1].get("threads") if t.history else None
        if before is not None and before != t.threads:
            # the kernels' partial sums follow the thread count: same privacy,
            # other last bits than the uninterrupted run (docs/lifecycle.md)
            parts.append(f"on {plural(t.threads, 'thread')} per rank where the run had "
                         f"{before}, so its parameters will differ in the last bits from "
                         f"an uninterrupted run's (--threads {before} resumes bit-identically)")
    if t.large_delta:
        parts.append(f"WARNING --allow-large-delta: {t.large_delta}")
    return "mpidp train: " + "; ".join(parts) if parts else None


def describe(t) -> list[str]:
    """The lines a run starts with: where it resumes, notes, the step that runs,
    the model and data, and the privacy plan."""
    from engine.run.threads import thread_facts, thread_label  # torch, numba: loaded by now

    lines: list[str] = []
    cfg = t.cfg
    first = first_line(t)
    if first:
        lines.append(first)
    if t.lock is not None and t.lock.note:
        lines.append(f"note: {t.lock.note}")
    if t.thread_note:
        lines.append(t.thread_note)
    unused = hidden_unused(cfg.model)
    if unused and "hidden" in (t.given or ()):
        lines.append(f"note: --model {cfg.model} {unused}: --hidden "
                     f"{','.join(map(str, cfg.hidden)) or repr('')} is not used")
    if t.step_note:
        lines.append(f"mpidp train: on {t.placement.device.type}, {t.step_note}")
    if not t.warm:
        lines.append("mpidp train: the first run with this machine's caches: epoch 1 "
                     "compiles the kernels and the all-reduce tries its algorithms (once; "
                     "`mpidp warmup --data FILE` pays this before the runs that count)")
    unit = ("" if not cfg.dp else f"epsilon protects each {unit_name(t)} (one row); "
            if cfg.privacy_unit == "person"
            else "epsilon protects each household (all its rows at once); ")
    households = ("" if cfg.privacy_unit == "person"
                  else f" in {t.n_train:,} households")
    lines.append(f"mpidp train: {unit}{t.model.describe()} on {cfg.data} "
                 f"({t.info.rows['train']:,} training rows{households}, "
                 f"{t.info.n_features} features), "
                 f"{t.size} rank(s) x {thread_label(thread_facts(t.threads))}, kernels "
                 f"{t.engine.backends['clip_rows']}"
                 + ("" if t.engine.backends.get("mlp_step", "composed") == "composed"
                    else " (the MLP step in one call)" if t.engine.parts == 1
                    else f" (the MLP step in one call, its rows cut over "
                         f"{t.engine.parts} threads)")
                 + ("" if t.placement.device.type == "cpu"
                    else f", rank 0 on {t.placement.describe()}"))
    if cfg.dp:
        acct = t.accountant
        per = "" if cfg.privacy_unit == "person" else " households"
        lines.append(f"DP-SGD: C={cfg.max_grad_norm:g}, sigma={acct.sigma:.4f}, expected "
                     f"batch {cfg.batch_size}{per} (q={t.q:.3g}, {cfg.sampling}), "
                     f"{plural(t.steps_per_epoch, 'step')}/epoch; planned epsilon="
                     f"{t.planned_epsilon:.3f} at delta={cfg.delta:g} "
                     f"({acct.describe()}), budget {t.budget:.3f}")
        if not t.sampler.assumption_met:
            lines.append("WARNING: --sampling shuffle is outside the accountant's "
                         "assumption (Poisson sampling): epsilon is NOT a guarantee")
    else:
        lines.append(f"non-private (--no-dp): expected batch {cfg.batch_size}, "
                     f"{plural(t.steps_per_epoch, 'step')}/epoch")
    return lines


def stated_privacy(t, spent: float | None) -> dict:
    """What a finished run states of its privacy: the statement its ``best.pt``
    holds (:func:`engine.checkpoint.stated_privacy`: for a run that
    ``--target-accuracy`` stopped, its budget; for ``--sampling shuffle``, no
    guarantee), with its delta."""
    statement = ckpt.stated_privacy({"dp": t.cfg.dp, "sampling": t.cfg.sampling}, spent,
                                    getattr(t, "budget", None), t.history)
    statement["delta"] = t.cfg.delta if statement["epsilon"] is not None else None
    return statement


def summary(t) -> list[str]:
    """The lines a finished run ends with: the epsilon stated is the guarantee
    (:func:`stated_privacy`), as in ``best.pt`` and ``mpidp eval``."""
    lines: list[str] = []
    last = t.history[-1] if t.history else {}
    times = [r["epoch_time_s"] for r in t.history if r.get("epoch_time_s")]
    eps = last.get("epsilon")
    val = ""
    chosen = None
    if t.val is not None:
        chosen = (t.selection.best["val_accuracy"] if t.selection.best is not None
                  else last.get("val_accuracy"))
    if chosen is not None and np.isfinite(chosen):  # an empty val split: no figure
        val = (f"val accuracy {_number(chosen)} (epoch "
               f"{t.selection.selected_epoch(last.get('epoch', 0))}, "
               + ("selected), " if t.selection.best is not None else "the last), "))
    test = ("no test split" if not t.info.rows.get("test")  # --test-fraction 0
            else f"test accuracy {_number(last.get('test_accuracy'))}")
    lines.append(f"done: {plural(len(t.history), 'epoch')}, {val}{test}, "
                 + ckpt.epsilon_text(stated_privacy(t, eps), unit_name(t)) + ", "
                 + f"{np.median(times) if times else float('nan'):.2f} s/epoch (median)")
    if not t.cfg.checkpoint_dir:
        lines.append("the trained model was not saved: give --checkpoint-dir DIR to keep it "
                     "(for mpidp eval and resuming); engine.train returns it as Run.model")
    if last.get("stop_reason") == "target_accuracy":
        which = "validation" if t.val is not None else "test"
        lines.append(f"stopped early: {which} accuracy {monitored_accuracy(last):.4f} >= "
                     f"--target-accuracy {t.cfg.target_accuracy:g} after "
                     f"{last['train_time_s']:.2f} s of training (time to accuracy)")
    elif last.get("stop_reason") == "time_budget":
        lines.append(f"stopped early: {last['train_time_s']:.2f} s of training reached "
                     f"--time-budget {t.cfg.time_budget:g} s")
    return lines
