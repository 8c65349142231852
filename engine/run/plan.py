"""What a run settles before its state is built: the privacy plan and the kernels."""
from __future__ import annotations

import torch

from engine.config import TrainConfig
from engine.dp.accountant import Accountant
from engine.errors import ConfigError, agree
from engine.run.collective import rank0_value
from kernels import registry


def plan_privacy(cfg: TrainConfig, payload: dict | None, q: float, total_steps: int,
                 steps_per_epoch: int, comm) -> tuple[Accountant | None, float | None,
                                                     float | None]:
    """Collective: (accountant, budget, planned epsilon), planned (or, with the
    checkpoint's ``payload``, restored and checked) on rank 0 alone and
    broadcast; (None, None, None) for a non-private run. dp-accounting takes
    about a second and a half of CPU to import and a calibration seconds more;
    one rank doing it spares every other rank both, and the plan is the same
    everywhere by construction.

    Raises (on every rank):
        PrivacyError: the plan cannot meet the target (or the recorded budget).
    """
    if not cfg.dp:
        return None, None, None

    def plan() -> tuple[Accountant, float, float]:
        if payload is not None:
            acct = Accountant.from_state(payload["accountant"])
            budget = float(payload["budget_epsilon"])
        else:
            acct, budget = Accountant.plan(q, cfg.delta, total_steps, cfg.accountant,
                                           target_epsilon=cfg.target_epsilon,
                                           sigma=cfg.noise_multiplier)
        acct.check_plan(budget, cfg.epochs, steps_per_epoch)
        return acct, budget, acct.epsilon(total_steps)

    return rank0_value(comm, plan)


def choose_kernels(cfg: TrainConfig, device: torch.device, comm) -> str | None:
    """Collective: the kernel family every rank runs (``--kernels``, checked by a
    probe kernel on GPUs; the first that runs when not given).

    Raises (on every rank):
        ConfigError: the back-end named by ``--kernels`` cannot run here.
    """
    chosen, error = cfg.kernels, None
    try:
        chosen = registry.choose(device, cfg.kernels)
    except registry.BackendUnusable as exc:
        error = ConfigError(f"--kernels {cfg.kernels}: {exc}")
    agree(comm, error)
    return chosen
