"""``mpidp bench allreduce``: the correctness check, the records, the outputs."""
import json

import numpy as np
import pytest

import collectives
from collectives import registry
from collectives.bench import allreduce, measure, report
from collectives.registry import register_library

RECORD_KEYS = {"algorithm", "bytes", "count", "dtype", "ranks", "avg_us", "min_us", "max_us",
               "algbw_gbps", "busbw_gbps", "wrong"}


@pytest.mark.mpi(min_size=1)
def test_measure_checks_every_algorithm_and_fills_the_records(comm):
    names = collectives.names()
    records = measure.measure(comm, names, [8, 24, 1024], "int64", "sum", iters=3, warmup=1,
                              check=True, rounds=2)
    size = comm.Get_size()
    assert [(r["algorithm"], r["bytes"]) for r in records] == \
        [(name, b) for b in (8, 24, 1024) for name in names]
    for r in records:
        assert RECORD_KEYS <= set(r)
        assert r["wrong"] == 0 and r["ranks"] == size and r["dtype"] == "int64"
        assert r["count"] * 8 == r["bytes"] and r["iterations"] == 3
        assert 0 < r["min_us"] <= r["avg_us"] <= r["max_us"]
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (size - 1) / size)
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["avg_us"] / 1e3)
    auto = [r for r in records if r["algorithm"] == "auto"]
    assert all(r["runs"] in names and r["runs"] != "auto" for r in auto)
    for r in records:  # the host's steal time during the size's measurements; None
        # when no clock tick passed (or no /proc/stat)
        assert "steal_pct" in r
        assert r["steal_pct"] is None or 0.0 <= r["steal_pct"] <= 100.0
    from collectives.core.plans import comm_state

    probed = size >= 2 and not comm_state(comm).oversubscribed  # one machine: ranks 0, 1 share it
    for r in records:  # core-to-core copy before and after the size
        if probed:
            assert len(r["xcore_gbps"]) == 2 and min(r["xcore_gbps"]) > 0
        else:
            assert r["xcore_gbps"] is None


@pytest.mark.mpi(min_size=1)
def test_a_job_warms_up_every_algorithm_before_its_first_timed_size(comm, monkeypatch):
    """The first row of a run was an artefact (a job's first calls cost several
    times the next ones): an untimed pass of every algorithm comes first."""
    calls: list[tuple[int, str]] = []
    real = measure.allreduce

    def counted(buf, comm_, name, op):
        calls.append((buf.shape[0], name))
        return real(buf, comm_, name, op)

    monkeypatch.setattr(measure, "allreduce", counted)
    measure.measure(comm, ["ring", "native"], [16, 64], "float32", "sum", iters=2, warmup=1,
                    rounds=1)
    head = calls[:2 * measure.WARMUP_PASS]
    assert head == [(4, "ring")] * measure.WARMUP_PASS + [(4, "native")] * measure.WARMUP_PASS


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("setting", ["on", "off"])
def test_records_say_which_share_of_calls_streamed(comm, setting, monkeypatch):
    """``streamed``: the share of timed calls whose copies into the shared pair
    streamed (collectives.channels.copy_mode); None where no copy could stream."""
    from collectives.channels import streaming
    from collectives.core.plans import comm_state

    monkeypatch.setenv("MPIDP_ALLREDUCE_STREAMING", setting)
    records = measure.measure(comm, ["ring", "native"], [8, 256 << 10], "float32", "sum",
                              iters=4, warmup=1, rounds=2)
    state = comm_state(comm)
    pair = state.channel_named("shm-pair")
    streams = pair is not None and not pair.sleep and streaming.available()
    for r in records:
        if r["algorithm"] == "ring" and r["bytes"] > 8 and streams:
            assert r["streamed"] == (1.0 if setting == "on" else None)
        else:  # 8 B (pieces too small), MPI's own, or no pair with a core each
            assert r["streamed"] is None
    line = report.streaming_line(records)
    assert (line is not None) == (streams and setting == "on")
    if line:
        assert "ring 100-100%" in line


def test_steal_time_from_proc_stat_readings():
    assert measure.steal_percent((10, 1000), (30, 1400)) == pytest.approx(5.0)
    assert measure.steal_percent(None, (30, 1400)) is None
    assert measure.steal_percent((10, 1000), (10, 1000)) is None  # no time passed
    ticks = measure.cpu_ticks()
    if ticks is not None:  # Linux
        stolen, total = ticks
        assert 0 <= stolen <= total
    rows = [{"bytes": 1024, "steal_pct": 0.5}, {"bytes": 4 << 20, "steal_pct": 12.25}]
    line = report.steal_line(1.5, rows)
    assert "1.5% over the run" in line and "at most 12.2% at 4 MiB" in line
    assert "not measurable" in report.steal_line(None, [{"bytes": 8, "steal_pct": None}],
                                                 proc_stat=False)


@pytest.fixture
def broken_algorithm():
    """An algorithm that forgets the last element's contribution from rank 0."""
    @register_library("broken_for_test", summary="drops rank 0's last element", messages="as native")
    def plan(ctx):
        native_bind = registry.get("native").plan(ctx)

        def bind(view):
            run_native = native_bind(view)

            def run():
                if ctx.rank == 0 and ctx.n:
                    view[-1] = 0
                run_native()

            return run

        return bind

    yield "broken_for_test"
    del registry._ALGORITHMS["broken_for_test"]
    collectives.forget()


@pytest.mark.mpi(min_size=1)
def test_a_wrong_result_is_counted_and_fails_the_command(comm, shared_tmp, broken_algorithm,
                                                         capsys):
    parser = _parser()
    path = shared_tmp / "bench.json"
    args = parser.parse_args(["-b", "64", "-e", "128", "-i", "2", "-w", "1", "-c",
                              "-a", f"native,{broken_algorithm}", "--json", str(path)])
    code = allreduce.run(args)
    assert code == allreduce.EXIT_WRONG
    comm.Barrier()
    records = json.loads(path.read_text())
    wrong = {(r["algorithm"], r["bytes"]): r["wrong"] for r in records}
    assert wrong[("native", 64)] == 0 and wrong[(broken_algorithm, 64)] == comm.Get_size()
    if comm.Get_rank() == 0:
        assert "WRONG" in capsys.readouterr().out


def _parser():
    import argparse

    parser = argparse.ArgumentParser()
    allreduce.add_arguments(parser)
    return parser


def test_sizes_and_units():
    assert allreduce.parse_size("64M") == 64 << 20 and allreduce.parse_size("8") == 8
    assert allreduce.parse_size("1KiB") == 1024 and allreduce.parse_size("2g") == 2 << 30
    assert allreduce.sizes(8, 64, 2) == [8, 16, 32, 64]
    assert allreduce.sizes(8, 100, 4) == [8, 32]
    with pytest.raises(allreduce.BenchUsageError):
        allreduce.sizes(64, 8, 2)
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        allreduce.parse_size("12 parsecs")


def test_pattern_sums_are_exact_in_float16():
    size = 6
    want = measure.expected(1000, size, np.float16, "sum")
    exact = sum(measure.pattern(1000, q, np.int64) for q in range(size))
    assert (want.astype(np.int64) == exact).all()


def test_table_and_plot(tmp_path):
    rows = []
    for name in ("ring", "native"):
        for nbytes in (8, 16):
            rows.append({"algorithm": name, "runs": name, "bytes": nbytes, "count": nbytes // 4,
                         "dtype": "float32", "avg_us": 2.0, "min_us": 1.0, "max_us": 3.0,
                         "algbw_gbps": 0.004, "busbw_gbps": 0.004, "x_native": 1.0,
                         "wrong": 0})
    line = report.format_row(rows[0])
    assert len(line) == len(report.HEADER) and "ring" in line
    report.plot(rows, str(tmp_path / "p.png"), "test", ceiling=10.0)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mpidp_bench_allreduce_under_mpiexec(tmp_path):
    """The command as users run it: 2 ranks, table, JSON, plot, exit status."""
    from launcher import mpidp

    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    result = mpidp(2, "bench", "allreduce", "-b", "8", "-e", "4K", "-f", "8", "-i", "20",
                   "-c", "--json", str(out_json), "--plot", str(out_png), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "memory-copy ceiling" in result.stdout and "busbw" in result.stdout
    assert "# check: all results correct" in result.stdout
    records = json.loads(out_json.read_text())
    assert {r["algorithm"] for r in records} == set(collectives.names())
    assert all(RECORD_KEYS <= set(r) and r["ranks"] == 2 and r["wrong"] == 0 for r in records)
    made = records[0]["provenance"]
    assert made["command"].startswith("mpiexec -n 2 mpidp bench allreduce -b 8 -e 4K")
    assert made["date"] and made["machine"]["cpu"] == records[0]["cpu"]
    assert all(r["provenance"] == made for r in records)
    assert out_png.stat().st_size > 1000


def test_summarize_pairs_rounds_and_takes_medians(tmp_path, capsys):
    def record(name, rounds, runs=None, steal=0.5):
        return {"algorithm": name, "runs": runs or name, "bytes": 1024, "count": 256,
                "dtype": "float32", "op": "sum", "ranks": 2, "oversubscribed": False,
                "avg_us": sum(rounds) / len(rounds), "busbw_gbps": 1.0, "rounds_us": rounds,
                "copy_ceiling_gbps": 10.0, "steal_pct": steal}

    # Round 2 is slow for everyone (host noise): paired ratios ignore it.
    run = [record("native", [2.0, 20.0, 2.0]), record("ring", [1.0, 10.0, 1.0]),
           record("auto", [2.0, 20.0, 2.0], runs="native")]
    table = report.summarize([run, run])
    row = next(line for line in table.splitlines() if line.startswith("| 1 KiB"))
    assert "| 2.00 |" in row  # ring: twice as fast as native in every round
    assert "1.00 (native, 2.00 of best)" in row  # auto ran native: twice the best time
    assert "Host steal time per size: 0.5-0.5% (median 0.5%)." in table
    older = [record("native", [2.0]), record("ring", [1.0], steal=None)]  # before steal_pct
    assert "steal" not in report.summarize([[dict(r, steal_pct=None) for r in older]])
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(run))
    assert allreduce.run(_parser().parse_args(["--summarize", *map(str, paths)])) == 0
    assert "| 1 KiB |" in capsys.readouterr().out


def test_summarize_leaves_out_sizes_measured_in_a_slow_spell():
    def record(name, nbytes, xcore, speed):
        return {"algorithm": name, "runs": name, "bytes": nbytes, "count": nbytes // 4,
                "dtype": "float32", "op": "sum", "ranks": 2, "oversubscribed": False,
                "avg_us": 10.0 / speed, "busbw_gbps": 1.0, "rounds_us": [10.0 / speed],
                "copy_ceiling_gbps": 10.0, "steal_pct": 0.0, "xcore_gbps": xcore}

    fast, slow = [9.5, 10.0], [9.8, 1.9]  # the spell began during the size
    run = [record("native", 1024, fast, 1.0), record("ring", 1024, fast, 4.0),
           record("native", 4096, slow, 1.0), record("ring", 4096, slow, 1.5)]
    everything = report.summarize([run])
    assert "| 1 KiB |" in everything and "| 4 KiB |" in everything
    assert "Core-to-core copy (rank 0 -> 1) before/after each size: 1.9-10.0 GB/s." \
        in everything
    quiet = report.summarize([run], min_xcore=5)
    assert "| 1 KiB |" in quiet and "| 4 KiB |" not in quiet
    assert "measured below 5 GB/s core to core: 1 of 2 sizes" in quiet
    assert "No size left" in report.summarize([run], min_xcore=20)
    wholly_slow = [record("native", 8192, [1.8, 1.7], 1.0), record("ring", 8192, [1.8, 1.7], 3.0)]
    only_slow = report.summarize([run + wholly_slow], max_xcore=5)
    assert "| 8 KiB |" in only_slow and "| 1 KiB |" not in only_slow \
        and "| 4 KiB |" not in only_slow  # 4 KiB: the spell began during the size
    assert "measured not wholly below 5 GB/s core to core: 2 of 3 sizes" in only_slow
    assert "No size left" in report.summarize([run], max_xcore=1)
    all_slow = [dict(r, xcore_gbps=[1.8, 1.7]) for r in run]  # a run slow throughout
    both = report.summarize([run, all_slow], min_xcore=5)
    assert "| 1 KiB |" in both and "3 of 4 sizes" in both
    assert not report.slow_spell(dict(run[0], xcore_gbps=None), 5)  # not measured: kept


def test_min_xcore_only_filters_saved_runs():
    with pytest.raises(allreduce.BenchUsageError, match="--summarize"):
        allreduce.run(_parser().parse_args(["--min-xcore", "5"]))
    with pytest.raises(allreduce.BenchUsageError, match="--summarize"):
        allreduce.run(_parser().parse_args(["--max-xcore", "5"]))


@pytest.mark.parametrize("argv, message", [
    (["-i", "-3"], "-i/--iters: -3 must be at least 0"),
    (["-w", "-1"], "-w/--warmup_iters: -1 must be at least 0"),
    (["--rounds", "0"], "--rounds: 0 must be at least 1"),
    (["--time", "-1"], "--time: -1 must be a number of seconds > 0"),
    (["--time", "nan"], "--time: nan must be a number of seconds > 0"),
    (["-c", "2"], "-c/--check: invalid choice: 2"),
])
def test_nonsense_counts_are_usage_errors(argv, message, capsys):
    """They ran, and the header printed them (iterations -3, while 10,000 ran)."""
    import argparse

    parser = argparse.ArgumentParser(prog="bench")
    allreduce.add_arguments(parser)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert parser.parse_args(["-c"]).check == 1 and parser.parse_args([]).check == 0
