"""The DP step of the image models against their non-private step and Opacus' hooks.

Times, in one process and side by side, the clipped gradient sum of one batch
of random images through mpidp's per-layer rules (``ModuleEngine``), the
plain summed gradient (non-private), and Opacus' ``GradSampleModule``
computing per-sample gradients, clipping them and summing (the work of its
DP step before noise). Best of ``--repeat`` runs; prints a markdown table for
docs/images.md.

    python tools/image_step.py --threads 2
    python tools/image_step.py --models resnet20 --batches 32,128
"""
from __future__ import annotations

import argparse
import platform
import time
import warnings

import torch

from engine.nn.image_models import build
from engine.dp.module_engine import ModuleEngine

SHAPES = {"mnist-small": (1, 28, 28), "mnist-large": (1, 28, 28), "resnet20": (3, 32, 32)}
BATCHES = {"mnist-small": 256, "mnist-large": 256, "resnet20": 32}


def best(call, repeat: int) -> float:
    call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def opacus_step(name: str, shape, x: torch.Tensor, y: torch.Tensor, max_norm: float):
    """Opacus' per-sample gradients, clipped and summed (no noise), as a callable."""
    from opacus import GradSampleModule

    module = GradSampleModule(build(name, shape, 10))
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")

    def step():
        for p in module.parameters():
            p.grad_sample, p.grad = None, None
        loss_fn(module(x), y).backward()
        per = [p.grad_sample.reshape(x.shape[0], -1) for p in module.parameters()]
        norms = torch.cat(per, 1).norm(dim=1)
        factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        return [torch.einsum("i,i...->...", factors, p.grad_sample)
                for p in module.parameters()]
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--batches", default=None,
                        help="comma-separated batch sizes (default: 256, resnet20 32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} threads, best of {args.repeat}")
    print("| model, batch | DP ms | non-private ms | DP / non-private | Opacus ms | "
          "mpidp vs Opacus |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        shape = SHAPES[name]
        batches = ([int(b) for b in args.batches.split(",")] if args.batches
                   else [BATCHES[name]])
        for batch in batches:
            torch.manual_seed(0)
            model = build(name, shape, 10)
            n = sum(p.numel() for p in model.parameters())
            x = torch.randn(batch, shape[0] * shape[1] * shape[2] + 1)
            x[:, -1] = 1
            y = torch.randint(0, 10, (batch,))
            engine = ModuleEngine(model, torch.zeros(n), (x[:8], y[:8]), 10, capacity=batch)
            k = engine.load(x, y, torch.arange(batch))
            dp = best(lambda: engine.clipped_sum(k, 1.0), args.repeat)
            plain = best(lambda: engine.clipped_sum(k, None), args.repeat)
            theirs = best(opacus_step(name, shape, x[:, :-1], y, 1.0), args.repeat)
            print(f"| `{name}`, {batch} | {dp * 1e3:.1f} | {plain * 1e3:.1f} | "
                  f"{dp / plain:.2f} | {theirs * 1e3:.0f} | {theirs / dp:.2f}x |")


if __name__ == "__main__":
    main()
