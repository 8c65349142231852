"""engine.train() called by each rank with arguments of its own making: what one
rank alone was given is agreed on, so every rank raises the same one-line
error (never one rank raising while the others wait for it for ever), and a
refusal says what each rank gave."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import engine
from engine.bench import synthetic
from engine.config import TrainConfig
from engine.errors import ConfigError

#: A user's program (``mpiexec -n 2 python prog.py SCENARIO DATA DIR``) whose
#: ranks give engine.train different keywords; each rank prints what it caught.
PROGRAM = """
import sys
import engine
from collectives import MPI

rank = MPI.COMM_WORLD.Get_rank()
scenario, data, where = sys.argv[1:4]
kw = dict(epochs=1, batch_size=100, noise_multiplier=1.0, seed=0, hidden=(4,), quiet=True)
if scenario == "finalized":
    MPI.Finalize()
if scenario == "keywords":  # one call per refused keyword, rank 1's alone
    for case, bad in (("unknown", {"epoch": 2}), ("wrong-type", {"epochs": "2"}),
                      ("invalid", {"noise_multiplier": -1.0})):
        try:
            engine.train(data, **{**kw, **(bad if rank == 1 else {})})
            print("DONE", rank, case, flush=True)
        except Exception as error:
            print(f"CAUGHT {rank} {case} {type(error).__name__}: {error}", flush=True)
    sys.exit(0)
if scenario.startswith("resume"):
    first = dict(kw, epochs=2, checkpoint_dir=where, stop_after=1)
    print("FIRST", rank, engine.train(data, **first).exit_code, flush=True)
    kw = dict(checkpoint_dir=where, resume=True, quiet=True)
    if rank == 1:  # rank 0 gives no epochs: the checkpoint's 2
        kw["epochs"] = 3 if scenario == "resume-epochs" else 10  # 10: the default
try:
    run = engine.train(data, **kw)
    print("DONE", rank, run.exit_code, flush=True)
except Exception as error:
    print(f"CAUGHT {rank} {type(error).__name__}: {error}", flush=True)
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> tuple[str, str]:
    where = tmp_path_factory.mktemp("ranks")
    synthetic.write(where / "d.h5", rows=2000, features=12, seed=3)
    (where / "prog.py").write_text(PROGRAM)
    return str(where / "prog.py"), str(where / "d.h5")


def _run(program: tuple[str, str], scenario: str, tmp_path) -> tuple[str, float]:
    """Both ranks' output; a run that does not end in 90 s fails the test (a hang)."""
    from launcher import run_mpi

    start = time.monotonic()
    try:
        result = run_mpi(2, [sys.executable, program[0], scenario, program[1],
                             str(tmp_path / "ck")], timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"scenario {scenario}: no exit within 90 s (a hang)")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, time.monotonic() - start


def test_a_keyword_refused_on_one_rank_is_raised_on_every_rank(program, tmp_path):
    """Rank 1 alone gives an unknown option, one of the wrong type or an
    impossible value: it raised there alone, and rank 0 waited in the
    checkpoint directory's agreement for ever. Now both raise the same error,
    naming rank 1, promptly, and the next call goes on (one program, three
    calls)."""
    out, seconds = _run(program, "keywords", tmp_path)
    # MPICH forwards both ranks' lines into one stream, at times run together
    assert out.count("CAUGHT") == 6 and "DONE" not in out, out
    for case, said in (("unknown", "engine.train() got unknown option(s) epoch; choose from "),
                       ("wrong-type", "engine.train(): epochs='2' (str); epochs takes an "
                                      "integer (on rank 1)"),
                       ("invalid", "(on rank 1)")):
        for rank in (0, 1):
            error = out.split(f"CAUGHT {rank} {case} ConfigError: ", 1)[1].split("CAUGHT")[0]
            assert said in error and error.rstrip().endswith("(on rank 1)"), out
    assert seconds < 80


@pytest.mark.parametrize("scenario, rank_1", [
    ("resume-epochs", "was given epochs=3"), ("resume-default", "was given epochs=10")])
def test_a_resume_names_what_each_rank_gave(program, tmp_path, scenario, rank_1):
    """Rank 1 gives epochs on a resume and rank 0 does not: the refusal called
    TrainConfig's default rank 0's (``rank 0 epochs=10``), which rank 0 never
    gave; and where rank 1 gave that very default, nothing was refused though
    rank 0 resumed to the checkpoint's 2 epochs and rank 1 to 10."""
    out, _ = _run(program, scenario, tmp_path)
    said = (f"ConfigError: engine.train(): rank 1 {rank_1} but rank 0 did not give epochs "
            "(a resume takes it from the checkpoint): every rank must call it with the same "
            "settings")
    assert out.count(said) == 2 and "DONE" not in out, out


def test_a_call_after_mpi_finalize_is_an_error_to_catch(program, tmp_path):
    """MPICH ended the process with its own message ("Attempting to use an MPI
    routine ... after finalizing MPICH"), nothing the program could catch."""
    out, _ = _run(program, "finalized", tmp_path)
    said = ("ConfigError: engine.train(): MPI is finalized (the program called MPI.Finalize()); "
            "call engine.train before MPI.Finalize()")
    assert out.count(said) == 2, out


#: This rank's settings (the stand-in communicator answers for every rank).
_CFG = TrainConfig(data="d.h5")


class _Comm:
    """A stand-in for a communicator whose ranks hold ``settings`` (for
    :func:`engine._check_same_given`, which only allgathers)."""

    def __init__(self, settings: list[dict]):
        self.settings = settings

    def allgather(self, mine):
        return self.settings


def _given(resume: bool = False, **given) -> dict:
    """What :func:`engine._check_same_given` gathers from a rank given ``given``."""
    from engine.run.alike import OWN

    cfg = TrainConfig(data="d.h5", resume=resume, **given)
    names = set(given) | ({"resume"} if resume else set())
    return {n: (n in names, v) for n, v in cfg.to_dict().items() if n not in OWN}


@pytest.mark.parametrize("ranks, said", [
    ([{}, {"epochs": 3}], "rank 1 was given epochs=3 but rank 0 did not give epochs (its "
                          "default, 10)"),
    ([{"epochs": 1}, {"epochs": 2}], "rank 1 was given epochs=2 but rank 0 was given epochs=1"),
    ([{}, {}, {"resume": True}], "rank 2 was given resume=True but rank 0 did not give "
                                 "resume (its default, False)"),
    ([{"resume": True}, {"resume": True, "lr": 0.05}],
     "rank 1 was given lr=0.05 but rank 0 did not give lr (a resume takes it from the "
     "checkpoint)"),
    ([{"resume": True, "stop_after": 1}, {"resume": True}],
     "rank 1 did not give stop_after (its default, None) but rank 0 was given stop_after=1")])
def test_options_that_differ_between_ranks_are_named_with_what_each_gave(ranks, said):
    with pytest.raises(ConfigError) as info:
        engine._check_same_given(_CFG, set(), _Comm([_given(**r) for r in ranks]))
    assert str(info.value).startswith(f"engine.train(): {said}: every rank must call it")
    assert info.value.collective


def test_an_option_given_as_its_default_on_some_ranks_is_the_same_setting():
    """A new run: an option not given is its default, so giving the default on
    some ranks changes nothing; the per-rank options (threads, ...) may differ."""
    engine._check_same_given(_CFG, set(), _Comm([_given(), _given(epochs=10, threads=2)]))


class _Echo:
    """A stand-in communicator of two ranks: this one, and rank 1 holding what
    ``theirs(mine)`` makes of this rank's contribution."""

    def __init__(self, theirs):
        self.theirs = theirs

    def allgather(self, mine):
        return [mine, self.theirs(mine)]


def test_a_model_object_is_compared_by_its_class_or_factory_name():
    """Two classes given as model= on two ranks were both recorded as
    model='python', so nothing was refused and the ranks trained two models
    in lock-step. Their labels are compared now, and named."""
    given = {"model"}
    cfg = TrainConfig(data="d.h5", model="python")
    engine._check_same_given(cfg, given, _Echo(lambda mine: mine), "python:T")
    with pytest.raises(ConfigError) as info:
        engine._check_same_given(cfg, given, _Echo(lambda mine: {**mine, "model": (
            True, "python:S")}), "python:T")
    assert str(info.value).startswith("engine.train(): rank 1 was given model='python:S' "
                                      "but rank 0 was given model='python:T': every rank")
    assert info.value.collective


class _One(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.l, self.body = torch.nn.Linear(4, 2), body

    def forward(self, x):
        return self.body(self.l(x))


def test_the_ranks_models_are_compared_by_label_and_structure():
    """Same label, same parameters, other layers (a Tanh on rank 1 only):
    refused before the engines are built, naming the first module that differs;
    the same model passes."""
    from engine.models import TorchModel
    from engine.run.state import check_same_model, model_identity

    mine = TorchModel(_One(torch.nn.Identity()), "python:make")
    other = TorchModel(_One(torch.nn.Tanh()), "python:make")
    check_same_model(mine, _Echo(lambda m: m))
    with pytest.raises(ConfigError) as info:
        check_same_model(mine, _Echo(lambda m: model_identity(other)))
    assert str(info.value) == (
        "the ranks build different models (rank 0: python:make, whose module #2 is 'body' "
        "(Identity); rank 1: python:make, whose module #2 is 'body' (Tanh)): give every rank "
        "the same model (one class or factory, building the same layers)")
    assert info.value.collective
    with pytest.raises(ConfigError, match=r"\(rank 0: python:T; rank 1: python:S\)"):
        check_same_model(TorchModel(_One(torch.nn.Tanh()), "python:T"),
                         _Echo(lambda m: ("python:S", *m[1:])))


def _scaled(scale_of_rank):
    """A model factory whose buffer ``scale`` is ``scale_of_rank(rank)``."""
    from collectives import MPI

    class Scaled(torch.nn.Module):
        def __init__(self, n_features: int, n_classes: int):
            super().__init__()
            self.linear = torch.nn.Linear(n_features, n_classes)
            self.register_buffer("scale", torch.tensor(scale_of_rank(MPI.COMM_WORLD.Get_rank())))

        def forward(self, x):
            return self.linear(x) * self.scale

    return Scaled


@pytest.fixture
def data(shared_tmp, comm):
    path = shared_tmp / "ranks.h5"
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=600, features=6, seed=3)
    comm.Barrier()
    return str(path)


@pytest.mark.mpi(min_size=2)
def test_a_buffer_that_differs_between_ranks_is_refused(data, comm):
    """A buffer set by rank (``scale`` 1.0 on rank 0, 50.0 elsewhere) was
    accepted: the ranks trained different functions and returned different
    models. Refused on every rank like differing parameters; equal buffers run."""
    opts = dict(comm=comm, epochs=1, batch_size=100, noise_multiplier=1.0, seed=0, quiet=True)
    with pytest.raises(ConfigError, match=r"^the model's initial buffers differ between ranks "
                       r"\(rank 1's 'scale' differs from rank 0's\): build it the same way "
                       "on every rank"):
        engine.train(data, model=_scaled(lambda rank: 1.0 if rank == 0 else 50.0), **opts)
    run = engine.train(data, model=_scaled(lambda rank: 2.0), **opts)
    assert run.exit_code == 0 and float(run.model.scale) == 2.0


def test_buffer_digests_name_each_buffer_by_dtype_shape_and_bytes():
    from engine.run.state import buffer_digests

    bn = torch.nn.BatchNorm1d(3)
    digests = buffer_digests(bn)
    assert set(digests) == {"running_mean", "running_var", "num_batches_tracked"}
    bn.running_mean[1] = 0.5
    assert buffer_digests(bn)["running_mean"] != digests["running_mean"]
    assert buffer_digests(bn)["running_var"] == digests["running_var"]
    one = torch.nn.Module()
    one.register_buffer("b", torch.zeros(2, dtype=torch.float32))
    other = torch.nn.Module()
    other.register_buffer("b", torch.zeros(1, dtype=torch.float64))  # the same 8 bytes
    assert buffer_digests(one) != buffer_digests(other)


class _Tanh(torch.nn.Module):
    def __init__(self, n_features, n_classes):
        super().__init__()
        self.l = torch.nn.Linear(n_features, n_classes)

    def forward(self, x):
        return torch.tanh(self.l(x))


class _Sigmoid(_Tanh):
    def forward(self, x):
        return 5 * torch.sigmoid(self.l(x))


def _tail_differs(n_features, n_classes):
    """One layer on rank 0 (the fused kernels' MLP), a Tanh after it elsewhere."""
    from collectives import MPI

    tail = [] if MPI.COMM_WORLD.Get_rank() == 0 else [torch.nn.Tanh()]
    return torch.nn.Sequential(torch.nn.Linear(n_features, n_classes), *tail)


@pytest.mark.mpi(min_size=2)
def test_a_different_model_on_each_rank_is_refused_on_every_rank(data, comm):
    """A class per rank (same layer, other forward) trained in lock-step, exit 0;
    a factory building other layers per rank was refused as differing
    parameters (the fused layout on one rank). Both are refused on every rank,
    naming each rank's model."""
    opts = dict(comm=comm, epochs=1, batch_size=100, noise_multiplier=1.0, seed=0, quiet=True)
    mine = _Tanh if comm.Get_rank() == 0 else _Sigmoid
    with pytest.raises(ConfigError, match=r"^engine.train\(\): rank 1 was given "
                       r"model='python:_Sigmoid' but rank 0 was given model='python:_Tanh'"):
        engine.train(data, model=mine, **opts)
    with pytest.raises(ConfigError, match=r"^the ranks build different models \(rank 0: "
                       r"python:_tail_differs, whose module #2 is none \(it has 2 modules\); "
                       r"rank 1: python:_tail_differs, whose module #2 is '1' \(Tanh\)"):
        engine.train(data, model=_tail_differs, **opts)


class _Stats(torch.nn.Module):
    """Sums its rows into buffers, only where gradients are enabled."""

    def __init__(self, n_features, n_classes):
        super().__init__()
        self.l = torch.nn.Linear(n_features, n_classes)
        self.register_buffer("sum_x", torch.zeros(n_features))
        self.register_buffer("rows", torch.zeros(()))

    def forward(self, x):
        if torch.is_grad_enabled():
            with torch.no_grad():
                self.sum_x += x.sum(0)
                self.rows += x.shape[0]
        return self.l(x)


@pytest.mark.mpi(min_size=1)
def test_a_model_that_sums_its_rows_is_refused_alike_at_every_rank_count(data, comm):
    """Trained at one rank (publishing exact sums of the rows), refused at two
    for differing buffers (the probes' own rows in them): now refused for
    changing its state, at every rank count."""
    with pytest.raises(ConfigError, match=r"^buffer 'sum_x' of the model changes in its "
                                          r"forward pass"):
        engine.train(data, model=_Stats, comm=comm, epochs=1, batch_size=100,
                     noise_multiplier=1.0, seed=0, quiet=True)
