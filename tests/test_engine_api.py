"""engine.train(): the Python API, on every rank, against what the trainer records."""
import numpy as np
import pytest
import torch

import engine
from engine.bench import synthetic
from engine.errors import ConfigError


@pytest.fixture
def data(shared_tmp, comm):
    path = shared_tmp / "api.h5"
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=2000, features=12, seed=3)
    comm.Barrier()
    return str(path)


@pytest.mark.mpi(min_size=1)
def test_train_returns_the_model_epsilon_and_history(data, comm, shared_tmp):
    run = engine.train(data, comm=comm, epochs=2, batch_size=100, target_epsilon=2.0,
                       seed=1, quiet=True, metrics=str(shared_tmp / "m.jsonl"))
    assert run.exit_code == 0 and len(run.history) == 2
    assert run.epsilon == pytest.approx(run.history[-1]["epsilon"]) and run.epsilon <= 2.0
    assert run.delta == 1e-5 and run.config.target_epsilon == 2.0
    # The model is the trained network: its accuracy on the test split is the recorded one.
    import h5py

    with h5py.File(data, "r") as f:
        X, y = torch.from_numpy(f["test/X"][:]), torch.from_numpy(f["test/y"][:])
    with torch.no_grad():
        accuracy = (run.model(X).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(run.history[-1]["test_accuracy"], abs=1e-6)
    same = comm.allgather(np.concatenate([p.detach().numpy().ravel()
                                          for p in run.model.parameters()]).tobytes())
    assert all(s == same[0] for s in same)  # the same model on every rank


@pytest.mark.mpi(min_size=1)
def test_non_private_run_has_no_epsilon(data, comm):
    run = engine.train(data, comm=comm, epochs=1, dp=False, hidden=[8], quiet=True, seed=0)
    assert run.epsilon is None and run.delta is None
    assert [m.out_features for m in run.model if isinstance(m, torch.nn.Linear)] == [8, 2]


@pytest.mark.mpi(min_size=1)
def test_household_unit_and_the_pld_default_through_the_api(data, comm):
    """The API takes the command's privacy options and defaults: PLD, and
    households counted as the accountant's N with privacy_unit="household"."""
    import json

    import h5py

    from engine.dp.accountant import epsilon_for

    run = engine.train(data, comm=comm, epochs=1, batch_size=20, target_epsilon=2.0,
                       privacy_unit="household", hidden=[4], seed=2, quiet=True)
    assert run.exit_code == 0 and run.config.accountant == "pld"
    assert run.config.privacy_unit == "household"
    households = json.loads(h5py.File(data, "r").attrs["households"])["train"]
    steps = round(households / 20)
    sigma = run.history[-1]["noise_multiplier"]
    assert 1.9 < run.epsilon <= 2.0
    assert run.epsilon == pytest.approx(epsilon_for(20 / households, sigma, steps, 1e-5,
                                                    "pld"), rel=1e-3)


@pytest.mark.mpi(min_size=1)
def test_the_model_is_the_best_validation_epochs(comm, shared_tmp):
    """On a file with a validation split, run.model holds the parameters of the
    epoch selected on val_accuracy: those of a run stopped at that epoch."""
    path = shared_tmp / "val.h5"
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=900, features=6, test_rows=200, val_rows=200, seed=7)
    comm.Barrier()
    # seed 22: the best val epoch is 2 or 3 of 4 at 1, 2, 3 and 4 ranks
    common = dict(comm=comm, batch_size=64, hidden=[8], noise_multiplier=4.0, lr=0.5,
                  seed=22, allreduce="ring", quiet=True)
    run = engine.train(str(path), epochs=4, **common)
    best = run.selected_epoch
    accuracies = [r["val_accuracy"] for r in run.history]
    assert best == accuracies.index(max(accuracies)) + 1 < 4  # not simply the last
    assert run.history[-1]["selected_epoch"] == best
    shorter = engine.train(str(path), epochs=best, select_on="last", **common)
    assert shorter.selected_epoch == best
    for a, b in zip(run.model.parameters(), shorter.model.parameters()):
        assert torch.equal(a, b)
    import h5py

    with h5py.File(path, "r") as f:
        X, y = torch.from_numpy(f["test/X"][:]), torch.from_numpy(f["test/y"][:])
    with torch.no_grad():
        accuracy = (run.model(X).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(run.history[-1]["test_accuracy"], abs=1e-6)


def test_a_comm_that_is_no_intracommunicator_is_named(tmp_path):
    """comm=5 failed in the run and again in the handler that ends the job
    (two chained AttributeErrors on every rank); COMM_NULL was a raw MPI error."""
    from collectives import MPI

    for comm, shown in ((5, "5"), (MPI.COMM_NULL, "MPI.COMM_NULL"), ("world", "'world'")):
        with pytest.raises(ConfigError, match=rf"engine.train\(comm={shown}\): takes an "
                                              "mpi4py intracommunicator"):
            engine.train(str(tmp_path / "x.h5"), comm=comm, noise_multiplier=1.0)


def test_unknown_option_is_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown option.*epoch_count"):
        engine.train(str(tmp_path / "x.h5"), epoch_count=3)
    with pytest.raises(ConfigError, match="exactly one of --noise-multiplier"):
        engine.train(str(tmp_path / "x.h5"))
    with pytest.raises(ConfigError, match="--accountant 'prv' is not an accountant"):
        engine.train(str(tmp_path / "x.h5"), noise_multiplier=1.0, accountant="prv")


@pytest.mark.parametrize("option, value, takes", [
    ("epochs", "two", "epochs takes an integer"),
    ("epochs", 2.5, "epochs takes an integer"),
    ("lr", "0.1", "lr takes a number"),
    ("dp", "no", "dp takes True or False"),
    ("noise_multiplier", True, "noise_multiplier takes a number or None"),
    ("hidden", [64, 1.5], "hidden takes a sequence of integers"),
    ("lr_milestones", 3, "lr_milestones takes a sequence of integers"),
    ("checkpoint_dir", 7, "checkpoint_dir takes a string or None")])
def test_an_option_of_the_wrong_type_is_named(tmp_path, option, value, takes):
    """Before any work, on every rank alike (not a TypeError from inside)."""
    with pytest.raises(ConfigError, match=f"^engine.train\\(\\): {option}=.*; {takes}$"):
        engine.train(str(tmp_path / "x.h5"), **{"noise_multiplier": 1.0, option: value})


def test_options_are_taken_as_the_command_line_takes_them():
    """numpy's scalars for numbers, any sequence for a tuple, ``hidden`` as the
    text ``--hidden`` takes; None where the option may be None."""
    import numpy as np

    from engine.config import api_options

    got = api_options({"epochs": np.int64(3), "lr": 1, "hidden": "32,16", "seed": None,
                       "lr_milestones": [2, np.int32(4)], "dp": np.bool_(True)})
    assert got == {"epochs": 3, "lr": 1.0, "hidden": (32, 16), "seed": None,
                   "lr_milestones": (2, 4), "dp": True}
    assert type(got["epochs"]) is int and type(got["lr"]) is float
    assert api_options({"hidden": ""})["hidden"] == ()  # logistic regression, as --hidden ''


@pytest.mark.parametrize("option, value, named", [
    ("sampling", "Poisson", "--sampling 'Poisson': choose poisson, shuffle"),
    ("optimizer", "lbfgs", "--optimizer 'lbfgs': choose sgd, adam"),
    ("lr_schedule", "cosine", "--lr-schedule 'cosine': choose"),
    ("noise_scheme", "bogus", "--noise-scheme 'bogus': choose partition, split")])
def test_a_choice_the_api_does_not_have_is_refused_before_any_work(option, value, named):
    """sampling='Poisson' ran shuffled batches, which the epsilon does not cover
    (quiet=True said nothing); the others ended in a traceback per rank from
    deep in the step's build."""
    from engine.config import TrainConfig

    with pytest.raises(ConfigError) as info:
        TrainConfig(data="d.h5", noise_multiplier=1.0, **{option: value}).validate()
    assert str(info.value).startswith(named) and info.value.collective


def test_no_submodule_shadows_the_api():
    """Importing a submodule binds its name on the package: a module named like
    an API function would replace the function once anything imported it."""
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(engine.__path__, "engine."):
        importlib.import_module(info.name)
    assert callable(engine.train) and not isinstance(engine.train, type(engine))


@pytest.mark.mpi(min_size=2)
def test_settings_or_a_file_that_differ_by_rank_are_refused_on_every_rank(data, comm,
                                                                        shared_tmp):
    """A program of the user's own passing each rank its own epochs hung (the
    rank with more epochs waited in an all-reduce for ever); passing each rank
    its own file trained on a mix with an epsilon for neither. Both are raised
    on every rank before any step; a copy of the file (a node's own disk) and
    per-rank threads are fine."""
    import shutil

    from engine.errors import DataError

    rank = comm.Get_rank()
    opts = dict(comm=comm, batch_size=100, noise_multiplier=1.0, seed=4, hidden=[4],
                quiet=True)
    with pytest.raises(ConfigError, match=r"rank 1 was given epochs=2 but rank 0 was given "
                       r"epochs=1: "
                       "every rank must call it with the same settings"):
        engine.train(data, epochs=1 + min(rank, 1), **opts)
    own = shared_tmp / f"own-{rank}.h5"  # same shape, other rows: the worst case
    synthetic.write(own, rows=2000, features=12, seed=3 + min(rank, 1))
    comm.Barrier()
    with pytest.raises(DataError, match=f"rank 1 was given the data file {shared_tmp}/own-1.h5, "
                       "whose rows differ from those of rank 0's"):
        engine.train(str(own), epochs=1, **opts)
    copy = shared_tmp / f"copy-{rank}.h5"
    shutil.copyfile(data, copy)
    run = engine.train(str(copy), epochs=1, threads=1 + rank % 2, **opts)
    assert run.exit_code == 0


@pytest.mark.mpi(min_size=1)
def test_train_obeys_the_life_cycle(data, comm, shared_tmp):
    """engine.train() follows the command's rules (docs/lifecycle.md): a resume
    needs only the data and the directory and ends as an uninterrupted run;
    a given option that differs is refused by name; no checkpoint, no resume;
    outputs are checked before any work."""
    from engine.errors import CheckpointError, OutputError

    opts = dict(epochs=2, batch_size=100, noise_multiplier=1.0, seed=4, hidden=[8],
                quiet=True, allreduce="ring")  # ring: bit-for-bit at any size
    whole = engine.train(data, comm=comm, **opts)
    d = str(shared_tmp / "ck")
    stopped = engine.train(data, comm=comm, checkpoint_dir=d, stop_after=23, **opts)
    assert stopped.exit_code == 75
    with pytest.raises(ConfigError, match="--seed 5"):
        engine.train(data, comm=comm, checkpoint_dir=d, resume=True, seed=5, quiet=True)
    with pytest.raises(CheckpointError, match="pass --resume"):  # a fresh run into it
        engine.train(data, comm=comm, checkpoint_dir=d, **opts)
    resumed = engine.train(data, comm=comm, checkpoint_dir=d, resume=True, quiet=True)
    assert resumed.exit_code == 0 and resumed.config.seed == 4
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        assert torch.equal(a, b)
    assert [r["epoch"] for r in resumed.history] == [1, 2]
    with pytest.raises(CheckpointError, match="nothing to resume"):
        engine.train(data, comm=comm, checkpoint_dir=str(shared_tmp / "typo"), resume=True)
    with pytest.raises(OutputError, match="never its parent"):
        engine.train(data, comm=comm, metrics=str(shared_tmp / "no" / "m.jsonl"), **opts)


PLAN_ON_ROOT = """
import sys
import engine
from collectives import MPI
run = engine.train(sys.argv[1], epochs=2, batch_size=100, target_epsilon=2.0, seed=1,
                   quiet=True)
rank = MPI.COMM_WORLD.Get_rank()
with open(f"{sys.argv[2]}/rank{rank}.txt", "w") as out:  # not stdout: ranks' lines interleave
    out.write(f"{rank} {'dp_accounting' in sys.modules} {run.epsilon!r} "
              f"{[repr(r['epsilon']) for r in run.history]}")
"""


def test_only_rank_0_runs_the_accountant_and_every_rank_gets_its_epsilons(tmp_path):
    """The plan and every epoch's epsilon are computed on rank 0 (dp-accounting
    is slow to import) and reach the other ranks bit for bit."""
    import sys

    from launcher import clean_env, run_mpi

    synthetic.write(tmp_path / "d.h5", rows=2000, features=12, seed=3)
    script = tmp_path / "plan.py"
    script.write_text(PLAN_ON_ROOT)
    # an empty file of privacy figures: rank 0 computes them, and keeps them
    env = clean_env(MPIDP_PRIVACY_CACHE_FILE=str(tmp_path / "figures.json"))
    result = run_mpi(3, [sys.executable, str(script), str(tmp_path / "d.h5"), str(tmp_path)],
                     timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "figures.json").exists()
    lines = [(tmp_path / f"rank{rank}.txt").read_text().split(" ", 2) for rank in range(3)]
    assert [line[:2] for line in lines] == [["0", "True"], ["1", "False"], ["2", "False"]]
    assert len({line[2] for line in lines}) == 1  # epsilon and history, the same bits
    assert float(lines[0][2].split(" ")[0]) <= 2.0


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("api") / "api.h5"
    synthetic.write(path, rows=2000, features=12, seed=3)
    return str(path)


def _user_program(scenario: str, data: str, n: int = 2, *more: str):
    import subprocess
    import sys

    from launcher import SCRIPTS, run_mpi

    try:
        return run_mpi(n, [sys.executable, str(SCRIPTS / "train_api_failure.py"), scenario,
                           data, *more], timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"engine.train, scenario {scenario}: no exit within 90 s (a hang)")


def test_a_model_failing_on_one_rank_ends_the_job(data_file):
    """Launched as the README says (no python -m mpi4py): rank 1's model
    raises mid-training; the job ends with its traceback and exit code 1
    instead of rank 0 waiting in the all-reduce for ever."""
    result = _user_program("model-raises", data_file)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "[rank 1] ValueError: the user's model fails on rank 1" in result.stderr
    assert "[rank 1] mpidp: ending the job so that no rank waits for this one" in result.stderr
    assert "DONE" not in result.stdout


@pytest.mark.parametrize("scenario, gone, calls", [
    ("rank-0-only", "12", "this call"), ("once-more", "12", "its call number 2 here"),
    ("fails-first", "1", "this call")])
def test_a_call_some_ranks_never_make_ends_the_job(data_file, scenario, gone, calls):
    """engine.train under `if rank == 0:`, once more on rank 0, or a peer
    whose program failed first (rank 1): the ranks that called it would wait
    in its first collective for ever; the ended peers' marks end the job
    (exit 2), each waiting rank that saw one before the end saying which."""
    import re

    result = _user_program(scenario, data_file, 3)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "mpidp: error:" in line]
    assert lines, result.stderr[-3000:]
    for line in lines:
        said = re.match(r"\[rank (\d)\] mpidp: error: engine.train\(\): the program of world "
                        rf"rank (\d) ended without making {calls}: every rank of the "
                        r"communicator must call engine.train\(\)", line)
        assert said and said.group(2) in gone and said.group(1) not in gone, line


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_abort_on_error_off_raises_on_the_failing_rank_and_frees_the_other(data_file,
                                                                           algorithm):
    """Rank 0 waits inside MPI_Allreduce (native) or a point-to-point schedule
    (ring) when rank 1's program ends: it is freed either way, and rank 1's
    exit check does not end the job before rank 0 has seen it go (it did,
    now and then, when ``auto`` had measured its way to native)."""
    result = _user_program("opt-out", data_file, 2, algorithm)
    out = result.stdout
    assert "CAUGHT rank 1 ValueError: the user's model fails on rank 1" in out, result.stderr
    assert "CAUGHT rank 0 AllreduceMismatch" in out, result.stderr[-3000:]
    assert "ending the job" not in result.stderr


def test_an_error_raised_on_every_rank_is_raised_everywhere(data_file):
    result = _user_program("collective", data_file)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("CAUGHT") == 2
    assert "unknown option(s) learning_rate" in result.stdout
