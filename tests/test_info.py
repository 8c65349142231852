"""mpidp info: the bug-report command."""
import json
import os
import re
import subprocess
import sys

import pytest

from launcher import clean_env, mpidp


def test_info_under_two_ranks_reports_size_two(tmp_path):
    target = tmp_path / "numba-target.json"  # a CPU never measured: info does not measure
    result = mpidp(2, "info", "--json", timeout=120,
                   env=dict(clean_env(), MPIDP_NUMBA_TARGET_FILE=str(target)))
    assert result.returncode == 0, result.stderr
    assert not target.exists()
    report = json.loads(result.stdout)  # only rank 0 prints
    assert report["size"] == 2
    assert sorted(r["rank"] for r in report["ranks"]) == [0, 1]
    assert report["mpi_cuda_aware"] in ("yes", "no", "unknown")
    names = [b["name"] for b in report["kernel_backends"]]
    assert names == ["numba-cpu", "numba-cuda", "cuda-simulator", "cupy"]
    for rank in report["ranks"]:  # a training run's threads, Numba's pool apart
        assert rank["torch_threads"] == rank["threads"]
        assert rank["numba_threads"] == min(rank["threads"], rank["numba_pool"])
    for key in ("mpidp", "python", "mpi4py", "mpi_library", "torch", "numba", "h5py"):
        assert report["versions"][key]
    facts = report["allreduce"]  # mpiexec on one machine: the shared pair
    crowded = len(os.sched_getaffinity(0)) < 2
    assert facts["placement"] == ("oversubscribed-pair" if crowded else "pair")
    assert facts["shared_memory"] == "shm-pair" and facts["auto"][-1][:2] == [None, "ring"]
    assert facts["channels"] == ["shm-pair", "p2p"] and facts["auto"][-1][2] == "shm-pair"
    assert facts["waiting"] == ("asleep (futex)" if crowded else "spinning")
    from collectives.channels import streaming  # the pair's copies (channels.copy_mode)

    assert facts["copies"] == ("cached (the ranks share a core)" if crowded else
                               "cached or streaming, chosen per call from measured times"
                               if streaming.available() else
                               "cached (streaming stores need x86-64 and Numba)")


def test_info_text_report_has_the_sections():
    result = mpidp(2, "info", timeout=120)
    assert result.returncode == 0, result.stderr
    for heading in ("versions", "MPI job", "communicator size  2", "kernel back-ends",
                    "environment", "all-reduce", "placement      ",
                    "shared memory  shm-pair; waiting ranks: ", "pair copies    ",
                    "channels       shm-pair, p2p", "auto runs      "):
        assert heading in result.stdout
    assert "WRONG LAUNCH" not in result.stdout
    # the layer Numba loaded, not its configured 'default'; and the vector
    # width info sets for itself is not shown as the user's environment
    assert re.search(r"threading layer '(omp|tbb|workqueue)'", result.stdout), result.stdout
    environment = result.stdout.split("\nenvironment\n", 1)[1]
    assert "MPIDP_VECTOR_WIDTH" not in environment, environment


def test_info_warns_loudly_about_singletons():
    # What a plain `srun` without --mpi=pmi2 looks like to each rank.
    # Started directly (no mpiexec): MPI makes a singleton of size 1.
    env = clean_env(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="4")
    result = subprocess.run([sys.executable, "-m", "engine.cli", "info"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "WARNING: WRONG LAUNCH" in result.stdout
    assert "SLURM_STEP_NUM_TASKS=4" in result.stdout


@pytest.mark.mpi(min_size=1)
def test_collect_gathers_every_rank(comm):
    from engine.info import collect

    report = collect()
    if comm.Get_rank() == 0:
        assert report["size"] == comm.Get_size()
        assert [r["rank"] for r in report["ranks"]] == list(range(comm.Get_size()))
        assert not any(r["size_mismatch"] for r in report["ranks"])
    else:
        assert report is None


@pytest.mark.mpi(min_size=1)
def test_collect_reports_a_training_runs_threads_and_puts_back_its_own(comm):
    """`mpiexec -n 2 mpidp info --json` said "threads": 1 per rank beside
    "numba_threads": 2 (Numba's pool) and torch's default count, and the
    back-ends' line "2 threads": each is now a training run's count or says
    it is the pool, and the process keeps its own counts."""
    import numba
    import torch

    from engine.info import collect, format_report
    from engine.run.threads import configure_threads

    before = torch.get_num_threads(), numba.get_num_threads()
    expected = configure_threads(None, comm).threads  # what mpidp train sets
    try:
        torch.set_num_threads(expected + 1)  # not a training run's count
        numba.set_num_threads(1)
        report = collect()
        assert (torch.get_num_threads(), numba.get_num_threads()) == (expected + 1, 1)
    finally:
        torch.set_num_threads(before[0])
        numba.set_num_threads(before[1])
    if comm.Get_rank() != 0:
        return
    pool = numba.config.NUMBA_NUM_THREADS
    for rank in report["ranks"]:
        assert rank["threads"] == rank["torch_threads"]
        assert (rank["numba_threads"], rank["numba_pool"]) == (min(rank["threads"], pool), pool)
    detail = report["kernel_backends"][0]["detail"]
    assert f"a pool of {pool} threads (NUMBA_NUM_THREADS)" in detail
    text = format_report(report)
    assert "cores  torch  numba  mpi_threads" in text
    assert f"Numba's at most its pool of {pool}, NUMBA_NUM_THREADS" in text


@pytest.mark.mpi(min_size=1)
def test_oversubscribed_ranks_are_said_to_yield_only_where_mpi_was_told_to(comm):
    """Before: `mpiexec -n 2 -bind-to user:0,0 mpidp info` said waiting ranks
    yield the CPU, though each rank's own mask looked unshared before MPI
    started, so heavy yield was never set and they spin."""
    from engine.info import collect, format_report

    report = collect()
    if comm.Get_rank() != 0:
        return
    for rank in report["ranks"]:
        rank.update(oversubscribed=True, local_ranks=2, capacity=1)
    for yields, said in ((True, "waiting ranks yield the CPU"),
                         (False, "and waiting ranks spin")):
        for rank in report["ranks"]:
            rank["waiting_yields"] = yields
        text = format_report(report)
        assert f"oversubscribed: 2 ranks on 1 cores; {said}" in text or \
            f"oversubscribed: 2 ranks on 1 cores, {said}" in text, text
    assert "export MPIR_CVAR_ENABLE_HEAVY_YIELD=1" in text
    # auto's table is what it runs before measuring; where it measured, the file decides
    report["allreduce"]["tuning_file"] = "/cache/allreduce-tuning.json"
    assert "the fastest it measured, kept in /cache/allreduce-tuning.json" in \
        format_report(report)


def test_auto_text_names_algorithm_and_channel():
    from collectives.describe import auto_text

    assert auto_text([[None, "ring", "shm-group"]]) == "ring (shm-group) at every size"
    assert auto_text([[256, "native", None], [2 * 1024 * 1024, "recursive_doubling", "p2p"],
                      [None, "ring", "p2p"]]) == \
        "native up to 256 B, recursive_doubling (p2p) up to 2 MiB, ring (p2p) above"


def test_ranks_bound_to_a_core_each_are_not_oversubscribed(tmp_path):
    """Hydra's ``-bind-to core`` (like ``srun --cpu-bind=cores`` and Open MPI at
    two ranks) leaves each rank a mask of one core: the node is still not
    crowded, so MPI keeps its fast thread level and waiting ranks spin. The
    ranks start through a wrapper script, bound with them, as GPU sites'
    binding scripts do: the launcher's proxy above it is the one to ask."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("binding two ranks to a core each needs two cores")
    from launcher import mpiexec_path

    wrapper = tmp_path / "wrapper.sh"
    wrapper.write_text('#!/bin/bash\n"$@"\nexit $?\n')  # not exec: bash stays the parent
    wrapper.chmod(0o755)
    command = [mpiexec_path(), "-bind-to", "core", "-n", "2", str(wrapper), sys.executable,
               "-m", "engine.cli", "info", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env=dict(clean_env(), MPIEXEC_TIMEOUT="125"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for rank in report["ranks"]:
        assert (rank["cores"], rank["bound"], rank["oversubscribed"]) == (1, True, False)
        assert rank["threads"] == 1
        assert rank["mpi_thread_level"] == "funneled"
    assert report["allreduce"]["placement"] == "pair"
    assert report["allreduce"]["waiting"] == "spinning"


def test_mpi_library_line_drops_open_mpis_nul(monkeypatch):
    """Open MPI's version string ends in a NUL, which made `mpidp info` and the
    benchmarks' headers binary to grep."""
    from collectives import machine

    monkeypatch.setattr(machine.MPI, "Get_library_version",
                        lambda: "Open MPI v5.0.11, package: Open MPI\x00")
    assert machine.mpi_library() == "Open MPI v5.0.11, package: Open MPI"
