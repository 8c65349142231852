"""The one-run canary audit (engine.audit.canary): the correct engine never audits
above its claimed epsilon; deliberately broken noise is caught in every seed; the
black-box canary rows show a run without noise from its final model alone.

Sizes: 2,000 synthetic rows, an MLP with one hidden layer of 32 (610 parameters),
500 Dirac canaries, batch 100 (q = 0.05), 5 epochs (100 steps). With these the
correct engine audits at 0.0-0.3 against claims of 2 and the broken runs at
3.0-3.9 against claims of 1 (measured at 1 and 2 ranks): the margins are wide
and the seeds fixed, so the verdicts do not flake.

What the small size cannot show: noise x 0.5 (the issue's figure) is NOT
detected here. Its true epsilon is about twice the claim, and a one-run audit
with 500 canaries shows only a fraction of a claim of 1-2 (Steinke et al.'s
bound is far from tight at these sizes). So the "too little noise" test uses
noise x 0.1 (and none at all), which the audit catches at 3x the claim; the
"noise on one rank only" test is the real bug at any p >= 2 (with the
partition scheme the other ranks' coordinates then carry no noise at all).
"""
import numpy as np
import pytest
import torch

from collectives import MPI
from engine.audit import canary, canary_claim, one_run, one_run_fdp
from engine.bench import synthetic
from engine.errors import ConfigError, PrivacyError

RUN = dict(m=500, epochs=5, batch_size=100, hidden=(32,), lr=0.1)
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A synthetic file every rank sees (rank 0 writes it)."""
    world, path = MPI.COMM_WORLD, None
    if world.Get_rank() == 0:
        path = str(tmp_path_factory.mktemp("canary") / "syn.h5")
        synthetic.write(path, rows=2000, features=16, seed=0)
    return world.bcast(path, root=0)


# ------------------------------------------------------------------ the pieces
def test_secrets_are_distinct_coordinates_and_fair_coins_alike_for_every_seed_reader():
    coords, included = canary.secrets(500, 610, seed=3)
    again = canary.secrets(500, 610, seed=3)
    assert np.array_equal(coords, again[0]) and np.array_equal(included, again[1])
    assert np.unique(coords).size == 500 and coords.min() >= 0 and coords.max() < 610
    assert 200 < included.sum() < 300
    other = canary.secrets(500, 610, seed=4)
    assert not np.array_equal(included, other[1])


def test_hook_adds_exactly_C_at_its_own_sampled_included_canaries_and_records_the_data():
    coords = np.array([5, 1, 7, 3], dtype=np.int64)
    included = np.array([True, True, False, True])
    # rank 1 of 2 owns canaries 1 and 3 (j % 2 == 1); both are included
    hook = canary.CanaryHook(coords, included, rank=1, size=2, q=1.0, max_norm=0.5, seed=0)
    grad = torch.arange(10, dtype=torch.float32)
    hook(grad)
    assert hook.data.tolist() == [5.0, 1.0, 7.0, 3.0]  # before the canaries
    expected = torch.arange(10, dtype=torch.float32)
    expected[[1, 3]] += 0.5
    assert torch.equal(grad, expected) and hook.sampled == 2
    never = canary.CanaryHook(coords, included, rank=0, size=2, q=1e-12, max_norm=0.5, seed=0)
    grad = torch.zeros(10)
    never(grad)
    assert not grad.any()


def test_scores_rank_included_canaries_first_with_or_without_noise():
    rng = np.random.default_rng(0)
    T, m, q = 200, 400, 0.05
    included = rng.random(m) < 0.5
    coins = (rng.random((T, m)) < q) & included
    for sigma in (0.0, 0.3):
        residuals = coins + sigma * rng.standard_normal((T, m))
        s = canary.scores(residuals, q)
        order = np.argsort(-s)
        assert included[order[:50]].all() and not included[order[-50:]].any()


def test_noise_levels_pool_canaries_that_share_a_level_and_keep_the_others_apart():
    """A short run (25 residuals per canary) estimates each canary's noise
    poorly; pooled, every canary of a group gets its group's one level."""
    rng = np.random.default_rng(1)
    T, m = 25, 3000
    sigma = np.where(np.arange(m) % 3 == 0, 0.0, 0.8)  # a third of the canaries noiseless
    residuals = rng.standard_normal((T, m)) * sigma
    own = 1.4826 * np.median(np.abs(residuals - np.median(residuals, axis=0)), axis=0)
    noisy = sigma > 0
    assert np.abs(own[noisy] / 0.8 - 1).max() > 0.3  # one canary's estimate alone
    levels = canary.noise_levels(residuals)
    assert np.unique(levels[noisy]).size == 1
    assert levels[noisy][0] == pytest.approx(0.8, rel=0.1)  # MAD about own medians: a bit low
    assert np.all(levels[~noisy] == canary.SIGMA_FLOOR)


def test_claim_test_rejects_a_run_with_half_the_noise_and_not_the_claimed_one():
    """The idealised full-batch run (q = 1, every included canary in every
    step): scores of the claimed sigma keep the claim, half of it refutes it."""
    rng = np.random.default_rng(0)
    T, m, sigma = 25, 5000, 5.41  # epsilon 4 at delta 1e-5
    included = rng.random(m) < 0.5
    ks = one_run.default_guess_sizes(m)
    for scale, rejected in ((1.0, False), (0.5, True)):
        residuals = included + scale * sigma * rng.standard_normal((T, m))
        evidence = canary.scores(residuals, 1.0)
        assert canary_claim.claim_rejected(evidence, included, ks, 1.0, sigma, T, 1e-5,
                                     0.95) is rejected


@pytest.mark.parametrize("m, guesses, confidence, words", [
    (0, None, 0.95, "--canaries 0"), (10, 11, 0.95, "--guesses 11"),
    (10, 0, 0.95, "--guesses 0"), (10, None, 1.0, "--confidence 1.0"),
    (10, None, 0.0, "--confidence 0.0")])
def test_bad_requests_are_one_line_config_errors(m, guesses, confidence, words):
    with pytest.raises(ConfigError, match=words) as info:
        canary.check_request(m, guesses, confidence)
    assert "\n" not in str(info.value) and info.value.exit_code == 2


@pytest.mark.parametrize("m", [700, 10**8])
def test_more_canaries_than_the_model_has_coordinates_is_refused(data, m, monkeypatch):
    def made(*args):  # 10**8 canary rows filled the memory before the refusal
        raise AssertionError("canary rows were made before the request was checked")

    monkeypatch.setattr(canary, "canary_rows", made)
    with pytest.raises(ConfigError, match=f"--canaries {m} exceeds what the model allows"):
        canary.run_canary_audit(data, MPI.COMM_SELF, **{**RUN, "m": m}, epsilon=2.0)


def test_serial_audit_holds_the_claim_and_catches_missing_noise(data):
    ok = canary.run_canary_audit(data, MPI.COMM_SELF, **RUN, epsilon=2.0, seed=0)
    assert 1.9 < ok.claimed_epsilon < 2.1 and not ok.detected
    assert ok.m == 500 and ok.guesses == ok.k_in + ok.k_out and ok.ceiling > 3
    assert ok.steps == 100 and ok.q == pytest.approx(0.05) and ok.canary_samples > 0
    bad = canary.run_canary_audit(data, MPI.COMM_SELF, **RUN, epsilon=1.0, seed=0,
                                  noise_scale=0.0)
    assert bad.detected and bad.epsilon_lower_bound > 2.5, bad.text()
    assert "TEST FAULT" in bad.text()


#: The black-box audit is weak (one model, 250 guesses): over seeds 0-7 the run
#: without noise below gives f-DP bounds 0.16-0.89 (0.37-0.89 without seed 0),
#: the correct engine 0 (measured with the sampler by geometric skips; the
#: previous sampler's stream gave 0.45-0.89 and 0-0.14 over seeds 0-5).
BLACK_BOX_SEEDS = (1, 2, 3)


@pytest.mark.parametrize("seed", BLACK_BOX_SEEDS)
def test_black_box_rows_show_a_run_without_noise_and_not_the_correct_engine(data, seed):
    """The final model alone: canary rows (random inputs and labels) that a run
    without noise fitted (40 epochs) against the correct engine at a claim of 2."""
    long = dict(RUN, epochs=40, hidden=(64,), lr=1.0)
    leaky = canary.run_canary_audit(data, MPI.COMM_SELF, **long, epsilon=2.0, seed=seed,
                                    noise_scale=0.0)
    assert leaky.epsilon_blackbox_fdp > 0.2 and leaky.correct_blackbox > \
        0.6 * leaky.guesses_blackbox, leaky.text()
    ok = canary.run_canary_audit(data, MPI.COMM_SELF, **long, epsilon=2.0, seed=seed)
    assert max(ok.epsilon_blackbox, ok.epsilon_blackbox_fdp) < 0.2, ok.text()
    X, y, included = canary.canary_rows(ok.m, 16, 2, seed)
    assert X.shape == (ok.m, 17) and np.all(X[:, -1] == 1) and set(np.unique(y)) <= {0, 1}
    assert 0.4 < included.mean() < 0.6


# ------------------------------------------------------------- at any rank count
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("seed", SEEDS)
def test_the_correct_engine_never_audits_above_its_claim(data, comm, seed):
    result = canary.run_canary_audit(data, comm, **RUN, epsilon=2.0, seed=seed)
    assert result.ranks == comm.Get_size()
    assert result.epsilon_lower_bound <= result.claimed_epsilon, result.text()
    # the margin these sizes give (a bound near the claim would flake)
    assert result.epsilon_lower_bound < 1.0, result.text()
    # the f-DP analysis of the same guesses: under the claim too
    assert result.epsilon_fdp < 1.5, result.text()
    assert not result.detected, result.text()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("seed", SEEDS)
def test_noise_ten_times_too_small_is_detected_in_every_seed(data, comm, seed):
    result = canary.run_canary_audit(data, comm, **RUN, epsilon=1.0, seed=seed,
                                     noise_scale=0.1)
    assert result.detected and result.epsilon_lower_bound > 2.0, result.text()


#: Full batch (q = 1): every included canary in each of the 25 steps, the
#: setting where a one-run audit is tightest; 9,600 canaries (hidden 512).
FULL_BATCH = dict(m=9600, epochs=25, batch_size=2000, hidden=(512,), lr=0.1, guesses=250)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("seed", SEEDS)
def test_noise_half_too_small_is_detected_in_every_seed(data, comm, seed):
    """Measured at 1-4 ranks, seeds 0-3: f-DP bounds 2.50-3.95 against the
    claim of 2, the claim refuted in all 16. The correct engine, seeds 0-2:
    1.08-1.90, never refuted (the audit is tight here: 54-95% of the claim)."""
    bad = canary.run_canary_audit(data, comm, **FULL_BATCH, epsilon=2.0, seed=seed,
                                  noise_scale=0.5)
    assert bad.q == 1.0 and bad.steps == 25
    assert bad.detected and bad.epsilon_fdp > 1.1 * bad.claimed_epsilon, bad.text()
    ok = canary.run_canary_audit(data, comm, **FULL_BATCH, epsilon=2.0, seed=seed)
    assert not ok.detected and ok.epsilon_fdp <= ok.claimed_epsilon, ok.text()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("seed", SEEDS)
def test_noise_on_one_rank_only_is_detected_in_every_seed(data, comm, seed):
    result = canary.run_canary_audit(data, comm, **RUN, epsilon=1.0, seed=seed,
                                     noise_ranks=[0])
    assert result.detected and result.epsilon_lower_bound > 2.0, result.text()
    assert result.epsilon_fdp > result.claimed_epsilon, result.text()  # caught by both
    assert result.noise_ranks == [0]


# ------------------------------------------------------------------ the command
def _parse(*words):
    from engine.audit.command import config_from_args
    from engine.cli import build_parser
    return config_from_args(build_parser(only="audit").parse_args(["audit", *words]))


@pytest.mark.parametrize("words, message", [
    (("--attack", "canary", "--data", "d.h5", "--checkpoint", "run"), "drop --checkpoint"),
    (("--attack", "canary,membership", "--data", "d.h5"), "give it alone"),
    (("--attack", "membership", "--data", "d.h5"), "needs --checkpoint"),
    (("--attack", "canary", "--data", "d.h5", "--confidence", "2"), "--confidence 2")])
def test_the_command_refuses_bad_canary_requests_in_one_line(words, message):
    with pytest.raises(ConfigError, match=message):
        _parse(*words)


def _audit_options() -> set[str]:
    import argparse

    from engine.audit import command
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize("settings, error, words", [
    (dict(epsilon=2.0, delta=0.5), "PrivacyError", "--delta 0.5 is above 1/N"),
    (dict(epsilon=None), "ConfigError", "give exactly one of --noise-multiplier"),
    (dict(epsilon=2.0, noise_multiplier=1.0), "ConfigError", "give exactly one of"),
    (dict(epsilon=None, noise_multiplier=0.0), "ConfigError", "--noise-multiplier 0.0 must"),
    (dict(epsilon=None, noise_multiplier=1e-4), "PrivacyError", "PLD accounting failed")])
def test_refusals_name_only_options_the_audit_has(data, settings, error, words):
    """The training code's messages advised --allow-large-delta, --no-dp and
    --accountant rdp, options `mpidp audit` does not have; the canary audit
    now says what to do with its own (one line, exit code 2, before training)."""
    import re

    with pytest.raises(ConfigError if error == "ConfigError" else PrivacyError,
                       match=re.escape(words)) as info:
        canary.run_canary_audit(data, MPI.COMM_SELF, **{**RUN, "m": 50, **settings})
    said = str(info.value)
    assert info.value.exit_code == 2 and info.value.collective and "\n" not in said
    named = set(re.findall(r"--[a-z][a-z-]*", said))
    assert named and named <= _audit_options(), named - _audit_options()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("settings, words", [
    (dict(epsilon=2.0, delta=0.5), "Use --delta 0.0001 or smaller"),
    (dict(noise_multiplier=1e-4), "give a larger --noise-multiplier (or a --target-epsilon)")])
def test_refusals_in_the_audits_terms_reach_every_rank(data, comm, settings, words):
    """The training code finds these on rank 0 (the accountant's plan) or on
    every rank (the delta); the audit's rewording keeps them collective."""
    with pytest.raises(PrivacyError) as info:
        canary.run_canary_audit(data, comm, **{**RUN, "m": 50, **settings})
    said = str(info.value)
    assert said.endswith(words) and info.value.collective, said
    assert "--allow-large-delta" not in said and "--accountant" not in said


@pytest.mark.mpi(min_size=1)
def test_an_error_in_rank_0s_analysis_reaches_every_rank(data, comm, monkeypatch):
    """The analysis after training runs on rank 0 alone: an error there ended
    the job through rank 0's abort while the others waited in the broadcast."""
    from engine.audit import one_run_fdp

    def fails(*args, **kwargs):
        raise PrivacyError("the analysis cannot be made here")

    if comm.Get_rank() == 0:
        monkeypatch.setattr(one_run_fdp, "dpsgd_fbar_inverse", fails)
    with pytest.raises(PrivacyError, match="the analysis cannot be made here"):
        canary.run_canary_audit(data, comm, **{**RUN, "m": 50, "epsilon": 2.0})


def test_a_refuted_claim_is_exit_code_4(data, monkeypatch, capsys):
    """The command's own path, with the test-only fault slipped under it."""
    from engine.audit import command
    from engine.cli import build_parser

    real = canary.run_canary_audit
    monkeypatch.setattr(canary, "run_canary_audit",
                        lambda *args, **kw: real(*args, **kw, noise_scale=0.0))
    args = build_parser(only="audit").parse_args(
        ["audit", "--attack", "canary", "--data", data, "--canaries", "500",
         "--target-epsilon", "1", "--epochs", "5", "--batch-size", "100", "--hidden", "32",
         "--no-progress"])
    assert command.run(args) == 4
    assert "CLAIM REFUTED" in capsys.readouterr().out


def _ceiling(m: int, delta: float = 1e-5, confidence: float = 0.95) -> float:
    """The larger of the two analyses' ceilings, each found by bisection
    (one_run.largest_ceiling): the reference for canary_claim.reaches."""
    ks = one_run.default_guess_sizes(m)
    return max(one_run.largest_ceiling(m, ks, delta, confidence, bound)
               for bound in (one_run.epsilon_lower_bound, one_run_fdp.epsilon_lower_bound))


def test_reaching_a_claim_is_the_ceiling_and_the_advice_reaches_it(monkeypatch):
    """reaches() (one test per guess size) agrees with the ceilings found by
    bisection; the canaries advised reach the claim and a sixth fewer do not;
    a claim no audit up to MAX_CANARIES reaches gets None."""
    for m in (200, 500, 2000):
        top = _ceiling(m)
        assert canary_claim.reaches(m, 0.99 * top, 1e-5, 0.95)
        assert not canary_claim.reaches(m, 1.01 * top, 1e-5, 0.95)
    wanted = canary_claim.canaries_to_reach(8.0, 1e-5, 0.95, 500)
    assert _ceiling(wanted) >= 8.0 > _ceiling(int(wanted / 1.2)), wanted
    assert wanted % 10 ** max(0, len(str(wanted)) - 2) == 0  # two significant digits
    monkeypatch.setattr(canary_claim, "MAX_CANARIES", 4096)
    assert canary_claim.canaries_to_reach(12.0, 1e-5, 0.95, 500) is None
    assert one_run_fdp.gdp_epsilon(one_run_fdp.gdp_mu(8.0, 1e-5), 1e-5) == pytest.approx(8.0)


def test_a_claim_above_the_ceiling_cannot_be_refuted_and_says_what_would(data, tmp_path,
                                                                         capsys):
    """Claimed epsilon 8 with 500 canaries (ceiling 6.77): before, "consistent
    with the claim" and exit 0; now "CANNOT REFUTE", exit 5, and the advice:
    about 1,200 canaries, which the 610-parameter model cannot hold."""
    import json

    from engine.audit import command
    from engine.cli import build_parser

    out = tmp_path / "c.json"
    args = build_parser(only="audit").parse_args(
        ["audit", "--attack", "canary", "--data", data, "--canaries", "500",
         "--target-epsilon", "8", "--epochs", "5", "--batch-size", "100", "--hidden", "32",
         "--no-progress", "--json", str(out)])
    assert command.run(args) == 5
    said = capsys.readouterr().out
    report = json.loads(out.read_text())["canary"]
    assert report["verdict"] == "cannot-refute" and not report["detected"]
    top = max(report["ceiling"], report["ceiling_fdp"])
    assert top == pytest.approx(_ceiling(500), abs=1e-6) and top < report["claimed_epsilon"]
    assert f"-> CANNOT REFUTE epsilon={report['claimed_epsilon']:.3f} with these settings " \
        f"(ceiling {top:.3f})" in said
    assert "consistent with the claim" not in said
    wanted = report["canaries_needed"]
    assert _ceiling(wanted) >= report["claimed_epsilon"]
    assert f"to be able to: --canaries {wanted}, a model with at least {wanted} parameters" \
        in said and "it has 610" in said
    v, r = report["needed_correct"], report["needed_guesses"]
    assert r == 250 and v >= 248  # only a (nearly) flawless attack could reject the claim
    assert f"its test of the claim would reject it only with {v} of {r} guesses right" in said


def test_mpidp_audit_attack_canary_on_two_ranks(data, tmp_path):
    import json

    from launcher import mpidp
    out = tmp_path / "canary.json"
    done = mpidp(2, "audit", "--attack", "canary", "--data", data, "--canaries", "500",
                 "--target-epsilon", "2", "--epochs", "5", "--batch-size", "100",
                 "--hidden", "32", "--seed", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "canary audit (white-box, one run): epsilon >=" in done.stdout
    assert "f-DP analysis of the same guesses: epsilon >=" in done.stdout
    written = json.loads(out.read_text())
    report = written["canary"]
    assert written["provenance"]["command"].startswith(
        "mpiexec -n 2 mpidp audit --attack canary --data ")
    assert report["ranks"] == 2 and report["m"] == 500 and not report["detected"]
    assert report["verdict"] == "not-refuted" and "-> not refuted (this audit could have " \
        "shown up to epsilon" in done.stdout
    refused = mpidp(2, "audit", "--attack", "canary", "--data", data, "--canaries", "5000",
                    "--target-epsilon", "2", "--batch-size", "100", "--hidden", "32")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "mpidp: error: --canaries 5000 exceeds what the model allows")


# ------------------------------------------------- refused before the run it trains
def test_fewer_canaries_than_the_guesses_need_are_refused_before_training(data, monkeypatch):
    """Before: --canaries 1 trained the whole run, then failed with "ValueError:
    guess sizes k+=1, k-=1 do not fit 1 canaries". The least that works is the
    least whose default guesses fit, checked here against the guess sizes."""
    # the guesses split evenly, one "in" and one "out" at the least: 2 canaries
    assert canary.MIN_CANARIES == 2
    for m in range(2, 60):  # every m from the least on has guess sizes that fit
        assert all(k_in >= 1 and k_out >= 1 and k_in + k_out <= m
                   for k_in, k_out in one_run.default_guess_sizes(m))
    with pytest.raises(ValueError, match="need at least 2"):
        one_run.default_guess_sizes(1)

    def made(*args):
        raise AssertionError("the run started before the request was checked")

    monkeypatch.setattr(canary, "canary_rows", made)
    for guesses in (None, 1):
        with pytest.raises(ConfigError) as info:
            canary.run_canary_audit(data, MPI.COMM_SELF, **{**RUN, "m": 1}, guesses=guesses,
                                    epsilon=2.0)
        said = str(info.value)
        assert said.startswith("--canaries 1: the audit needs at least 2 canaries")
        assert said.endswith("give --canaries 2 or more") and "\n" not in said
        assert info.value.exit_code == 2 and info.value.collective


def test_the_least_canaries_audit_to_the_end(data):
    """m = MIN_CANARIES runs through the whole analysis (a short run)."""
    done = canary.run_canary_audit(data, MPI.COMM_SELF, **{**RUN, "m": 2, "epochs": 1},
                                   epsilon=2.0)
    assert done.m == 2 and done.k_in == done.k_out == 1 and done.verdict == "cannot-refute"


def _canary_args(data, *extra):
    from engine.cli import build_parser
    return build_parser(only="audit").parse_args(
        ["audit", "--attack", "canary", "--data", data, "--canaries", "50",
         "--target-epsilon", "2", "--epochs", "1", "--batch-size", "100", "--hidden", "32",
         "--no-progress", *extra])


def test_the_canary_audits_json_is_checked_before_the_run(data, tmp_path, monkeypatch):
    """Before: --json naming the --data file replaced it with the report (exit
    0); a missing directory or a directory failed only after the run, exit 74
    through MPI_Abort. Now one line, exit 2, before any work, as the other
    attacks do."""
    import shutil

    from engine.audit import command
    from engine.errors import OutputError

    def trains(*args, **kw):
        raise AssertionError("the run started before --json was checked")

    monkeypatch.setattr(canary, "run_canary_audit", trains)
    mine = str(tmp_path / "mine.h5")
    shutil.copy(data, mine)
    before = open(mine, "rb").read()
    (tmp_path / "d").mkdir()
    for given, words in ((mine, "--json .*mine.h5 is the file of --data"),
                         (str(tmp_path / "nodir" / "c.json"), "does not exist .*never its "
                          "parent"),
                         (str(tmp_path / "d"), r"is a directory; give a file name, e\.g\. "
                          r".*d/out\.json")):
        with pytest.raises(OutputError, match=words) as info:
            command.run(_canary_args(mine, "--json", given))
        assert info.value.exit_code == 2 and info.value.collective
    assert open(mine, "rb").read() == before


def test_a_report_that_cannot_be_written_at_the_end_is_one_error_on_every_rank(
        data, tmp_path, monkeypatch, capsys):
    """Rank 0's write failing (disk full meanwhile) raised on rank 0 alone, and
    the job ended through MPI_Abort's banner; now every rank raises it, exit 74."""
    from engine.audit import command
    from engine.errors import WriteFailed

    def full(path, report):
        raise WriteFailed(f"--json {path}: cannot write the report: No space left on device")

    monkeypatch.setattr(command, "write_json", full)
    with pytest.raises(WriteFailed, match="No space left") as info:
        command.run(_canary_args(data, "--canaries", "2", "--json", str(tmp_path / "c.json")))
    assert info.value.exit_code == 74 and info.value.collective


def test_a_signal_during_the_run_stops_the_audit_as_a_signal_does(data, monkeypatch):
    """Before: SIGTERM or SIGINT during the run's training ended every rank with
    "RuntimeError: the audited run took 3 of 20 steps" (exit 1) and MPI_Abort;
    the trainer had stopped at a step boundary and returned 128 + n. Now the
    audit raises the stop, which mpidp reports as "stopped by SIGTERM (exit
    code 143)" (engine.spmd.run_spmd)."""
    import os
    import signal
    import threading

    from engine.stopping import Interrupted, forget_signals

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    real, calls = canary.CanaryHook.__call__, [0]

    def signalled(self, grad):  # the signal lands during the third step
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the trainer, not raised
        real(self, grad)

    monkeypatch.setattr(canary.CanaryHook, "__call__", signalled)
    try:
        with pytest.raises(Interrupted) as info:
            canary.run_canary_audit(data, MPI.COMM_SELF, **{**RUN, "m": 50, "epochs": 1},
                                    epsilon=2.0)
    finally:
        forget_signals()
    assert info.value.signum == signal.SIGTERM and 3 <= calls[0] < 20
    assert canary.stopped(130).signum == signal.SIGINT
    assert isinstance(canary.stopped(75), RuntimeError)
