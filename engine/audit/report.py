"""The audit's report for people: a few lines, two tables and a verdict in words
for each attack (rank 0 prints it).

:func:`text` formats the dictionary that :func:`engine.audit.command.run_audit`
returns (the same one ``--json`` writes); :func:`membership_verdict` and
:func:`inversion_verdict` say what the figures mean, and ``run_audit``
stores them in that dictionary too.

The membership verdict: leakage is *detected* when a "no leakage" test
(Mann-Whitney on the AUC, Kolmogorov-Smirnov on the advantage, each
attack) rejects at the audit's confidence, Bonferroni-corrected over the
tests; for a private model it then compares the advantage with what the
model's (epsilon, delta) allows any attack on one record, ``(e^eps - 1 +
2 delta) / (e^eps + 1)`` (the largest TPR - FPR of a test against an
(epsilon, delta)-DP mechanism: TPR <= e^eps FPR + delta and 1 - FPR <=
e^eps (1 - TPR) + delta), and says when the lower end of an advantage's
interval lies above it; an epsilon its file says is no guarantee (a
``--sampling shuffle`` run: ``epsilon_is_guarantee`` false) bounds nothing,
and no ceiling is derived from it. The inversion verdict compares the attack with the
prior's guess and the members with the non-members by their exact
intervals. Attacks are lower bounds on what an attacker can do: "not
detected" is never a guarantee.
"""
from __future__ import annotations

import math


def _num(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _with_ci(value, ci, digits: int = 3) -> str:
    if value is None:
        return "-"
    if not ci or ci[0] is None:
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _p(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2g}" if value >= 1e-4 else "<1e-4"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(header), *(line(r) for r in rows)]


def advantage_ceiling(epsilon: float, delta: float) -> float:
    """The largest membership advantage (TPR - FPR) any attack can have on one
    record of an (epsilon, delta)-DP mechanism: ``(e^eps - 1 + 2 delta) / (e^eps + 1)``
    (capped at 1)."""
    if epsilon > 700:
        return 1.0
    grow = math.exp(epsilon)
    return min(1.0, (grow - 1.0 + 2.0 * delta) / (grow + 1.0))


def _epsilon_text(target: dict) -> str:
    """The audited model's epsilon in the words of ``mpidp train`` and ``mpidp
    eval`` (``target["epsilon_text"]``: :func:`engine.checkpoint.epsilon_text`,
    ``NOT a guarantee: REASON`` where the file says so); a report without them
    (an older JSON) gets ``epsilon 1.000 (delta 1e-05)``; "" without an epsilon."""
    if target.get("epsilon_text"):
        return target["epsilon_text"]
    eps = target.get("epsilon")
    if eps is None:
        return ""
    return (f"epsilon {eps:.3f}" + (" incl. tuning" if target.get("epsilon_includes_tuning")
                                    else "") + f" (delta {target.get('delta'):g})")


def is_guarantee(target: dict) -> bool:
    """Whether the audited model's epsilon is a guarantee: False where its file
    says it is not (``epsilon_is_guarantee``, as ``mpidp eval``'s JSON: a
    ``--sampling shuffle`` run, a trial of an unfinished ``mpidp tune``)."""
    return target.get("epsilon_is_guarantee") is not False


def membership_verdict(section: dict, target: dict) -> dict:
    """``{"verdict", "text"}`` of the membership attacks (module docstring).

    ``verdict`` is ``"beyond-epsilon"`` (an advantage interval lies above what
    the model's epsilon allows), ``"leakage"`` (a test of no leakage rejects,
    within the epsilon, or the model is not private) or ``"not-detected"``.
    """
    attacks = section.get("attacks") or []
    if not attacks:
        return {"verdict": "not-detected", "text": "no membership attack ran"}
    alpha = 1.0 - float(attacks[0]["confidence"])
    tests = [(a["title"], name, p) for a in attacks
             for name, p in (a.get("p_values") or {}).items() if p is not None]
    level = alpha / max(1, len(tests))
    rejected = [(title, name, p) for title, name, p in tests if p < level]
    eps = target.get("epsilon") if target.get("private") else None
    # an epsilon that is no guarantee bounds no attack: no ceiling is derived from it
    bound = (None if eps is None or not is_guarantee(target)
             else advantage_ceiling(eps, float(target.get("delta") or 0)))
    above = []
    if bound is not None:
        for a in attacks:
            low = (a.get("ci") or {}).get("advantage", [None])[0]
            if low is not None and low > bound:
                above.append((a["title"], low))
    m, n = section.get("members"), section.get("nonmembers")
    tested = (f"{len(tests)} test(s) of no leakage at {alpha:g}"
              + (f" (Bonferroni: each at {level:.2g})" if len(tests) > 1 else ""))
    allowed = ("" if bound is None else f"; {_epsilon_text(target)} allows any attack an "
               f"advantage of at most {bound:.3f}")
    no_bound = (f"{_epsilon_text(target)}, so it bounds no attack's advantage"
                if eps is not None and bound is None else "")
    if no_bound:
        allowed = f"; {no_bound}"
    if above:
        title, low = max(above, key=lambda x: x[1])
        return {"verdict": "beyond-epsilon", "bound": bound, "text": (
            f"LEAKAGE BEYOND THE CLAIM: the {title} attack's advantage is at least {low:.3f} "
            f"(the lower end of its interval), above the {bound:.3f} that "
            f"{_epsilon_text(target)} allows any attack: the model leaks more about its "
            "training rows than its epsilon says")}
    if rejected:
        title, name, p = min(rejected, key=lambda x: x[2])
        what = "the AUC" if name.startswith("auc") else "the advantage"
        within = ("the model is not private" if eps is None else no_bound if bound is None
                  else f"within what the epsilon allows ({_epsilon_text(target)}: advantage "
                  f"at most {bound:.3f})")
        return {"verdict": "leakage", "bound": bound, "text": (
            f"membership leakage detected: the {title} attack tells the {m:,} members from "
            f"the {n:,} non-members better than chance ({what}, p {_p(p)}; {tested}); "
            f"{within}")}
    return {"verdict": "not-detected", "bound": bound, "text": (
        f"no membership leakage detected: neither attack tells the {m:,} members from the "
        f"{n:,} non-members better than chance ({tested}){allowed}. The attacks are lower "
        "bounds on what an attacker can do: this is not a guarantee"
        + (" (the epsilon is)" if not no_bound else ""))}


def inversion_verdict(section: dict) -> dict:
    """``{"verdict", "text"}`` of the attribute inference (module docstring).

    ``verdict`` is one of, by the exact intervals of the attack's accuracy
    (members' and non-members') and the prior's guess (each group's baseline):

    - ``"members-exposed"``: members' attribute is inferred better than
      non-members', the intervals apart;
    - ``"members-only"``: better than the prior's guess for members (their
      interval's lower end above their baseline) and not for non-members, the
      two intervals overlapping: a sign of memorisation (membership leakage),
      not proof of it;
    - ``"population"``: better than the prior's guess for non-members (and
      for members, or members' interval reaching their baseline), the
      intervals overlapping: what the model learnt about people like them;
    - ``"not-detected"``: no better than the prior's guess for either.
    """
    attribute = section["attribute"]
    members, others = section["members"], section["nonmembers"]

    def beats_prior(group: dict) -> bool:
        ci = group.get("accuracy_ci") or [None, None]
        base = group.get("baseline_accuracy")
        return ci[0] is not None and base is not None and ci[0] > base

    m_ci = members.get("accuracy_ci") or [None, None]
    n_ci = others.get("accuracy_ci") or [None, None]
    figures = (f"members {_with_ci(members.get('accuracy'), m_ci)}, non-members "
               f"{_with_ci(others.get('accuracy'), n_ci)}, the prior's guess "
               f"{_num(members.get('baseline_accuracy'), 3)} / "
               f"{_num(others.get('baseline_accuracy'), 3)}")
    if m_ci[0] is not None and n_ci[1] is not None and m_ci[0] > n_ci[1]:
        return {"verdict": "members-exposed", "text": (
            f"the model reveals its training rows' {attribute}: the attack infers it better "
            f"for members than for non-members, the intervals apart ({figures})")}
    if beats_prior(members) and not beats_prior(others):
        return {"verdict": "members-only", "text": (
            f"the attack infers {attribute} better than the prior's guess for members only "
            f"(the lower end of their interval above their baseline; not so for "
            f"non-members), though the two intervals overlap: a sign that the model "
            f"memorised its training rows' {attribute}, not proof that it reveals more "
            f"about them ({figures})")}
    if beats_prior(others):
        alike = ("members and non-members alike" if beats_prior(members) else
                 "for non-members (members' interval reaches their baseline)")
        return {"verdict": "population", "text": (
            f"the attack infers {attribute} better than the prior's guess, {alike}, and no "
            f"better for members than for non-members (intervals overlap): what the model "
            f"reveals, it reveals about people like them, not about its training rows "
            f"({figures})")}
    return {"verdict": "not-detected", "text": (
        f"the attack infers {attribute} no better than the prior's guess ({figures})")}


def _audited(target: dict) -> str:
    """``step 168 (epoch 6, selected; the run ended at step 280)``."""
    step, epoch = target.get("step"), target.get("selected_epoch")
    if epoch is None:
        return f"step {step}"
    ended = target.get("run_step")
    return (f"step {step} (epoch {epoch}, the selected model"
            + (f"; its run ended at step {ended}" if ended is not None and ended != step
               else "") + ")")


def header_lines(report: dict) -> list[str]:
    target, data, rows, fit = report["target"], report["data"], report["rows"], report["fit"]
    if target["private"]:
        eps = _epsilon_text(target)
        privacy = f"DP-SGD, {eps}" if eps else "DP-SGD"
    else:
        privacy = "non-private"
    lines = [f"mpidp audit: {target['model']}, {privacy}, {_audited(target)} "
             f"({target['checkpoint']})",
             f"  data {data['path']} (task {data['task'] or '?'}): {rows['members']:,} members "
             f"({rows['members_from']}) vs {rows['nonmembers']:,} non-members "
             f"({rows['nonmembers_from']}); population sample {rows['population']:,} rows "
             f"({rows['population_from']}); {report['ranks']} rank(s)",
             f"  the model on them: loss {_num(fit['member_loss'])} (members) vs "
             f"{_num(fit['nonmember_loss'])} (non-members), accuracy "
             f"{_num(fit['member_accuracy'])} vs {_num(fit['nonmember_accuracy'])}"]
    lines += [f"  note: {note}" for note in report.get("notes", [])]
    return lines


def membership_lines(section: dict) -> list[str]:
    attacks = section["attacks"]
    if not attacks:
        return []
    first = attacks[0]
    pct = f"{100 * first['confidence']:g}%"
    if first["resamples"]:
        lines = [f"membership inference ({pct} CI: {section['ci_method']}, "
                 f"{first['resamples']} resamples)"]
    else:  # no replicates, no intervals: the header must not promise one
        lines = ["membership inference (no intervals: --bootstrap 0)"]
    rows = []
    for attack in attacks:
        est, ci, p = attack["estimate"], attack["ci"], attack.get("p_values", {})
        rows.append([attack["title"]] + [_with_ci(est.get(k), ci.get(k)) for k in
                                         ("auc", "advantage", "tpr_at_fpr_0.01",
                                          "tpr_at_fpr_0.001")]
                    + [f"{_p(p.get('auc_p_value'))} / {_p(p.get('advantage_p_value'))}"])
    lines += _table(["attack", "AUC", "advantage", "TPR @ 1% FPR", "TPR @ 0.1% FPR",
                     "p (AUC / adv.)"], rows)
    m, n = section.get("members"), section.get("nonmembers")
    if m and n:
        lines.append(f"no leakage would give: AUC 0.5, TPR @ x% FPR = x%, advantage about "
                     f"{((m + n) / (m * n)) ** 0.5:.3f} (sampling noise); p: one-sided "
                     "Mann-Whitney (AUC) and Kolmogorov-Smirnov (advantage) tests of no "
                     "leakage")
    for attack in attacks:
        est, ci = attack["estimate"], attack["ci"]
        if "yeom_balanced_accuracy" in est:
            lines.append(f"Yeom's threshold (loss <= mean member loss "
                         f"{est['yeom_threshold_loss']:.4f}): TPR {est['yeom_tpr']:.3f}, "
                         f"FPR {est['yeom_fpr']:.3f}, balanced accuracy "
                         f"{_with_ci(est['yeom_balanced_accuracy'], ci.get('yeom_balanced_accuracy'))}")
    return lines


def reference_lines(ref: dict | None) -> list[str]:
    if not ref:
        return []
    return [f"reference model (calibrated attack): {ref['rows']:,} population rows "
            f"({ref['rows_from_train']:,} of /train, {ref['rows_from_test']:,} of /test), "
            f"non-private, {ref['optimizer']} lr {ref['lr']:g}, "
            f"{ref['epochs']} epochs of expected batch {ref['batch_size']} "
            f"({ref['steps']} steps); its loss {ref['member_loss']:.4f} on members, "
            f"{ref['nonmember_loss']:.4f} on non-members"]


def inversion_lines(section: dict | None) -> list[str]:
    if not section:
        return []
    prior = ", ".join(f"{v}: {p:.3f}" for v, p in zip(section["values"], section["prior"]))
    lines = [f"attribute inference of {section['attribute']} ({section['title']}); prior "
             f"{prior} from {section['prior_rows']:,} population rows; CI: "
             f"{section['ci_method']}"]
    rows = []
    for name, label in (("members", "members"), ("nonmembers", "non-members")):
        group = section[name]
        rows.append([label, f"{group['rows']:,}",
                     _with_ci(group["accuracy"], group["accuracy_ci"]),
                     _with_ci(group["baseline_accuracy"], group["baseline_ci"]),
                     "-" if group["advantage"] is None else f"{group['advantage']:+.4f}"])
    lines += _table(["records", "rows", "attack accuracy",
                     f"baseline (guess {section['baseline_guess']})", "advantage"], rows)
    verdict = section.get("verdict") or inversion_verdict(section)
    lines.append(f"verdict: {verdict['text']}")
    return lines


def text(report: dict) -> str:
    """The whole report as text."""
    lines = header_lines(report)
    if report.get("membership"):
        lines += [""] + membership_lines(report["membership"])
        lines += reference_lines(report.get("reference"))
        verdict = (report["membership"].get("verdict")
                   or membership_verdict(report["membership"], report["target"]))
        lines.append(f"verdict: {verdict['text']}")
    if report.get("inversion"):
        lines += [""] + inversion_lines(report["inversion"])
    return "\n".join(lines)
