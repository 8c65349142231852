"""``mpidp bench allreduce`` at its edges: options and saved runs it must refuse in one
line, rates of sizes that are no whole number of elements, the plot's title, the footers."""
import argparse
import json
import re
from types import SimpleNamespace

import pytest

from collectives.bench import allreduce, measure, report
from collectives.bench.errors import BenchUsageError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench")
    allreduce.add_arguments(parser)
    return parser


def _record(name: str, **fields) -> dict:
    """A record as ``--json`` writes it (the fields summarize reads, and more)."""
    record = {"algorithm": name, "runs": name, "bytes": 1024, "count": 256, "dtype": "float32",
              "op": "sum", "ranks": 2, "oversubscribed": False, "placement": "pair",
              "avg_us": 2.0, "busbw_gbps": 1.0, "rounds_us": [2.0, 2.0],
              "copy_ceiling_gbps": 10.0, "steal_pct": 0.0}
    return dict(record, **fields)


def _run(**fields) -> list[dict]:
    return [_record("native", **fields), _record("ring", **fields)]


# 1. --summarize mixed runs of different rank counts, dtypes, ops, placements.

@pytest.mark.parametrize("fields, differ", [
    ({"ranks": 3}, "ranks (2 vs 3)"),
    ({"dtype": "float16", "bytes": 2, "count": 1}, "dtype (float32 vs float16)"),
    ({"op": "max"}, "op (sum vs max)"),
    ({"placement": "group"}, "placement (pair vs group)"),
])
def test_summarize_refuses_runs_measured_differently(tmp_path, fields, differ):
    """The caption, taken from the first record, described the other runs wrongly."""
    first, second = tmp_path / "ar2.json", tmp_path / "ar3.json"
    first.write_text(json.dumps(_run()))
    second.write_text(json.dumps(_run(**fields)))
    args = _parser().parse_args(["--summarize", str(first), str(second)])
    with pytest.raises(BenchUsageError) as refused:
        allreduce.run(args)
    message = str(refused.value)
    assert "\n" not in message and differ in message
    assert str(first) in message and str(second) in message
    mixed = _run() + _run(**fields)  # one file holding both
    with pytest.raises(BenchUsageError, match="one file"):
        report.summarize([mixed], names=["both.json"])
    assert "| 1 KiB |" in report.summarize([_run(), _run()], names=["a", "b"])


# 2. algbw and busbw were of -b's bytes, not of the whole elements reduced.

@pytest.mark.mpi(min_size=1)
def test_rates_are_of_the_bytes_reduced(comm):
    """-b 6 in float32 reduces one element (4 B): the row said 4 B, algbw 6 B/time."""
    records = measure.measure(comm, ["native"], [6, 22], "float32", "sum", iters=2, warmup=1,
                              rounds=1)
    size = comm.Get_size()
    assert [r["bytes"] for r in records] == [4, 20]
    for r in records:
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["avg_us"] / 1e3)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (size - 1) / size)


def test_copy_bandwidth_is_of_the_bytes_copied(monkeypatch):
    """A size that is no whole number of float64 elements: rate of what np.copyto copied."""
    clock = iter(range(100))  # every call 1 s after the one before
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    assert measure.copy_bandwidth(8 * 1000 + 7, repeats=3) == pytest.approx(8000 / 1e9)


# 3. Nothing to measure ran, exited 0 and said "all results correct".

@pytest.mark.parametrize("argv, message", [
    (["-b", "3", "-e", "3", "-c"], "no size from -b 3 B to -e 3 B holds one float32 element"),
    (["-b", "6", "-e", "7", "-d", "float64"], "holds one float64 element (8 B)"),
    (["-a", ""], "-a/--algorithms '' names no algorithm"),
    (["-a", ","], "-a/--algorithms ',' names no algorithm"),
    # an unknown name was an UnknownAlgorithm on every rank (one message each,
    # and MPICH's abort line); a repeated one was timed twice, two rows and records
    (["-a", "Ring"], "-a/--algorithms: unknown algorithm 'Ring' (did you mean 'ring'?); "
                     "choose from naive, "),
    (["-a", "ring,native,ring"], "-a/--algorithms 'ring,native,ring' names ring more than "
                                 "once; name each algorithm once"),
    # savefig refused the format after the whole measurement, with a traceback
    (["--plot", "p.txt"], "matplotlib writes no 'txt' files; end the name with one of "),
    (["--plot", "p.PDF"], None),
])
def test_nothing_to_measure_is_refused_before_any_work(tmp_path, capsys, monkeypatch, argv,
                                                       message):
    """Each refused in one line (BenchUsageError: collective, so rank 0 alone
    prints it; exit 2) before anything is measured or written."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "e3.json"
    if "--plot" not in argv:
        argv = [*argv, "--plot", str(tmp_path / "e.png")]
    if message is None:  # a format matplotlib writes, whatever its case: accepted
        assert allreduce.plot_format_problem(argv[-1]) is None
        return
    args = _parser().parse_args([*argv, "--json", str(out)])
    with pytest.raises(BenchUsageError, match=re.escape(message)) as refused:
        allreduce.run(args)
    assert refused.value.exit_code == 2 and refused.value.collective
    assert "\n" not in str(refused.value)
    assert capsys.readouterr().out == "" and not out.exists()


def test_check_is_one_call_per_algorithm_and_size_after_the_timed_ones(monkeypatch):
    """-c's help said "check every result", but the timed calls reduce zeros
    unchecked: the help says what is checked, and this is it."""
    checked = []
    real = measure._check

    def spy(buf, comm, algorithm, op, allreduce_):
        checked.append((algorithm, buf.size, bool(buf.any())))  # zeros until _check fills it
        return real(buf, comm, algorithm, op, allreduce_)

    monkeypatch.setattr(measure, "_check", spy)
    records = measure.measure(allreduce.MPI.COMM_WORLD, ["ring", "native"], [8, 64], "float32",
                              "sum", iters=3, warmup=1, check=True, rounds=2)
    assert checked == [("ring", 2, False), ("native", 2, False), ("ring", 16, False),
                       ("native", 16, False)]
    assert [r["wrong"] for r in records] == [0, 0, 0, 0]
    text = " ".join(_parser().format_help().split())
    assert "after each size's timed calls (which reduce zeros, unchecked), reduce a pattern " \
        "of small integers once with each algorithm and check that result" in text


def test_nothing_to_measure_under_mpiexec(tmp_path):
    """The tester's command: exit 0, an empty table and '# check: all results correct'."""
    from launcher import mpidp

    out = tmp_path / "e3.json"
    result = mpidp(2, "bench", "allreduce", "-b", "3", "-e", "3", "-c", "--json", str(out),
                   timeout=120)
    assert result.returncode == 2, result.stderr
    assert "holds one float32 element" in result.stderr and "check" not in result.stdout
    assert not out.exists()


def test_core_to_core_footer_says_why_it_was_not_measured():
    """It said 'one rank, ...' on 2 ranks; it gives the reason the records show."""
    def line(**fields):
        return report.xcore_line([{"bytes": 8, "xcore_gbps": None, **fields}])

    assert line(ranks=1, oversubscribed=False).endswith("not measured (one rank)")
    assert line(ranks=3, oversubscribed=True).endswith("(an oversubscribed node)")
    assert line(ranks=2, oversubscribed=False).endswith("(ranks 0 and 1 on different nodes)")
    assert "9.0-10.0 GB/s" in report.xcore_line([{"bytes": 8, "xcore_gbps": [9.0, 10.0]}])


# 4. --summarize of another benchmark's JSON was a traceback; its unused options were ignored.

@pytest.mark.parametrize("content, problem", [
    ([{"epsilon": 1.0, "q": 0.01, "steps": 100}], "record 0 has no 'algorithm'"),  # accountant
    ({"ns_per_sample": {"mpidp": 4.7}}, "holds a JSON dict, not a list of records"),  # noise
    ([], "holds no records"),
    ([1, 2], "record 0 is a JSON int, not an object"),
    (_run(bytes="1K"), "record 0: 'bytes' is '1K'"),
    (_run(rounds_us=[]), "record 0: 'rounds_us' is [], not times > 0"),
    (_run(placement=["pair"]), "record 0: 'placement' is ['pair']"),
])
def test_summarize_refuses_files_of_other_benchmarks(tmp_path, content, problem):
    path = tmp_path / "acc.json"
    path.write_text(json.dumps(content))
    with pytest.raises(BenchUsageError) as refused:
        allreduce.run(_parser().parse_args(["--summarize", str(path)]))
    message = str(refused.value)
    assert message.startswith(f"{path}: not a run of mpidp bench allreduce --json")
    assert problem in message and "\n" not in message


@pytest.mark.parametrize("argv, flags", [
    (["--plot", "sum.png"], "--plot"),
    (["--json", "sum.json", "-b", "16"], "-b, --json"),
    (["-c", "-a", "ring", "--rounds", "2"], "-c, -a, --rounds"),
])
def test_summarize_refuses_options_it_would_ignore(tmp_path, capsys, argv, flags):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_run()))
    with pytest.raises(BenchUsageError, match=re.escape(f"nothing: leave out {flags} ")):
        allreduce.run(_parser().parse_args(["--summarize", str(path), *argv]))
    assert capsys.readouterr().out == ""
    assert allreduce.run(_parser().parse_args(["--summarize", str(path), "--min-xcore", "1"])) \
        == 0


# 5. A size too large for numpy was a traceback, one too large for memory an error about a model.

def test_sizes_have_an_upper_bound(capsys):
    assert allreduce.parse_size("1024T") == allreduce.MAX_SIZE == 1 << 50
    assert allreduce.parse_size("2t") == 2 << 40
    with pytest.raises(argparse.ArgumentTypeError, match="too large"):
        allreduce.parse_size("99999999999999999999")
    with pytest.raises(SystemExit) as stop:
        _parser().parse_args(["-b", "99999999999999999999", "-e", "99999999999999999999"])
    assert stop.value.code == 2
    assert "-b/--minbytes: 99999999999999999999 is too large (at most 1024T)" \
        in capsys.readouterr().err


def test_a_size_beyond_memory_is_refused_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(allreduce.machine, "physical_memory", lambda: 16 << 30)
    args = _parser().parse_args(["-b", "1024G", "-e", "1024G"])
    with pytest.raises(BenchUsageError) as refused:
        allreduce.run(args)
    message = str(refused.value)
    assert message.startswith("-e/--maxbytes 1024 GiB: ") and "16.0 GiB of memory" in message
    assert "lower -e" in message and capsys.readouterr().out == ""
    # The largest size measured, not -e: -b 8 -e 1000G -f 2 stops at 512 GiB.
    assert "-e/--maxbytes 512 GiB: 2 ranks need about 2048.0 GiB" in \
        allreduce.memory_problem(512 << 30, 4, False, 2, 16 << 30)
    assert allreduce.memory_problem(64 << 20, 4, True, 2, 16 << 30) is None
    assert allreduce.memory_problem(1 << 40, 4, False, 1, None) is None  # unknown: no refusal


# 6. The plot's title ran off both sides of the figure.

def test_plot_title_fits_the_figure(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure to look at
    rows = [{"algorithm": name, "bytes": b, "avg_us": 2.0, "busbw_gbps": 0.5}
            for name in ("ring", "native") for b in (8, 16)]
    title = ("all-reduce, 2 ranks (2 cores, auto's placement 'pair'), AMD EPYC (sse4_2, avx, "
             "avx2, fma, avx512f, avx512dq, avx512bw, avx512vl), 2 cores, vm; MPICH Version:   "
             "   5.0.2, MPI thread level funneled")
    report.plot(rows, str(tmp_path / "p.png"), title, ceiling=10.0)
    (fig,) = kept
    text = fig._suptitle
    assert "\n" in text.get_text() and "MPI thread level funneled" in text.get_text()
    box = text.get_window_extent(fig.canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height
    close(fig)


# 7. "no /proc/stat" where /proc/stat was there but each size was shorter than a clock tick.

def test_steal_footer_says_too_short_where_proc_stat_exists():
    unmeasured = [{"bytes": 8, "steal_pct": None}, {"bytes": 16, "steal_pct": None}]
    line = report.steal_line(0.5, unmeasured, proc_stat=True)
    assert "0.5% over the run" in line and "each size was too short" in line
    assert "no /proc/stat" not in line
    line = report.steal_line(None, unmeasured, proc_stat=True)
    assert "not measured, the run was too short" in line and "no /proc/stat" not in line
    assert report.steal_line(None, unmeasured, proc_stat=False) == \
        "# host steal time: not measurable here (no /proc/stat)"


@pytest.mark.mpi(min_size=1)
def test_footers_of_a_short_run_give_the_true_reasons(comm, capsys):
    """The tester's run: 8 B to 16 B, 3 iterations, one round."""
    from collectives.core.plans import comm_state

    args = _parser().parse_args(["-b", "8", "-e", "16", "-i", "3", "-w", "1", "--rounds", "1",
                                 "-a", "ring,native"])
    assert allreduce.run(args) == 0
    if comm.Get_rank() != 0:
        return
    out = capsys.readouterr().out
    steal = next(line for line in out.splitlines() if line.startswith("# host steal time"))
    assert ("no /proc/stat" in steal) == (measure.cpu_ticks() is None)
    xcore = next(line for line in out.splitlines() if line.startswith("# core-to-core copy"))
    if comm.Get_size() == 1:
        assert xcore.endswith("not measured (one rank)")
    elif not comm_state(comm).oversubscribed:  # ranks 0 and 1 of one machine
        assert "GB/s" in xcore and "not measured" not in xcore


def test_outputs_that_are_devices_pipes_or_directories_are_refused(tmp_path):
    """The rule of every other mpidp output (engine.outputs): --json /dev/null
    would be renamed over the device (as root, replacing it)."""
    import os

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    assert allreduce.check_output(os.devnull, "--json") == (
        f"--json {os.devnull}: is a character device, not a file; the output is written "
        "under a temporary name and renamed over the path, which would replace it: give a "
        "file name")
    assert allreduce.check_output(str(fifo), "--plot").startswith(
        f"--plot {fifo}: is a named pipe (FIFO), not a file; the output is written")
    assert allreduce.check_output(str(tmp_path), "--json") == \
        f"--json {tmp_path}: is a directory; give a file name"
    assert allreduce.check_output("new/", "--json") == \
        "--json new/: names a directory (ends with /); give a file name"
    assert allreduce.check_output(str(tmp_path / "r.json"), "--json") is None

