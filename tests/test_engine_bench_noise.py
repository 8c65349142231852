"""``mpidp bench noise`` and the machine facts every benchmark prints."""
import json
import re

import numpy as np
import pytest

from collectives import machine
from engine.bench import noise
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
    assert _run("--size", "1000", "--repeats", "3", "--seconds", "1e-5", "--json", str(out)) == 0
    data = json.loads(out.read_text())
    for name, seconds in cost.items():
        assert data["ns_per_sample"][name] == pytest.approx(seconds * 1e9 / 1000)
        assert data["over_mpidp"][name] == pytest.approx(seconds / cost["mpidp"])
        assert len(data["all_rounds_s"][name]) == 3
    assert data["machine"]["cpu"] == machine.cpu_model() and data["numba_target"]
    text = capsys.readouterr().out
    assert f"machine: {machine.one_line(data['machine'])}" in text
    assert re.search(r"^torch\s+3\.000\s+333\s+3\.00x$", text, re.MULTILINE)


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
