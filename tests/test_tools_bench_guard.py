"""tools/bench_guard.py: a run's ratios against the last run on the same kind of CPU."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_guard", ROOT / "tools/bench_guard.py")
guard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard)

MACHINE = {"cpu": "AMD EPYC 7763 64-Core", "vector_extensions": ["sse4_2", "avx", "avx2", "fma"]}


def _run(dp: float, spread: tuple, generic: float = 1.2) -> dict:
    return {"machine": MACHINE, "dp_over_nondp": dp, "dp_over_nondp_spread": list(spread),
            "generic_over_fused": generic, "generic_over_fused_spread": [generic, generic],
            "examples_per_s": {"mpidp-dp": 5.0}}


def test_the_key_is_the_cpu_and_its_vector_extensions():
    assert guard.machine_key({"machine": MACHINE}) == "amd-epyc-7763-64-core__avx-avx2"
    other = dict(MACHINE, vector_extensions=MACHINE["vector_extensions"] + ["avx512f"])
    assert guard.machine_key({"machine": other}) != guard.machine_key({"machine": MACHINE})
    # an AVX-512 CPU run under tools/as_avx2.sh is kept apart from a real AVX2 one
    limited = dict(MACHINE, isa_limit="avx2 (AVX-512 left unused on a CPU that has it)")
    assert guard.machine_key({"machine": limited}) == "amd-epyc-7763-64-core__avx-avx2__limited"
    # bench prep keeps the machine in its provenance only
    assert guard.machine_key({"provenance": {"machine": MACHINE}}) == \
        "amd-epyc-7763-64-core__avx-avx2"


def test_as_avx2_turns_every_avx512_feature_off_for_numba_and_the_facts():
    import os
    import subprocess
    import sys

    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    probe = ("import os, json; from collectives import machine; print(json.dumps("
             "[os.environ.get('NUMBA_CPU_FEATURES'), os.environ.get('ATEN_CPU_CAPABILITY'), "
             "os.environ.get('MKL_ENABLE_INSTRUCTIONS'), machine.describe()]))")
    env = {k: v for k, v in os.environ.items() if k != "MPIDP_ISA_LIMIT"}
    done = subprocess.run([str(ROOT / "tools/as_avx2.sh"), sys.executable, "-c", probe],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(env, PYTHON=sys.executable))
    assert done.returncode == 0, done.stderr
    features, aten, mkl, facts = json.loads(done.stdout)
    if "+avx512f" not in llvm.get_host_cpu_features().flatten().split(","):
        # nothing to leave unused: the command runs as it is, and says so
        assert "no AVX-512 to leave unused" in done.stderr
        assert features is None and "isa_limit" not in facts
        return
    flags = features.split(",")
    assert flags and not [f for f in flags if f.startswith("+avx512")]
    assert aten == "avx2" and mkl == "AVX2"
    assert not [v for v in facts["vector_extensions"] if v.startswith("avx512")]
    assert facts["isa_limit"].startswith("avx2")
    usage = subprocess.run([str(ROOT / "tools/as_avx2.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "AVX2" in usage.stdout


def test_runs_at_other_thread_counts_are_other_kinds():
    one = guard.kind_of(Path("dpsgd-1-thread.json"), {"threads": 1})
    two = guard.kind_of(Path("dpsgd-2-threads.json"), {"threads": 2})
    assert (one, two) == ("dpsgd-1t", "dpsgd-2t")
    assert guard.kind_of(Path("prep.json"), {}) == "prep"


def test_a_ratio_inside_the_noise_is_the_same_and_one_outside_moved():
    old = _run(1.05, (1.02, 1.09))
    same = guard.compare(old, _run(1.10, (1.08, 1.12)))  # 1.10 <= 1.09 + 0.02
    assert all(line.startswith("same") for line in same), same
    moved = guard.compare(old, _run(1.20, (1.18, 1.22)))
    assert moved[0].startswith("MOVED dp_over_nondp") and moved[1].startswith("same")
    assert guard.ratios({"models": {"mlp": _run(1.1, (1.0, 1.2))}})["mlp/dp_over_nondp"] == \
        (1.1, 1.0, 1.2)


def test_store_then_compare(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(guard, "STORE", tmp_path / "machines")
    monkeypatch.setattr(guard, "ROOT", tmp_path)
    first, second = tmp_path / "dpsgd.json", tmp_path / "dpsgd-new.json"
    first.write_text(json.dumps(_run(1.05, (1.02, 1.09))))
    second.write_text(json.dumps(_run(1.30, (1.28, 1.31))))
    assert guard.main([str(first), "--store"]) == 0
    assert "nothing to compare" in capsys.readouterr().out
    assert guard.main([str(second)]) == 1
    assert "MOVED dp_over_nondp" in capsys.readouterr().out
