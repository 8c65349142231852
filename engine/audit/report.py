"""The audit's report for people: a few lines and two tables (rank 0 prints it).

:func:`text` formats the dictionary that :func:`engine.audit.command.run_audit`
returns (the same one ``--json`` writes).
"""
from __future__ import annotations


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


def header_lines(report: dict) -> list[str]:
    target, data, rows, fit = report["target"], report["data"], report["rows"], report["fit"]
    if target["private"]:
        eps = target.get("epsilon")
        privacy = (f"DP-SGD, epsilon {eps:.3f} (delta {target.get('delta'):g})"
                   if eps is not None else "DP-SGD")
    else:
        privacy = "non-private"
    lines = [f"mpidp audit: {target['model']}, {privacy}, step {target.get('step')} "
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
    lines = [f"membership inference ({pct} CI: {section['ci_method']}, "
             f"{first['resamples']} resamples)"]
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
    return lines


def text(report: dict) -> str:
    """The whole report as text."""
    lines = header_lines(report)
    if report.get("membership"):
        lines += [""] + membership_lines(report["membership"])
        lines += reference_lines(report.get("reference"))
    if report.get("inversion"):
        lines += [""] + inversion_lines(report["inversion"])
    return "\n".join(lines)
