"""The seed workload's training runs of tools/gpu_check.sh (step train), as one JSON file.

Reads the per-epoch metrics of the four runs (/tmp/mpidp-gpu-<run>.jsonl),
prints each epoch's seconds and phases, and writes $OUT/train_seed_workload.json
(command, date, GPU, machine, code, runs) for tools/gpu_tables.py.
"""
import datetime, json, os, subprocess
import torch
from collectives import machine
runs = {}
for name in ("cuda_graph", "cuda_eager", "cuda_nodp", "cpu"):
    runs[name] = []
    for line in open(f"/tmp/mpidp-gpu-{name}.jsonl"):
        r = json.loads(line)
        phases = {k[:-2]: round(v, 3) for k, v in r["step_breakdown_s"].items()}
        runs[name].append({"epoch": r["epoch"], "epoch_time_s": round(r["epoch_time_s"], 3),
                           "phases_s": phases})
        print(f"epoch {name} {r['epoch']}: {r['epoch_time_s']:.3f} s "
              + " ".join(f"{k} {v:.3f}" for k, v in phases.items()))
commit = os.environ.get("GPU_CHECK_COMMIT") or subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
record = {
    "command": "mpiexec -n 1 mpidp train --data seed.h5 (790,000 synthetic rows, 100 features, "
               "MLP 100-128-128-2, batch 256) --target-epsilon 1 --delta 1e-6 --seed 0, "
               "--device cuda [--cuda-graph off | --no-dp] or --device cpu (1 rank x all "
               "threads) (tools/gpu_check.sh, step train)",
    "date": datetime.date.today().isoformat(),
    "device": f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})",
    "machine": machine.describe(), "code": commit or "unknown", "runs": runs}
with open(os.path.join(os.environ["OUT"], "train_seed_workload.json"), "w") as f:
    json.dump(record, f, indent=1)
