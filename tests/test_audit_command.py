"""mpidp audit end to end: attacks work, DP protects, ranks agree, bad inputs are refused."""
import json
import math
import shutil

import h5py
import numpy as np
import pytest

from collectives.runtime import MPI
from engine.bench import synthetic
from engine.audit.command import AuditConfig, run_audit
from engine.audit.inputs import AuditMismatch, SplitTooSmall
from engine.audit.inversion import AttributeNotFound
from engine.config import TrainConfig
from engine.errors import CheckpointError, ConfigError, DataError, OutputError
from engine.trainer import Trainer
from launcher import mpidp

#: Same architecture and optimizer for both models; the overfit one trains
#: 100 epochs without privacy, the private one 10 epochs at sigma 5 (epsilon ~1.06).
COMMON = dict(hidden=(64, 64), optimizer="adam", lr=0.01, batch_size=32, progress=False)
OVERFIT = dict(dp=False, epochs=100, **COMMON)
PRIVATE = dict(noise_multiplier=5.0, epochs=10, **COMMON)


class _Null:
    def write(self, text):
        pass

    def flush(self):
        pass


def _random_labels_file(path, rows=400, test_rows=400, seed=2, **attrs):
    """A contract file whose labels are coin flips: a model can only memorise them."""
    synthetic.write(path, rows=rows, features=12, test_rows=test_rows, seed=seed,
                       numeric=4, attrs=attrs or None)
    rng = np.random.default_rng(seed)
    with h5py.File(path, "r+") as f:
        for split in ("train", "test"):
            f[f"{split}/y"][...] = rng.integers(0, 2, f[f"{split}/y"].shape[0])
    return str(path)


def _train(data, directory, seed=2, **settings):
    epochs = settings["epochs"]   # one checkpoint and one evaluation, at the end
    cfg = TrainConfig(data=str(data), checkpoint_dir=str(directory), seed=seed,
                      checkpoint_every=epochs, eval_every=epochs, **settings)
    cfg.validate()
    assert Trainer(cfg, MPI.COMM_SELF, out=_Null()).run() == 0
    return str(directory)


def _make_models(root):
    data = _random_labels_file(root / "coins.h5")
    return {"data": data, "overfit": _train(data, root / "overfit", **OVERFIT),
            "private": _train(data, root / "private", **PRIVATE)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The data file and two checkpoints, made by this process alone."""
    return _make_models(tmp_path_factory.mktemp("audit"))


@pytest.fixture(scope="module")
def shared_model(tmp_path_factory):
    """A data file and a (shorter) overfit model, made by rank 0 in a directory
    every rank sees."""
    world, made = MPI.COMM_WORLD, None
    if world.Get_rank() == 0:
        root = tmp_path_factory.mktemp("audit")
        data = _random_labels_file(root / "coins.h5")
        made = {"data": data,
                "overfit": _train(data, root / "overfit", **{**OVERFIT, "epochs": 30})}
    return world.bcast(made, root=0)


def _audit(checkpoint, data, comm=MPI.COMM_SELF, **kw):
    kw.setdefault("attribute", "CAT0")
    kw.setdefault("resamples", 200)
    cfg = AuditConfig(checkpoint=checkpoint, data=data, progress=False, **kw)
    cfg.validate()
    return run_audit(cfg, comm, out=_Null())


def _attack(report, name):
    return next(a for a in report["membership"]["attacks"] if a["attack"] == name)


def test_overfit_model_is_vulnerable_and_the_private_one_is_not(models):
    over = _audit(models["overfit"], models["data"])
    private = _audit(models["private"], models["data"])
    assert over["target"]["private"] is False
    assert private["target"]["private"] and private["target"]["epsilon"] < 1.2
    assert over["rows"]["members"] == 200 and over["rows"]["nonmembers"] == 200
    # The overfit model memorised coin flips: members' loss ~0, non-members' large.
    assert over["fit"]["member_accuracy"] > 0.95 and over["fit"]["nonmember_accuracy"] < 0.65
    loss_over, loss_dp = _attack(over, "loss"), _attack(private, "loss")
    auc_over, auc_dp = loss_over["estimate"]["auc"], loss_dp["estimate"]["auc"]
    assert auc_over > 0.65 and auc_dp < 0.62 and auc_over - auc_dp > 0.12
    assert loss_over["ci"]["auc"][0] > loss_dp["ci"]["auc"][1]     # intervals apart
    assert loss_over["estimate"]["advantage"] > 0.35 > 0.2 > loss_dp["estimate"]["advantage"]
    assert loss_over["estimate"]["yeom_balanced_accuracy"] > 0.6
    for report in (over, private):
        for attack in report["membership"]["attacks"]:
            for key, (lo, hi) in attack["ci"].items():
                assert lo <= attack["estimate"][key] + 1e-12 and attack["estimate"][key] <= hi + 1e-12
    calibrated = _attack(over, "calibrated")["estimate"]
    assert calibrated["auc"] > 0.6
    # half of each split is the population sample; the reference model takes as
    # many of its rows as the target trained on, the same share from each split
    assert over["rows"]["population"] == 400
    assert over["reference"]["rows_from_train"] == over["reference"]["rows_from_test"] == 200
    inv = over["inversion"]
    assert inv["members"]["rows"] == 200 and inv["prior_rows"] == 400
    assert 0 <= inv["members"]["accuracy"] <= 1


def test_only_the_asked_attacks_run(models):
    report = _audit(models["overfit"], models["data"], attacks=("inversion",))
    assert "membership" not in report and "inversion" in report and "reference" not in report
    report = _audit(models["overfit"], models["data"], attacks=("membership",),
                    calibration=False, max_rows=50, resamples=0)
    assert [a["attack"] for a in report["membership"]["attacks"]] == ["loss"]
    assert report["rows"]["members"] == 50 and "inversion" not in report


@pytest.mark.mpi(min_size=2)
def test_the_audit_on_p_ranks_equals_one_rank(comm, shared_model):
    """Ranks score their own shards and split the bootstrap; the report is the
    same as one process's (sums may differ in the last bit)."""
    quick = dict(resamples=200, reference_epochs=10)
    many = _audit(shared_model["overfit"], shared_model["data"], comm, **quick)
    one = None
    if comm.Get_rank() == 0:
        one = _audit(shared_model["overfit"], shared_model["data"], **quick)
    one = comm.bcast(one, root=0)
    assert many["ranks"] == comm.Get_size() and one["ranks"] == 1

    def compare(a, b, where):
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                if k not in ("ranks", "threads"):
                    compare(a[k], b[k], f"{where}/{k}")
        elif isinstance(a, list):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                compare(x, y, f"{where}[{i}]")
        elif isinstance(a, float):
            assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (where, a, b)
        else:
            assert a == b, (where, a, b)

    compare(many, one, "")


def _copy_with(src, dst, **attrs):
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
    return str(dst)


def test_bad_inputs_give_clear_errors(models, tmp_path):
    ckpt, data = models["overfit"], models["data"]
    cases = [
        (dict(data=_copy_with(data, tmp_path / "task.h5", task="income")), AuditMismatch,
         "task 'income'"),
        (dict(data=_copy_with(data, tmp_path / "enc.h5", encoding_fingerprint="0" * 64)),
         AuditMismatch, "encoded differently"),
        (dict(data=_random_labels_file(tmp_path / "rows.h5", rows=440)), AuditMismatch,
         "not the model's training set"),
        (dict(checkpoint=str(tmp_path / "nowhere")), CheckpointError, "does not exist"),
        (dict(data=str(tmp_path / "none.h5")), DataError, "does not exist"),
        (dict(attribute="SEX"), AttributeNotFound, "CAT0"),
        (dict(max_rows=5), SplitTooSmall, "--max-rows 5"),
        (dict(data=ckpt), DataError, "swapped"),
        (dict(checkpoint=data), CheckpointError, "swapped"),
        # outputs before any work: a missing directory, a directory for a file
        (dict(json=str(tmp_path / "no" / "a.json"), data=str(tmp_path / "none.h5")),
         OutputError, "does not exist .*never its parent"),
        (dict(json=str(tmp_path)), OutputError, "is a directory"),
    ]
    for change, error, words in cases:
        args = {"checkpoint": ckpt, "data": data, **change}
        with pytest.raises(error, match=words) as info:
            _audit(args.pop("checkpoint"), args.pop("data"), **args)
        assert info.value.exit_code == 2 and info.value.collective
    small = _random_labels_file(tmp_path / "small.h5", rows=60, test_rows=30)
    tiny = _train(small, tmp_path / "tiny", **{**OVERFIT, "epochs": 1, "batch_size": 8})
    with pytest.raises(SplitTooSmall, match="15 members"):
        _audit(tiny, small)
    for bad in (dict(attacks=("membership", "canary")), dict(confidence=1.5)):
        with pytest.raises(ConfigError):
            AuditConfig(checkpoint=ckpt, data=data, **bad).validate()


def test_the_command_at_two_ranks(models, tmp_path):
    out = tmp_path / "audit.json"
    done = mpidp(2, "audit", "--checkpoint", models["overfit"], "--data", models["data"],
                 "--attribute", "CAT0", "--bootstrap", "200", "--json", str(out), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "membership inference" in done.stdout and "attribute inference of CAT0" in done.stdout
    assert done.stdout.count("mpidp audit:") == 1          # rank 0 alone prints
    report = json.loads(out.read_text())
    assert report["ranks"] == 2 and report["membership"]["attacks"][0]["resamples"] == 200
    # (a mismatched file is refused in-process above; this checks the one-line
    # error and exit code of the command itself, on an error found early)
    failed = mpidp(2, "audit", "--checkpoint", models["overfit"], "--data", models["data"],
                   "--attack", "membership,canary", "--json", str(tmp_path / "bad.json"),
                   timeout=120)
    assert failed.returncode == 2
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mpidp: error: --attack"), lines
    assert not (tmp_path / "bad.json").exists()
    # the canary run's options with another attack: refused, not ignored
    failed = mpidp(2, "audit", "--checkpoint", models["overfit"], "--data", models["data"],
                   "--attack", "membership", "--canaries", "50", "--epochs", "5",
                   timeout=120)
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert failed.returncode == 2 and len(lines) == 1 and lines[0] == (
        "mpidp: error: --canaries, --epochs: options of --attack canary (the run it "
        "trains), not used by --attack membership: drop them"), lines


def _parse(*words):
    from engine.audit.command import config_from_args
    from engine.cli import build_parser
    args = build_parser(only="audit").parse_args(["audit", *words])
    return config_from_args(args), args


MEMBERSHIP = ("--checkpoint", "run", "--data", "d.h5", "--attack", "membership")


@pytest.mark.parametrize("words, named", [
    (MEMBERSHIP + ("--canaries", "50"), "--canaries: an option of --attack canary "
     "(the run it trains), not used by --attack membership: drop it"),
    (("--checkpoint", "run", "--data", "d.h5", "--epochs", "5", "--hidden", "3", "--lr", "9",
      "--target-epsilon", "3"), "--target-epsilon, --epochs, --lr, --hidden: options of "
     "--attack canary (the run it trains), not used by --attack membership,inversion"),
    (MEMBERSHIP + ("--delta", "1e-5"), "--delta: an option of --attack canary"),
    (MEMBERSHIP + ("--guesses", "10", "--noise-multiplier", "1", "--batch-size", "9",
                   "--max-grad-norm", "2"), "--guesses, --noise-multiplier, --batch-size, "
     "--max-grad-norm: options of --attack canary")])
def test_the_canary_runs_options_are_refused_with_another_attack(words, named):
    """Before: `--attack membership --epochs 5 --hidden 3 --lr 9 --canaries 50
    --target-epsilon 3` ran a normal audit, every one of them ignored."""
    with pytest.raises(ConfigError) as info:
        _parse(*words)
    assert named in str(info.value) and "\n" not in str(info.value)
    assert info.value.exit_code == 2 and info.value.collective


@pytest.mark.parametrize("attack, extra, named", [
    ("canary", ("--attribute", "MAR"), "--attribute is for --attack inversion, not used by "
     "--attack canary: drop it"),
    ("membership", ("--attribute", "MAR"), "--attribute is for --attack inversion"),
    ("inversion", ("--no-calibration",), "--no-calibration is for --attack membership, not "
     "used by --attack inversion"),
    ("inversion", ("--reference-epochs", "2"), "--reference-epochs is for --attack membership"),
    ("canary", ("--bootstrap", "500"), "--bootstrap is for --attack membership"),
    ("canary", ("--max-rows", "100"), "--max-rows is for --attack membership or inversion")])
def test_an_attacks_options_are_refused_without_it(attack, extra, named):
    """Each was accepted and ignored where its attack did not run."""
    where = ("--data", "d.h5") if attack == "canary" else ("--checkpoint", "run", "--data",
                                                            "d.h5")
    with pytest.raises(ConfigError) as info:
        _parse("--attack", attack, *where, *extra)
    assert str(info.value) == named or str(info.value).startswith(named), info.value
    assert info.value.exit_code == 2 and info.value.collective


def test_the_canary_run_keeps_its_defaults_and_takes_its_options():
    from engine.audit.command import CANARY_DEFAULTS, canary_settings

    cfg, args = _parse("--attack", "canary", "--data", "d.h5")
    assert canary_settings(args) == CANARY_DEFAULTS and CANARY_DEFAULTS["canaries"] == 500
    cfg, args = _parse("--attack", "canary", "--data", "d.h5", "--canaries", "50",
                       "--delta", "1e-6", "--hidden", "8,8")
    assert canary_settings(args) == {**CANARY_DEFAULTS, "canaries": 50, "delta": 1e-6,
                                     "hidden": "8,8"}
    cfg, args = _parse(*MEMBERSHIP)  # none given: fine
    assert cfg.attacks == ("membership",)


def test_an_interval_needs_enough_resamples_and_none_means_none():
    """Before: --bootstrap 1 gave a zero-width "95% CI" that excluded the estimate,
    and --bootstrap 0 still claimed a CI in the header."""
    from engine.audit import report as report_mod

    for given, least in (("1", 200), ("199", 200), ("19", 20)):
        confidence = ("--confidence", "0.5") if least == 20 else ()
        with pytest.raises(ConfigError) as info:
            _parse(*MEMBERSHIP, "--bootstrap", given, *confidence)
        said = str(info.value)
        assert said.startswith(f"--bootstrap {given}: a ") and f"at least {least} " in said
        assert "--bootstrap 0 for no intervals" in said and info.value.exit_code == 2
    assert _parse(*MEMBERSHIP, "--bootstrap", "0")[0].resamples == 0
    assert _parse(*MEMBERSHIP, "--bootstrap", "200")[0].resamples == 200
    assert _parse(*MEMBERSHIP)[0].resamples == 1000
    assert _parse(*MEMBERSHIP, "--confidence", "0.999")[0].resamples == 10_000  # not refused
    # the inversion's intervals are exact: --bootstrap with it alone is refused
    with pytest.raises(ConfigError, match="--bootstrap is for --attack membership"):
        _parse(*MEMBERSHIP[:-1], "inversion", "--bootstrap", "1")
    attack = {"title": "loss threshold", "confidence": 0.95, "resamples": 0,
              "estimate": {"auc": 0.6, "advantage": 0.1}, "ci": {}, "p_values": {}}
    head = report_mod.membership_lines({"ci_method": "m", "attacks": [attack],
                                        "members": 20, "nonmembers": 20})[0]
    assert head == "membership inference (no intervals: --bootstrap 0)"
    attack["resamples"] = 200
    head = report_mod.membership_lines({"ci_method": "m", "attacks": [attack]})[0]
    assert head == "membership inference (95% CI: m, 200 resamples)"


def test_a_file_without_attributes_points_to_the_membership_attack_which_works(tmp_path):
    """Before, the default attacks on an image file (MNIST) stopped at "--attribute
    SEX: mnist.h5 has no one-hot encoded attribute of that name; it has: none"."""
    data = synthetic.write(tmp_path / "numeric.h5", rows=200, features=12, numeric=12,
                           test_rows=200, seed=2)
    model = _train(data, tmp_path / "run", **{**OVERFIT, "epochs": 2})
    with pytest.raises(AttributeNotFound) as info:
        _audit(model, data, attribute="SEX", resamples=0)
    said = str(info.value)
    assert said.startswith("the inversion attack (--attack inversion, run by default) ")
    assert "census file" in said and said.endswith("audit it with --attack membership")
    assert info.value.exit_code == 2 and info.value.collective
    report = _audit(model, data, attacks=("membership",), resamples=0)
    assert [a["attack"] for a in report["membership"]["attacks"]] == ["loss", "calibrated"]


def test_a_run_directory_is_audited_at_its_selected_epoch(tmp_path):
    """`--checkpoint DIR` names the run's model (best.pt's epoch), a file its own
    parameters: the audit and `mpidp eval` read the same ones (checkpoint.model_of)."""
    import torch

    import engine
    from engine.audit.inputs import load_target
    from engine.bench import synthetic
    from collectives import MPI

    data = synthetic.write(tmp_path / "v.h5", rows=600, features=10, seed=3, val_rows=150)
    run_dir = str(tmp_path / "run")
    run = engine.train(data, epochs=4, batch_size=60, noise_multiplier=0.5, seed=1,
                       quiet=True, checkpoint_dir=run_dir)
    assert run.exit_code == 0
    whole = load_target(run_dir, data, MPI.COMM_SELF)
    last = load_target(run_dir + "/checkpoint.pt", data, MPI.COMM_SELF)
    best = last.payload["best"]["params"].to(torch.float64)
    assert torch.equal(whole.params, best)  # the directory: its best.pt
    assert torch.equal(last.params, last.payload["params"].to(torch.float64))
    # best.pt records the data's layout only: the directory is checked with its
    # checkpoint.pt's record, so a file split otherwise is refused (it was
    # audited as the training set, "same task, encoding and split sizes")
    from engine.audit.inputs import AuditMismatch

    resplit = synthetic.write(tmp_path / "r.h5", rows=500, features=10, seed=3, val_rows=150)
    with pytest.raises(AuditMismatch, match="its /train rows are not the model's training"):
        load_target(run_dir, resplit, MPI.COMM_SELF)


def test_the_report_names_the_audited_models_step_and_says_what_it_found(tmp_path):
    """The header names the step of the parameters audited (a run directory's
    selected epoch), not the step its run ended at (before: step 280 for a
    model of step 168); membership and inversion each end in a verdict."""
    import engine
    from engine.audit import report as report_mod
    from engine.bench import synthetic

    data = synthetic.write(tmp_path / "v.h5", rows=900, features=6, test_rows=200,
                           val_rows=200, seed=7)
    run_dir = str(tmp_path / "run")  # these settings select epoch 1 or 2 of 4
    run = engine.train(data, epochs=4, batch_size=64, hidden=(8,), noise_multiplier=4.0,
                       lr=0.5, seed=22, allreduce="ring", quiet=True, checkpoint_dir=run_dir)
    assert run.exit_code == 0 and run.selected_epoch < 4
    report = _audit(run_dir, data, attribute="CAT0", resamples=200, calibration=False)
    target = report["target"]
    step = run.selected_epoch * run.history[0]["step"]
    assert target["step"] == step and target["selected_epoch"] == run.selected_epoch
    assert target["run_step"] == run.history[-1]["step"] > step
    text = report_mod.text(report)
    head = text.splitlines()[0]
    assert f"step {step} (epoch {run.selected_epoch}, the selected model; its run ended at " \
        f"step {target['run_step']})" in head
    # the words of mpidp train and mpidp eval (engine.checkpoint.epsilon_text)
    assert f"DP-SGD, epsilon {target['epsilon']:.3f} per person (delta 1e-05)," in head
    assert target["epsilon_is_guarantee"] and "NOT a guarantee" not in text
    verdicts = [line for line in text.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 2
    assert report["membership"]["verdict"]["text"] in verdicts[0]
    assert report["inversion"]["verdict"]["text"] in verdicts[1]


def _exact_advantage_bound(eps: float, delta: float) -> float:
    """max over FPR of TPR - FPR under TPR <= e^eps FPR + delta and
    1 - FPR <= e^eps (1 - TPR) + delta, on a fine grid (the reference)."""
    fpr = np.linspace(0, 1, 200_001)
    tpr = np.minimum.reduce([np.exp(eps) * fpr + delta,
                             1 - np.exp(-eps) * (1 - fpr - delta), np.ones_like(fpr)])
    return float(np.max(tpr - fpr))


def test_membership_verdict_in_words():
    """Not detected, detected within the epsilon, and beyond what the epsilon
    allows, from the p-values and the advantage's interval; the bound is the
    largest TPR - FPR an (epsilon, delta)-DP mechanism allows."""
    from engine.audit.report import advantage_ceiling, membership_verdict

    for eps, delta in ((0.5, 1e-5), (1.0, 1e-5), (4.0, 1e-3)):
        assert advantage_ceiling(eps, delta) == pytest.approx(_exact_advantage_bound(eps, delta),
                                                              abs=1e-5)

    def section(p, advantage_ci):
        attack = {"title": "loss threshold", "confidence": 0.95,
                  "p_values": {"auc_p_value": p, "advantage_p_value": p},
                  "ci": {"advantage": advantage_ci}}
        return {"members": 200, "nonmembers": 200, "attacks": [attack]}

    private = {"private": True, "epsilon": 1.0, "delta": 1e-5}
    quiet = membership_verdict(section(0.3, [0.0, 0.1]), private)
    assert quiet["verdict"] == "not-detected" and quiet["text"].startswith(
        "no membership leakage detected") and "not a guarantee" in quiet["text"]
    assert "at most 0.462" in quiet["text"]
    # p = 0.03 is below 0.05 but not below 0.05 / 2 (two tests): not detected
    assert membership_verdict(section(0.03, [0.0, 0.2]), private)["verdict"] == "not-detected"
    found = membership_verdict(section(1e-6, [0.2, 0.4]), private)
    assert found["verdict"] == "leakage" and "within what the epsilon allows" in found["text"]
    open_model = membership_verdict(section(1e-6, [0.5, 0.7]), {"private": False})
    assert open_model["verdict"] == "leakage" and "not private" in open_model["text"]
    beyond = membership_verdict(section(1e-6, [0.5, 0.7]), private)
    assert beyond["verdict"] == "beyond-epsilon" and beyond["text"].startswith(
        "LEAKAGE BEYOND THE CLAIM") and "0.500" in beyond["text"]


def test_inversion_verdict_in_words():
    from engine.audit.report import inversion_verdict

    def group(acc, lo, hi, base=0.5):
        return {"accuracy": acc, "accuracy_ci": [lo, hi], "baseline_accuracy": base}

    def section(members, nonmembers):
        return {"attribute": "SEX", "members": members, "nonmembers": nonmembers}

    apart = inversion_verdict(section(group(0.8, 0.75, 0.85), group(0.6, 0.55, 0.65)))
    assert apart["verdict"] == "members-exposed" and "training rows' SEX" in apart["text"]
    alike = inversion_verdict(section(group(0.7, 0.64, 0.76), group(0.68, 0.62, 0.74)))
    assert alike["verdict"] == "population" and "not about its training rows" in alike["text"]
    none = inversion_verdict(section(group(0.51, 0.45, 0.57), group(0.5, 0.44, 0.56)))
    assert none["verdict"] == "not-detected"


def test_inversion_verdict_follows_the_evidence_of_each_group():
    """Before: members above the prior's guess and non-members not (the hunter's
    figures) read "better than the prior's guess ... members and non-members
    alike ... not about its training rows". Intervals: exact Clopper-Pearson of
    the counts, by SciPy (the reference), through the verdict function."""
    from scipy import stats as scipy_stats

    from engine.audit.report import inversion_verdict

    def group(right, rows, base):
        ci = scipy_stats.binomtest(right, rows).proportion_ci(0.95, method="exact")
        return {"accuracy": right / rows, "accuracy_ci": [ci.low, ci.high],
                "baseline_accuracy": base}

    def verdict(members, nonmembers):
        return inversion_verdict({"attribute": "SEX", "members": members,
                                  "nonmembers": nonmembers})

    members, others = group(466, 800, 0.534), group(419, 800, 0.517)  # 0.582 vs 0.524
    assert members["accuracy_ci"][0] > 0.534 and others["accuracy_ci"][0] < 0.517
    assert members["accuracy_ci"][0] < others["accuracy_ci"][1]  # the intervals overlap
    found = verdict(members, others)
    assert found["verdict"] == "members-only", found
    said = found["text"]
    assert said.startswith("the attack infers SEX better than the prior's guess for members "
                           "only") and "a sign that the model memorised" in said
    assert "alike" not in said and "not about its training rows" not in said
    assert "members 0.583 [0.547, 0.617], non-members 0.524 [0.488, 0.559]" in said
    both = verdict(group(470, 800, 0.5), group(460, 800, 0.5))
    assert both["verdict"] == "population" and "members and non-members alike" in both["text"]
    # non-members above the prior, members' interval reaching theirs: the population
    only_others = verdict(group(420, 800, 0.5), group(460, 800, 0.5))
    assert only_others["verdict"] == "population" and "alike" not in only_others["text"]
    assert verdict(group(520, 800, 0.5), group(420, 800, 0.5))["verdict"] == "members-exposed"
    assert verdict(group(405, 800, 0.5), group(400, 800, 0.5))["verdict"] == "not-detected"


def test_an_epsilon_that_is_no_guarantee_bounds_no_attack():
    """A --sampling shuffle model's epsilon is no guarantee (mpidp train and eval
    say so): before, the audit showed "DP-SGD, epsilon 1.000 (delta 1e-05)" and
    "allows any attack an advantage of at most 0.462 ... (the epsilon is)"."""
    from engine.audit.report import membership_verdict

    attack = {"title": "loss threshold", "confidence": 0.95,
              "p_values": {"auc_p_value": 0.3, "advantage_p_value": 0.3},
              "ci": {"advantage": [0.5, 0.7]}}
    section = {"members": 200, "nonmembers": 200, "attacks": [attack]}
    reason = "--sampling shuffle is outside the accountant's assumption (Poisson sampling)"
    shuffled = {"private": True, "epsilon": 1.0, "delta": 1e-5, "epsilon_is_guarantee": False,
                "epsilon_text": f"epsilon 1.000 per person (delta 1e-05), NOT a guarantee: "
                                f"{reason}"}
    quiet = membership_verdict(section, shuffled)
    assert quiet["verdict"] == "not-detected" and quiet["bound"] is None
    assert "at most" not in quiet["text"] and "(the epsilon is)" not in quiet["text"]
    assert f"NOT a guarantee: {reason}, so it bounds no attack's advantage" in quiet["text"]
    attack["p_values"] = {"auc_p_value": 1e-6, "advantage_p_value": 1e-6}
    found = membership_verdict(section, shuffled)  # above 0.462, yet no claim to exceed
    assert found["verdict"] == "leakage" and "so it bounds no attack's advantage" in found["text"]
    assert membership_verdict(section, {**shuffled, "epsilon_is_guarantee": True})[
        "verdict"] == "beyond-epsilon"


def test_the_audit_of_a_shuffled_run_says_its_epsilon_is_no_guarantee(tmp_path):
    """The report's target holds the statement mpidp eval reads (and its words:
    engine.checkpoint.epsilon_text), from the checkpoint's own record."""
    import json as json_mod

    from engine import checkpoint as ckpt
    from engine.audit import report as report_mod

    data = _random_labels_file(tmp_path / "coins.h5", rows=120, test_rows=120)
    run = _train(data, tmp_path / "run", **{**PRIVATE, "epochs": 1, "sampling": "shuffle"})
    out = tmp_path / "a.json"
    report = _audit(run, data, attacks=("membership",), calibration=False, resamples=0,
                    json=str(out))
    target = report["target"]
    said = ckpt.epsilon_text({"epsilon": target["epsilon"], "delta": 1e-5,
                              "guarantee": False, "not_a_guarantee": ckpt.SHUFFLE_REASON},
                             "person")
    assert target["epsilon_is_guarantee"] is False and target["epsilon_text"] == said
    assert target["not_a_guarantee"] == ckpt.SHUFFLE_REASON
    head = report_mod.text(report).splitlines()[0]
    assert f"DP-SGD, {said}, step" in head
    verdict = report["membership"]["verdict"]
    assert verdict["bound"] is None and "at most" not in verdict["text"]
    assert json_mod.loads(out.read_text())["target"]["epsilon_is_guarantee"] is False


def test_a_directory_given_as_a_file_is_told_a_name_of_the_options_kind(tmp_path):
    """Before: `--plot d.png` (a directory) was told "e.g. d.png/out.json"."""
    from engine import outputs

    (tmp_path / "d.png").mkdir()
    for option, name in (("--plot", "plot.png"), ("--json", "out.json"),
                         ("--metrics", "metrics.jsonl")):
        with pytest.raises(OutputError) as info:
            outputs.check_all({option: str(tmp_path / "d.png")})
        assert str(info.value).endswith(f"give a file name, e.g. {tmp_path / 'd.png' / name}")
