"""Scaling tables on fixed inputs: summaries, speed-ups, cost, table, JSON, --collect."""
import json

import pytest

from engine.bench import scaling_report as report
from engine.bench.scaling_plan import BenchError, parse_ints, parse_lr


def _epochs(times, comm=0.1, accuracies=None, eps=None, threads=1):
    out, total = [], 0.0
    for i, t in enumerate(times):
        total += t
        record = {"epoch": i + 1, "epoch_time_s": t, "train_time_s": total, "comm_s": comm,
                  "compute_s": t - comm, "examples_per_s": 1000 / t, "threads": threads,
                  "epsilon": eps, "ranks": 1}
        if accuracies is not None and accuracies[i] is not None:
            record["test_accuracy"] = accuracies[i]
        out.append(record)
    return out


def _run(ranks, times, **kw):
    fields = dict(mode="strong", dp=True, allreduce="auto", threads="auto", ranks=ranks,
                  nodes=1, layout=f"1x{ranks}", batch_size=256, oversubscribed=ranks > 2,
                  command=f"mpiexec -n {ranks} mpidp train ...")
    epoch_kw = {k: kw.pop(k) for k in ("comm", "accuracies", "eps") if k in kw}
    fields.update(kw)
    return dict(fields, epochs=_epochs(times, **epoch_kw))


def test_first_epoch_apart_and_steady_statistics():
    s = report.summarize([_run(1, [5.0, 2.0, 4.0, 3.0], comm=0.5,
                               accuracies=[0.6, None, None, 0.8], eps=1.5)])
    assert s["first_epoch_s"] == 5.0
    assert s["epoch_avg_s"] == pytest.approx(3.0)
    assert (s["epoch_min_s"], s["epoch_max_s"]) == (2.0, 4.0)
    assert s["steady_epochs"] == 3 and not s["steady_is_first_epoch"]
    assert s["comm_s"] == 0.5 and s["compute_s"] == pytest.approx(2.5)
    assert s["comm_compute_ratio"] == pytest.approx(0.2)
    assert s["test_accuracy"] == 0.8 and s["epsilon"] == 1.5
    assert s["train_time_s"] == pytest.approx(14.0)
    assert s["local_batch"] == 256


def test_repeats_pool_steady_epochs_and_take_medians():
    runs = [_run(2, [9.0, 1.0, 3.0], accuracies=[0.5, 0.6, 0.7]),
            _run(2, [7.0, 2.0, 2.0], accuracies=[0.5, 0.6, 0.9]),
            _run(2, [8.0, 5.0, 1.0], accuracies=[0.5, 0.6, 0.8])]
    s = report.summarize(runs)
    assert s["repeats"] == 3
    assert s["epoch_avg_s"] == pytest.approx(14 / 6)
    assert (s["epoch_min_s"], s["epoch_max_s"]) == (1.0, 5.0)
    assert s["first_epoch_s"] == 8.0 and s["test_accuracy"] == 0.8


def test_single_epoch_runs_are_marked():
    s = report.summarize([_run(1, [4.0])])
    assert s["steady_is_first_epoch"] and s["epoch_avg_s"] == 4.0
    assert "runs of one epoch" in report.format_table(report.add_speedups([s]))


def test_time_to_accuracy_and_accuracy_after_time():
    run = _run(1, [2.0, 1.0, 1.0, 1.0], accuracies=[0.70, 0.80, 0.85, 0.90])
    s = report.summarize([run], target_accuracy=0.84, time_budget=3.5)
    assert s["tta_s"] == pytest.approx(4.0) and s["tta_epochs"] == 3
    assert s["tta_reached"] == "1/1"
    assert s["accuracy_after_time"] == 0.80  # epoch 2 ended at 3.0 s, epoch 3 at 4.0 s
    never = report.summarize([run], target_accuracy=0.95, time_budget=1.0)
    assert never["tta_s"] is None and never["accuracy_after_time"] is None


def test_speedups_per_series_against_the_fewest_ranks():
    runs = [_run(1, [9, 4.0]), _run(2, [9, 2.5]), _run(4, [9, 1.6]),
            _run(2, [9, 3.0], dp=False), _run(4, [9, 2.0], dp=False)]
    summaries = report.add_speedups([report.summarize(g) for g in report.group_runs(runs)])
    dp = {s["ranks"]: s for s in summaries if s["dp"]}
    assert dp[1]["speedup"] == 1.0 and dp[1]["efficiency"] == 1.0
    assert dp[2]["speedup"] == pytest.approx(1.6) and dp[2]["efficiency"] == pytest.approx(0.8)
    assert dp[4]["speedup"] == pytest.approx(2.5)
    assert dp[4]["efficiency"] == pytest.approx(0.625)
    nodp = {s["ranks"]: s for s in summaries if not s["dp"]}
    assert nodp[2]["baseline_ranks"] == 2 and nodp[2]["speedup"] == 1.0
    assert nodp[4]["speedup"] == pytest.approx(1.5)
    assert nodp[4]["efficiency"] == pytest.approx(0.75)  # 1.5 x 2 / 4
    text = report.format_table(summaries)
    assert "(speed-up relative to 2 ranks)" in text
    assert "* oversubscribed" in text and "    4*" in text
    lines = [line for line in text.splitlines() if line.strip().startswith(("1 ", "2 ", "4"))]
    assert len({len(line) for line in lines}) == 1  # aligned columns


def test_tta_speedup_and_cost_by_hand():
    runs = [_run(1, [3.0, 3.0, 3.0], accuracies=[0.5, 0.7, 0.9], nodes=1),
            _run(4, [1.0, 1.0, 1.0], accuracies=[0.6, 0.9, 0.9], nodes=2, layout="2x2")]
    summaries = report.add_speedups([report.summarize([r], target_accuracy=0.9)
                                     for r in runs])
    report.add_cost(summaries, price_per_node_hour=36.0)
    one, four = summaries
    assert one["tta_s"] == 9.0 and four["tta_s"] == 2.0
    assert four["tta_speedup"] == pytest.approx(4.5)
    assert one["node_hours"] == pytest.approx(9 / 3600) and one["cost"] == pytest.approx(0.09)
    assert four["node_hours"] == pytest.approx(2 * 3 / 3600)
    assert four["cost"] == pytest.approx(0.06)
    assert four["cost_to_accuracy"] == pytest.approx(2 * 2 / 3600 * 36)
    table = report.format_cost_table(summaries)
    assert "cost at 36 per node-hour" in table and "0.09000" in table and "2x2" in table
    assert report.markdown_table(summaries).count("\n") == 3


def test_summarize_refuses_mixed_configurations():
    with pytest.raises(ValueError):
        report.summarize([_run(1, [1.0]), _run(2, [1.0])])
    with pytest.raises(ValueError):
        report.summarize([dict(_run(1, [1.0]), epochs=[])])


def test_option_parsing():
    assert parse_lr("0.05", [1, 2]) == {1: 0.05, 2: 0.05}
    assert parse_lr("1:200,2:400,4:600", [1, 4]) == {1: 200.0, 4: 600.0}
    with pytest.raises(BenchError, match=r"no learning rate for \[2\]"):
        parse_lr("1:200,4:600", [1, 2])
    with pytest.raises(BenchError, match="RANKS:LR"):
        parse_lr("1:x", [1])
    assert parse_ints("4,1,2,2", "--ranks") == [1, 2, 4]
    with pytest.raises(BenchError):
        parse_ints("0,1", "--ranks")


def test_collect_builds_table_json_and_plot(tmp_path, capsys):
    """--collect: the sweep's job directories -> table, JSON and PNG (no MPI launch)."""
    from engine.cli import build_parser

    dirs = []
    for layout, nodes, ranks, t in (("1x1", 1, 1, 4.0), ("2x2", 2, 4, 1.25)):
        d = tmp_path / layout
        d.mkdir()
        epochs = _epochs([t + 1, t, t], eps=0.5, accuracies=[0.7, 0.75, 0.8])
        for e in epochs:
            e["ranks"] = ranks
        (d / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in epochs))
        (d / "sweep-point.json").write_text(json.dumps({
            "layout": layout, "nodes": nodes, "tasks_per_node": ranks // nodes,
            "job_id": "7", "train_args": "--epochs 3 --batch-size 512 --hidden 64,64 "
            "--noise-multiplier 1 --allreduce ring"}))
        dirs.append(str(d))
    out = tmp_path / "s.json"
    plot = tmp_path / "s.png"
    args = build_parser().parse_args(["bench", "scaling", "--collect", *dirs, "--json",
                                      str(out), "--plot", str(plot),
                                      "--price-per-node-hour", "2"])
    assert args._run(args) == 0
    text = capsys.readouterr().out
    assert "strong scaling (global batch 512), DP-SGD, all-reduce ring" in text
    assert "cost at 2 per node-hour" in text
    doc = json.loads(out.read_text())
    four = [s for s in doc["summaries"] if s["ranks"] == 4][0]
    assert four["layout"] == "2x2" and four["nodes"] == 2
    assert four["speedup"] == pytest.approx(3.2) and four["efficiency"] == pytest.approx(0.8)
    assert four["cost"] == pytest.approx(2 * (2.25 + 1.25 + 1.25) / 3600 * 2)
    assert len(doc["runs"]) == 2 and doc["runs"][1]["epochs"][0]["epoch"] == 1
    assert plot.stat().st_size > 10_000
    (tmp_path / "1x1" / "metrics.jsonl").unlink()
    with pytest.raises(BenchError, match="no metrics.jsonl"):
        args._run(args)


def _image_run(ranks, times, impl="mpidp", dp=False, comm=0.1, **kw):
    run = _run(ranks, times, dp=dp, comm=comm or 0.0, model="mnist-small", grid_batch=256,
               data_repeat=1, impl=impl, oversubscribed=False, **kw)
    if comm is None:
        for e in run["epochs"]:
            e["comm_s"] = e["compute_s"] = None
    return run


def test_peers_side_by_side():
    """Each mpidp summary gets its peer's examples/s and the ratio; the peers are
    series of their own (DDP's comm_s is null: it overlaps the backward pass)."""
    runs = [_image_run(1, [3.0, 2.0]), _image_run(2, [3.0, 1.0]),
            _image_run(1, [1.0, 4.0], impl="torch-ddp", comm=None),
            _image_run(2, [1.0, 2.5], impl="torch-ddp", comm=None),
            _image_run(1, [9.0, 8.0], dp=True), _image_run(1, [2.0, 16.0], dp=True,
                                                            impl="opacus-ddp")]
    summaries = report.add_peers(report.add_speedups(
        [report.summarize(g) for g in report.group_runs(runs)]))
    by = {(s["impl"], s["dp"], s["ranks"]): s for s in summaries}
    ddp = by[("torch-ddp", False, 2)]
    assert ddp["comm_s"] is None and ddp["speedup"] == pytest.approx(1.6)
    mine = by[("mpidp", False, 2)]
    assert mine["peer"] == "torch-ddp" and mine["peer_examples_per_s"] == 400.0
    assert mine["vs_peer"] == pytest.approx(1000 / 400)
    assert mine["first_epoch_overhead_s"] == pytest.approx(2.0)
    assert mine["first_examples_per_s"] == pytest.approx(1000 / 3)
    assert by[("mpidp", True, 1)]["vs_peer"] == pytest.approx(2.0)
    assert by[("mpidp", True, 1)]["peer"] == "opacus-ddp"
    assert "vs_peer" not in ddp
    text = report.format_table(summaries)
    assert "mpidp / DDP" in text and "mpidp / Opacus-DDP" in text
    assert "peer: PyTorch DistributedDataParallel: mnist-small, strong scaling" in text
    sweep = report.format_sweep_table(summaries)
    nodp, dp = sweep.split("DP-SGD, strong")[0], sweep.split("DP-SGD, strong")[1]
    assert "mpidp / DDP" in nodp and "mpidp / Opacus-DDP" in dp
    rows = [line for line in nodp.splitlines() if "mnist-small" in line]
    assert len(rows) == 4 and len({len(line) for line in rows}) == 1  # aligned
    assert rows[1].split()[:5] == ["mpidp", "mnist-small", "256", "x1", "2"]
    assert rows[1].split()[-2:] == ["400", "2.50"]  # DDP ex/s, mpidp / DDP
    assert "overhead = 1st - 2nd" in sweep
    # No peers: no peer columns, and the old tables unchanged.
    alone = [report.summarize([r]) for r in runs[:2]]
    report.add_peers(report.add_speedups(alone))
    assert "DDP" not in report.format_table(alone)
    assert "DDP" not in report.format_sweep_table(alone)


def test_collect_refuses_a_job_that_ran_another_layout(tmp_path):
    """A job whose metrics record other ranks than its sweep-point.json's layout
    (nodes x tasks per node) would label its row with a count that never ran."""
    from engine.bench.scaling_runs import collect

    d = tmp_path / "2x2"
    d.mkdir()
    epochs = _epochs([2.0, 1.0])  # ranks 1
    (d / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in epochs))
    (d / "sweep-point.json").write_text(json.dumps({"layout": "2x2", "nodes": 2,
                                                    "tasks_per_node": 2}))
    with pytest.raises(BenchError, match=r"2x2 \(layout 2x2\) ran on 1 rank.s., not the "
                       "planned 4; did its job get the tasks it asked for"):
        collect([str(d)])


def test_the_legend_stays_off_the_other_panels(tmp_path, monkeypatch):
    """--plot: the series' (long) names are in a legend that covers no panel, its
    labels included, and lies inside the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from engine.bench import scaling_plot

    runs = [_run(r, [3.0, 2.0 / r, 2.1 / r], dp=dp, threads=threads, oversubscribed=False)
            for dp in (True, False) for threads in ("auto", "1") for r in (1, 2)]
    summaries = report.add_speedups([report.summarize(g) for g in report.group_runs(runs)])
    figures = []
    save = scaling_plot._save
    monkeypatch.setattr(scaling_plot, "_save",
                        lambda fig, path, title: (save(fig, path, title), figures.append(fig)))
    png = tmp_path / "s.png"
    scaling_plot.plot(summaries, str(png), "mpidp bench scaling on host (2 cores): synth.h5")
    assert png.stat().st_size > 10_000
    fig, = figures
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    legend, = legends
    box = legend.get_window_extent(renderer)
    assert len(legend.get_texts()) == 5  # ideal and the four series
    for ax in fig.axes:
        if legend.axes is not ax:
            assert not box.overlaps(ax.get_tightbbox(renderer)), ax.get_ylabel()
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1
    assert fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
