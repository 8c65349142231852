"""``mpidp bench noise`` and the machine facts every benchmark prints."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from collectives import machine
from engine.bench import noise
from engine.run import threads
from engine.cli import build_parser
from engine.errors import ConfigError, OutputError


def _run(*argv):
    args = build_parser().parse_args(["bench", "noise", *argv])
    return args._run(args)


def test_each_method_adds_unit_normal_noise_to_its_buffer():
    size = 20_000
    methods, buffers = noise._methods(size)
    assert tuple(methods) == tuple(buffers) == noise.METHODS
    for call in methods.values():
        call()
    for name, tensor in buffers.items():  # one call's noise: std 1 within 5 standard errors
        x = tensor.numpy().astype(np.float64)
        assert abs(x.std() - 1.0) < 5 * np.sqrt(0.5 / size) and abs(x.mean()) < 0.05, name


def test_bench_noise_reports_the_median_ratios_and_the_machine(tmp_path, capsys, monkeypatch):
    """With a fake clock each method costs a known time per call: the table and
    the JSON must give exactly those figures."""
    clock = [0.0]
    cost = {"mpidp": 1e-6, "torch": 3e-6, "numpy-sfc64": 5e-6, "numpy-pcg64": 6e-6}

    def fake_methods(size):
        def make(seconds):
            def call():
                clock[0] += seconds
            return call
        return {name: make(seconds) for name, seconds in cost.items()}, {}

    monkeypatch.setattr(noise, "_methods", fake_methods)
    monkeypatch.setattr(noise.time, "perf_counter", lambda: clock[0])
    out = tmp_path / "n.json"
    argv = ["--size", "1000", "--repeats", "3", "--seconds", "1e-5", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/mpidp", "bench", "noise", *argv])
    assert _run(*argv) == 0
    data = json.loads(out.read_text())
    # The file says how to make it again: the command, the date, the code, the machine.
    made = data["provenance"]
    assert made["command"] == "mpidp bench noise " + " ".join(argv)
    assert made["date"].endswith("+00:00") and made["machine"] == data["machine"]
    assert made["commit"] == machine.source_commit()[0]
    for name, seconds in cost.items():
        assert data["ns_per_sample"][name] == pytest.approx(seconds * 1e9 / 1000)
        assert data["over_mpidp"][name] == pytest.approx(seconds / cost["mpidp"])
        assert len(data["all_rounds_s"][name]) == 3
    assert data["machine"]["cpu"] == machine.cpu_model() and data["numba_target"]
    text = capsys.readouterr().out
    assert f"machine: {machine.one_line(data['machine'])}" in text
    assert re.search(r"^torch\s+3\.000\s+333\s+3\.00x$", text, re.MULTILINE)


def test_bench_noise_labels_the_threads_each_library_runs(tmp_path, capsys, monkeypatch,
                                                         threads_restored):
    """--threads 64 was labelled "64 thread(s)" though mpidp's kernel ran on
    Numba's pool, and nothing said the threads oversubscribed the cores."""
    import os

    import numba

    pool = numba.config.NUMBA_NUM_THREADS
    many = 2 * max(pool, os.cpu_count() or 1)
    monkeypatch.setattr(noise, "_methods", lambda size: ({"mpidp": lambda: None}, {}))
    out = tmp_path / "n.json"
    assert _run("--seconds", "1e-4", "--repeats", "1", "--threads", str(many),
                "--json", str(out)) == 0
    data = json.loads(out.read_text())
    assert (data["threads"], data["numba_threads"], data["numba_pool"]) == (many, pool, pool)
    assert data["threads_note"].startswith(f"note: --threads {many} with 1 rank(s)")
    head, note = capsys.readouterr().out.splitlines()[:2]
    assert (f"per call, {many} torch thread(s), {pool} Numba thread(s) (its pool, "
            f"NUMBA_NUM_THREADS={pool}), 1 rounds") in head
    assert note == data["threads_note"]
    assert threads.thread_label({"threads": 2, "numba_threads": 2}) == "2 thread(s)"


@pytest.mark.parametrize("argv, error, message", [
    (["--size", "0"], ConfigError, "--size 0 must be at least 1"),
    (["--repeats", "0"], ConfigError, "--repeats 0 must be at least 1"),
    (["--seconds", "0"], ConfigError, "--seconds 0.0 must be positive"),
    (["--json", "/nonexistent-dir/x.json"], OutputError, "--json"),
])
def test_bench_noise_refuses_bad_options_before_any_work(argv, error, message, monkeypatch):
    monkeypatch.setattr(noise, "_methods", lambda size: pytest.fail("ran before refusing"))
    with pytest.raises(error, match=message):
        _run(*argv)


def test_vector_extensions_are_named_in_a_fixed_order(monkeypatch):
    fields = {"flags": "fpu fma avx2 sse4_2 avx512f xyz", "model name": "Some CPU 9000"}
    monkeypatch.setattr(machine, "_cpuinfo_field", fields.get)
    assert machine.vector_extensions() == ["sse4_2", "avx2", "fma", "avx512f"]
    assert machine.cpu_model() == "Some CPU 9000"
    line = machine.one_line()
    assert line.startswith("Some CPU 9000 (sse4_2, avx2, fma, avx512f), ")
    assert machine.mpi_library() in line


def test_an_isa_limit_drops_avx512_from_the_facts_and_says_so(monkeypatch):
    fields = {"flags": "fpu fma avx2 sse4_2 avx512f avx512bw", "model name": "Some CPU 9000"}
    monkeypatch.setattr(machine, "_cpuinfo_field", fields.get)
    monkeypatch.delenv("MPIDP_ISA_LIMIT", raising=False)
    assert "isa_limit" not in machine.describe()
    monkeypatch.setenv("MPIDP_ISA_LIMIT", "avx2")  # what tools/as_avx2.sh sets
    facts = machine.describe()
    assert facts["vector_extensions"] == ["sse4_2", "avx2", "fma"]
    assert facts["isa_limit"].startswith("avx2")
    assert "; limited to avx2" in machine.one_line(facts)
    assert machine.command_line(["/v/bin/mpidp", "bench", "dpsgd"]) == \
        "tools/as_avx2.sh mpidp bench dpsgd"


def test_a_command_line_is_what_a_user_types_again():
    assert machine.command_line(["/v/bin/mpidp", "bench", "allreduce", "-e", "4K"], ranks=2) == \
        "mpiexec -n 2 mpidp bench allreduce -e 4K"
    assert machine.command_line(["/v/bin/mpidp", "bench", "dpsgd", "--json", "a b.json"]) == \
        "mpidp bench dpsgd --json 'a b.json'"
    script = str(machine._SOURCE / "tests" / "faults.py")
    assert machine.command_line([script, "--runs", "4"]) == "python tests/faults.py --runs 4"
    entry = str(machine._SOURCE / "engine" / "cli.py")  # python -m engine.cli
    assert machine.command_line([entry, "bench", "prep"]) == "mpidp bench prep"


def test_the_commit_is_the_checkouts_own_or_none(tmp_path):
    """A copy of mpidp outside a git checkout (or inside someone else's) names
    no commit: None, never the commit of an unrelated repository."""
    assert machine.source_commit(tmp_path) == (None, False)
    outer = tmp_path / "outer"
    (outer / "mpidp").mkdir(parents=True)
    git = ["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (outer / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    assert machine.source_commit(outer / "mpidp") == (None, False)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert machine.source_commit(outer) == (head, False)
    (outer / "f").write_text("2")
    assert machine.source_commit(outer) == (head, True)
