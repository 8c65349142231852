"""The peers' run of an ``mpidp train`` configuration: PyTorch DDP, or Opacus' distributed DP-SGD.

``mpidp bench scaling --baseline ddp`` launches this module beside every
``mpidp train`` run, under the same launcher and with the same options::

    mpiexec -n 2 python -m engine.bench.ddp_baseline --data F --model mnist-small \\
        --epochs 2 --batch-size 256 --lr 0.05 --momentum 0.9 --no-dp --seed 1 \\
        --metrics ddp.jsonl

What is the same as ``mpidp train``:

* the data: each rank reads the shard ``mpidp train`` reads
  (:func:`engine.shard.read_info` / :func:`engine.shard.read_shard`: rows
  ``[r*N//p, (r+1)*N//p)``, an image file's pixels normalised per channel);
* the model: ``--model mnist-small|mnist-large|resnet20``
  (:func:`engine.nn.image_models.build`, built after seeding torch with
  ``--seed``, as ``mpidp train`` builds it), or for ``--model mlp|logreg``
  the ``nn.Sequential`` of the same widths with the same initial parameters
  (:func:`engine.nn.mlp.init_params`);
* the optimisation: expected global batch B (Poisson sampling at rate
  q = B/N on every rank, or fixed batches with ``--sampling shuffle``),
  steps per epoch ``round(N/B)``, the gradient summed over the batch and
  divided by B, SGD with ``--momentum`` (``--nesterov``) and
  ``--weight-decay`` (torch's), or Adam; the learning-rate schedule
  (``constant``, ``inv-sqrt``, ``step`` with ``--lr-warmup-epochs``,
  ``--lr-milestones``, ``--lr-decay``);
* threads: ``--threads``, else mpidp's policy (``engine.run.threads``);
* the records: one JSON line per epoch in the schema of ``mpidp train
  --metrics`` (``epoch_time_s``, ``train_time_s``, ``examples_per_s``,
  ``comm_s``, ``test_accuracy``, ``epsilon``...), so
  :mod:`engine.bench.scaling_report` tabulates them as it does mpidp's.

How it runs: rank and size come from mpi4py; rank 0 opens a
``torch.distributed.TCPStore`` on a port the OS picks and broadcasts the
port over MPI, and every rank joins the process group with gloo (NCCL with
``--device cuda``). Non-private runs (``--no-dp``) train the model wrapped in
``torch.nn.parallel.DistributedDataParallel`` (gradients all-reduced in
buckets during the backward pass, overlapped with it: ``comm_s`` is not
measured, null). DP runs use Opacus' distributed mode: the model in
``opacus.distributed.DifferentiallyPrivateDistributedDataParallel``, then
``PrivacyEngine.make_private(module, optimizer, data_loader,
noise_multiplier, max_grad_norm)`` (per-example gradients from hooks, flat
clipping, ``DistributedDPOptimizer``: noise drawn on rank 0, each parameter's
gradient all-reduced after clipping; ``comm_s`` is the time in that
all-reduce). Sampling is Opacus' Poisson sampler
(``UniformWithReplacementSampler``, rate q over the rank's shard, as
``mpidp train`` samples); its batches of row indices gather the rows from the
shard directly (the data loader's per-example collation would time Python,
not Opacus). Because every rank reads a shard rather than the whole set, the
loader given to ``make_private`` is not replaced by Opacus' distributed one
(which would split each shard again); the optimizer's expected batch is set
to B / ranks, so its sum over ranks divided by the ranks is the sum over the
global batch divided by B, as in mpidp. Epsilon in the records is mpidp's
accountant's (PLD) for the same q, sigma and steps.

If Opacus cannot be imported, a DP run exits with code 2 and one line saying
so (``mpidp bench scaling`` then reports those rows as skipped). The options
and the set-up (process group, model) are :mod:`engine.bench.ddp_setup`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from collectives import MPI
from engine.bench.ddp_setup import (BaselineError, build_model, check, init_process_group,
                                    learning_rate, parse_args)
from engine.spmd import run_spmd

#: Test rows evaluated at a time.
EVAL_BATCH = 1024


# ------------------------------------------------------------------ training
class Run:
    """One baseline run on this rank (collective methods: every rank calls them)."""

    def __init__(self, args: argparse.Namespace, ignored: list[str], comm) -> None:
        import torch

        from engine.shard import read_info, read_shard
        from engine.run.collective import shared_seed
        from engine.run.threads import configure_threads

        self.args, self.ignored, self.comm = args, ignored, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.threads = configure_threads(args.threads).threads
        if args.device == "cuda":
            local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
            if not torch.cuda.is_available():
                raise BaselineError("--device cuda: torch sees no CUDA device")
            self.device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.info = read_info(args.data, comm)
        n = self.info.rows["train"]
        if args.batch_size > n:
            raise BaselineError(f"--batch-size {args.batch_size} exceeds the {n} training "
                                f"rows of {args.data}")
        self.n_train = n
        self.q = args.batch_size / n
        self.steps_per_epoch = max(1, round(n / args.batch_size))
        self.seed = shared_seed(comm, args.seed)
        self.module = build_model(args, self.info, self.seed).to(self.device)
        train = read_shard(self.info, "train", comm, min_rows_per_rank=1)
        self.X = torch.from_numpy(np.ascontiguousarray(train.X[:, :-1])).to(self.device)
        self.y = torch.from_numpy(train.y).to(self.device)
        del train
        self.eval_split = "val" if self.info.has_val else "test"
        evaluated = read_shard(self.info, self.eval_split, comm, min_rows_per_rank=0)
        self.eval_X = torch.from_numpy(np.ascontiguousarray(evaluated.X[:, :-1]))
        self.eval_y = torch.from_numpy(evaluated.y)
        self.test_X = self.test_y = None
        if self.info.has_val:
            test = read_shard(self.info, "test", comm, min_rows_per_rank=0)
            self.test_X = torch.from_numpy(np.ascontiguousarray(test.X[:, :-1]))
            self.test_y = torch.from_numpy(test.y)
        self.backend = init_process_group(comm, args.device, args.master_addr)
        self.generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + 7919 * self.rank) % 2 ** 63)
        self.comm_s = 0.0
        self._setup_training()

    def _sgd(self, params):
        import torch

        a = self.args
        if a.optimizer == "adam":
            return torch.optim.Adam(params, lr=a.lr, weight_decay=a.weight_decay)
        return torch.optim.SGD(params, lr=a.lr, momentum=a.momentum, nesterov=a.nesterov,
                               weight_decay=a.weight_decay)

    def _sampler(self):
        """Batches of local row indices for one epoch."""
        import torch

        n_local = int(self.y.shape[0])
        if self.args.sampling == "poisson":
            from opacus.utils.uniform_sampler import UniformWithReplacementSampler

            return UniformWithReplacementSampler(num_samples=n_local, sample_rate=self.q,
                                                 generator=self.generator,
                                                 steps=self.steps_per_epoch)
        b = self.args.batch_size
        local = b * (self.rank + 1) // self.size - b * self.rank // self.size
        steps, generator = self.steps_per_epoch, self.generator

        class Shuffled:  # fixed-size batches from reshuffled passes (mpidp's --sampling shuffle)
            def __len__(self):
                return steps

            def __iter__(self):
                order, at = torch.randperm(n_local, generator=generator), 0
                for _ in range(steps):
                    if at + local > n_local:
                        order, at = torch.randperm(n_local, generator=generator), 0
                    yield order[at:at + local].tolist()
                    at += local

        return Shuffled()

    def _setup_training(self) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        a = self.args
        self.loss_scale = self.size / a.batch_size  # sum over the rank's rows * P/B
        if not a.dp:
            self.impl = "torch-ddp"
            self.model = DDP(self.module,
                             device_ids=[self.device.index] if a.device == "cuda" else None)
            self.optimizer = self._sgd(self.model.parameters())
            self.batches = self._sampler()
            return
        try:
            import opacus
            from opacus import PrivacyEngine
            from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
        except ImportError as exc:
            raise BaselineError(f"Opacus is not installed ({exc}): no Opacus-DDP baseline "
                                "for DP runs (pip install opacus)") from None
        import warnings

        warnings.filterwarnings("ignore", module="opacus")
        # Opacus' hooks on a first layer whose input needs no gradient: expected, harmless
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.impl = "opacus-ddp"
        self.opacus_version = opacus.__version__
        wrapped = DPDDP(self.module)
        optimizer = self._sgd(wrapped.parameters())
        self.batches = self._sampler()
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(self.X[:1].cpu(), self.y[:1].cpu()),
            batch_sampler=self.batches)
        self.model, self.optimizer, _ = PrivacyEngine().make_private(
            module=wrapped, optimizer=optimizer, data_loader=loader,
            noise_multiplier=a.noise_multiplier, max_grad_norm=a.max_grad_norm,
            poisson_sampling=False)
        # Expected batch per rank: the rank's sum over the ranks divided by the
        # ranks is then the global sum divided by B (module docstring).
        self.optimizer.expected_batch_size = a.batch_size / self.size
        reduce = self.optimizer.reduce_gradients

        def timed_reduce():
            started = time.perf_counter()
            reduce()
            self.comm_s += time.perf_counter() - started

        self.optimizer.reduce_gradients = timed_reduce

    def _loss(self, logits, yb):
        import torch

        total = torch.nn.functional.cross_entropy(logits, yb, reduction="sum")
        if self.args.dp:  # Opacus' "mean": the optimizer divides by the expected batch
            return total / max(1, int(yb.shape[0])), total
        return total * self.loss_scale, total

    def train_epoch(self, epoch: int, update: int) -> tuple[dict, int]:
        """One epoch; returns the rank-local sums and the last update's index."""
        self.model.train()
        self.comm_s = 0.0
        loss_sum, examples, lr = 0.0, 0, None
        started = time.perf_counter()
        for indices in self.batches:
            update += 1
            lr = learning_rate(self.args, update, self.steps_per_epoch, self.size)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            idx = torch_index(indices, self.device)
            xb, yb = self.X[idx], self.y[idx]
            self.optimizer.zero_grad(set_to_none=True)
            loss, total = self._loss(self.model(xb), yb)
            loss.backward()
            self.optimizer.step()
            loss_sum += float(total.detach())
            examples += int(yb.shape[0])
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - started
        return {"loss_sum": loss_sum, "examples": examples, "wall": wall,
                "comm_s": self.comm_s, "lr": lr}, update

    def evaluate(self, X, y) -> tuple[float | None, float | None, int]:
        """Collective: accuracy and mean loss over every rank's rows."""
        import torch

        self.module.eval()
        correct, loss = 0, 0.0
        with torch.no_grad():
            for start in range(0, int(y.shape[0]), EVAL_BATCH):
                xb = X[start:start + EVAL_BATCH].to(self.device)
                yb = y[start:start + EVAL_BATCH].to(self.device)
                logits = self.module(xb)
                loss += float(torch.nn.functional.cross_entropy(logits, yb, reduction="sum"))
                correct += int((logits.argmax(1) == yb).sum())
        sums = self.comm.allreduce(np.array([correct, loss, int(y.shape[0])], np.float64),
                                   op=MPI.SUM)
        rows = int(sums[2])
        if rows == 0:
            return None, None, 0
        return float(sums[0] / rows), float(sums[1] / rows), rows

    def run(self) -> int:
        from engine import metrics as metrics_mod
        from engine.stopping import stop_reason

        a = self.args
        history, update, total_time = [], 0, 0.0
        if self.rank == 0:
            print(self._banner(), flush=True)
            print(metrics_mod.header(val=self.info.has_val), flush=True)
        for epoch in range(a.epochs):
            local, update = self.train_epoch(epoch, update)
            sums = self.comm.allreduce(np.array([local["loss_sum"], local["examples"],
                                                 local["wall"], local["comm_s"]], np.float64),
                                       op=MPI.SUM)
            examples = int(sums[1])
            wall = float(sums[2]) / self.size
            comm_s = float(sums[3]) / self.size if a.dp else None
            total_time += wall
            record = {
                "epoch": epoch + 1, "step": update,
                "train_loss": float(sums[0]) / examples if examples else None,
                "train_examples": examples, "epoch_time_s": wall, "train_time_s": total_time,
                "examples_per_s": examples / wall if wall > 0 else None,
                "comm_s": comm_s, "compute_s": wall - comm_s if comm_s is not None else None,
                "comm_compute_ratio": (comm_s / (wall - comm_s)
                                       if comm_s is not None and wall > comm_s else None),
                "ranks": self.size, "threads": self.threads, "resumed_mid_epoch": False,
                "impl": self.impl, "backend": self.backend, "lr": local["lr"],
                "epsilon": None, "delta": None, "noise_multiplier": None,
                "sampling": a.sampling, "ignored_options": self.ignored,
            }
            if a.dp:
                from engine.dp.accountant import epsilon_for

                record.update(epsilon=epsilon_for(self.q, a.noise_multiplier, update, a.delta),
                              delta=a.delta, noise_multiplier=a.noise_multiplier,
                              opacus=self.opacus_version)
                if a.sampling != "poisson":
                    record["epsilon_valid"] = False
            accuracy, loss, _ = self.evaluate(self.eval_X, self.eval_y)
            key = "val" if self.info.has_val else "test"
            record.update({f"{key}_accuracy": accuracy, f"{key}_loss": loss})
            reason = stop_reason(record, a.target_accuracy, a.time_budget)
            last = reason is not None or epoch + 1 == a.epochs
            if reason:
                record["stop_reason"] = reason
            if last and self.test_X is not None:
                accuracy, loss, _ = self.evaluate(self.test_X, self.test_y)
                record.update(test_accuracy=accuracy, test_loss=loss)
            record = {k: (metrics_mod.finite_or_none(v) if isinstance(v, float) else v)
                      for k, v in record.items()}
            history.append(record)
            if self.rank == 0:
                print(metrics_mod.row(record, val=self.info.has_val), flush=True)
                if a.metrics:
                    metrics_mod.write_records(a.metrics, history)
            if last:
                break
        import torch.distributed as dist

        dist.destroy_process_group()
        return 0

    def _banner(self) -> str:
        a = self.args
        n_params = sum(p.numel() for p in self.module.parameters())
        what = (f"Opacus {self.opacus_version} DP-SGD (sigma {a.noise_multiplier:g}, C "
                f"{a.max_grad_norm:g})" if a.dp else "non-private")
        ignored = f"; ignored: {' '.join(self.ignored)}" if self.ignored else ""
        return (f"ddp_baseline: {self.impl} over {self.backend}, {self.size} rank(s) x "
                f"{self.threads} thread(s); {a.model} ({n_params:,} parameters); {what}; "
                f"expected batch {a.batch_size} ({a.sampling}), {self.steps_per_epoch} "
                f"steps/epoch, {self.n_train:,} training rows{ignored}")


def torch_index(indices, device):
    """A list of row indices (or a tensor) as an int64 tensor on ``device``."""
    import torch

    if isinstance(indices, torch.Tensor):
        return indices.to(device=device, dtype=torch.int64)
    return torch.as_tensor(indices, dtype=torch.int64, device=device)


def main(argv: list[str] | None = None) -> int:
    """Every rank: parse, train, write the records (rank 0)."""
    words = list(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD

    def command() -> int:
        try:
            args, ignored = parse_args(words)
        except SystemExit as exc:  # argparse printed its message
            return int(exc.code or 0)
        check(args)
        if args.metrics:
            directory = os.path.dirname(os.path.abspath(args.metrics))
            if not os.path.isdir(directory):
                raise BaselineError(f"--metrics {args.metrics}: {directory} does not exist")
        return Run(args, ignored, comm).run()

    return run_spmd(command, comm)


if __name__ == "__main__":
    sys.exit(main())
