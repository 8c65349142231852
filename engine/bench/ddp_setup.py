"""The peers' options and set-up (:mod:`engine.bench.ddp_baseline`): the parser, a
subset of ``mpidp train``'s options with the same meaning, the process group
joined over MPI, and the model ``mpidp train`` would build.
"""
from __future__ import annotations

import argparse
import socket
from datetime import timedelta

from collectives import MPI
from engine.choices import seed_value, thread_count
from engine.config import int_list
from engine.errors import ConfigError
from engine.nn.schedule import SCHEDULES

#: The command's description (``--help``).
DESCRIPTION = ("The peers' run of an ``mpidp train`` configuration: PyTorch DDP, or Opacus' "
               "distributed DP-SGD.")
#: mpidp train options that choose mpidp's own machinery (all-reduce algorithm,
#: kernels, accountant, progress bar): accepted, recorded and ignored here.
IGNORED_OPTIONS = {"--allreduce": 1, "--kernels": 1, "--noise-scheme": 1, "--accountant": 1,
                   "--eval-every": 1, "--progress": 0, "--no-progress": 0,
                   "--select-on": 1}


class BaselineError(ConfigError):
    """A setting the baseline cannot reproduce, or a missing package (exit 2)."""

    def __init__(self, message: str):
        super().__init__(message, collective=True)


class _RankZeroParser(argparse.ArgumentParser):
    """Usage and parse errors printed by rank 0 only (every rank parses the same line)."""

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    """The options (a subset of ``mpidp train``'s, with the same meaning)."""
    p = _RankZeroParser(
        prog="python -m engine.bench.ddp_baseline",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="mlp",
                   help="mlp, logreg, mnist-small, mnist-large or resnet20 (default: mlp)")
    p.add_argument("--hidden", default="128,128")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lr-schedule", choices=SCHEDULES, default="constant")
    p.add_argument("--lr-warmup-epochs", type=float, default=0.0)
    p.add_argument("--lr-milestones", type=int_list, default=())
    p.add_argument("--lr-decay", type=float, default=0.1)
    p.add_argument("--sampling", choices=("poisson", "shuffle"), default="poisson")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--noise-multiplier", type=float, default=None)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--no-dp", dest="dp", action="store_false")
    p.add_argument("--seed", type=seed_value, default=None)
    p.add_argument("--threads", type=thread_count, default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--metrics", default=None)
    p.add_argument("--target-accuracy", type=float, default=None)
    p.add_argument("--time-budget", type=float, default=None)
    p.add_argument("--master-addr", default=None,
                   help="address of rank 0's TCP store (default: 127.0.0.1 when every "
                   "rank is on one node, else rank 0's host name)")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options, and the ``mpidp train`` options given that do not apply here.

    Raises:
        BaselineError: an option of ``mpidp train`` the baseline cannot follow.
    """
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    ignored, i = [], 0
    while i < len(rest):
        word = rest[i]
        name = word.split("=", 1)[0]
        if name not in IGNORED_OPTIONS:
            raise BaselineError(f"{word}: the DDP baseline cannot reproduce this mpidp train "
                                "option; drop it (or run with --baseline none)")
        takes = IGNORED_OPTIONS[name] if "=" not in word else 0
        ignored += rest[i:i + 1 + takes]
        i += 1 + takes
    return args, ignored


def check(args: argparse.Namespace) -> None:
    """Raise BaselineError for settings that cannot work (one line)."""
    if args.epochs < 1 or args.batch_size < 1:
        raise BaselineError("--epochs and --batch-size must be at least 1")
    if args.dp and args.noise_multiplier is None:
        raise BaselineError("a DP baseline needs --noise-multiplier (or --no-dp)")
    if not args.dp and args.noise_multiplier is not None:
        raise BaselineError("--no-dp trains without privacy: drop --noise-multiplier")
    if args.nesterov and not args.momentum > 0:
        raise BaselineError("--nesterov needs --momentum > 0")


def learning_rate(args: argparse.Namespace, update: int, steps_per_epoch: int,
                  ranks: int) -> float:
    """The learning rate of update ``update`` (1-based), from the function ``mpidp
    train`` uses (:func:`engine.nn.schedule.learning_rate`; ``step``: a linear
    warm-up over ``--lr-warmup-epochs`` from ``lr / ranks`` to ``lr``, then ``lr``
    times ``--lr-decay`` per ``--lr-milestones`` epoch passed)."""
    from engine.nn.schedule import learning_rate as schedule

    return schedule(args.lr_schedule, args.lr, update, steps_per_epoch,
                    args.lr_warmup_epochs, args.lr / max(1, ranks),
                    args.lr_milestones, args.lr_decay)


# ------------------------------------------------------------------ set-up
def init_process_group(comm, device: str, master_addr: str | None) -> str:
    """Join ``torch.distributed`` (gloo; NCCL on GPUs) through a TCP store on a
    port rank 0 lets the OS pick and broadcasts over MPI; returns the backend."""
    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    names = comm.allgather(MPI.Get_processor_name())
    if master_addr is None:
        master_addr = "127.0.0.1" if len(set(names)) == 1 else None
    if master_addr is None:
        master_addr = comm.bcast(socket.gethostname() if rank == 0 else None, root=0)
    timeout = timedelta(seconds=120)
    store, error = None, None
    if rank == 0:
        try:
            store = dist.TCPStore(master_addr, 0, size, True, timeout=timeout,
                                  wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 (reported on every rank below)
            error = f"rank 0 cannot open a TCP store on {master_addr}: {exc}"
    port = comm.bcast((store.port if store is not None else None, error), root=0)
    if port[1]:
        raise BaselineError(port[1])
    if rank != 0:
        store = dist.TCPStore(master_addr, port[0], size, False, timeout=timeout)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timeout)
    return backend


def build_model(args: argparse.Namespace, info, seed: int):
    """The model ``mpidp train --model`` trains, with its initial parameters."""
    from engine.nn import image_models
    from engine.choices import parse_hidden
    from engine.nn.mlp import MLPSpec, init_params, to_module
    from engine.models import seeded

    if args.model in image_models.IMAGE_MODELS:
        image_models.check_fits(args.model, info.image_shape, info.n_features, info.path)
        return seeded(seed, lambda: image_models.build(args.model, info.image_shape,
                                                        info.n_classes))
    if args.model in ("mlp", "logreg"):
        if info.is_image or info.code_columns:
            raise BaselineError(f"--model {args.model} on {info.path}: the baseline trains "
                                "the MLP on one-hot tabular files only")
        hidden = () if args.model == "logreg" else parse_hidden(args.hidden)
        spec = MLPSpec.build(info.n_features, hidden, info.n_classes)
        return to_module(spec, init_params(spec, seed))
    raise BaselineError(f"--model {args.model}: the DDP baseline builds mlp, logreg, "
                        "mnist-small, mnist-large and resnet20")
