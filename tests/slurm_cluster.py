"""A throw-away Slurm cluster on localhost, for testing the `jobs/` scripts.

Two ``slurmd`` daemons on different ports emulate a two-node cluster on this
one machine; ``slurmctld`` and a private ``munged`` complete it. No cgroups,
no systemd, nothing under /etc is touched: configuration, keys, state and
logs live in one temporary directory. Needs root (``SlurmUser=root``) and the
Debian packages slurmctld, slurmd, slurm-client and munge.

Traps handled here (measured on these machines):

* ``sbatch --wait`` reports 0 for a job cancelled while pending, and a killed
  ``sbatch --wait`` leaves the job running: jobs are polled with
  ``scontrol`` and cancelled on timeout.
* A requeued job is held for the credential lifetime (``cred_expire``,
  120 s by default; releasing it earlier fails its launch with "Job
  credential revoked"): this cluster sets it to 5 s.
* MPICH names its shared-memory segment after the job and step id, and a
  fresh cluster numbers jobs from 1 again: every cluster starts at a
  different ``FirstJobId``.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing_binaries() -> list[str]:
    """Slurm/munge programs this machine lacks (empty when all are present)."""
    wanted = ["sbatch", "scontrol", "sinfo", "squeue", "scancel", "srun", *DAEMONS]
    found = {name: shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
             for name in wanted}
    return [name for name, path in found.items() if path is None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") or name


@dataclass
class JobResult:
    """The end of a batch job: its Slurm state and the script's exit code."""

    job_id: str
    state: str
    exit_code: int
    output: str

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == 0


class SlurmCluster:
    """Start with :meth:`start`, submit with :meth:`submit`, end with :meth:`stop`."""

    def __init__(self, root: Path, nodes: int = 2, cpus_per_node: int = 4):
        self.root = Path(root)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus_per_node
        self.processes: list[subprocess.Popen] = []
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"

    # -- set-up --------------------------------------------------------------
    def _write_config(self) -> None:
        host = socket.gethostname().split(".")[0]
        for sub in ("state", "munge", "log", "run", *[f"spool/{n}" for n in self.nodes]):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        lines = [
            "ClusterName=mpidptest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge",
            # cred_expire: a requeued job waits this long (+1 s) before it may
            # start again on a node that revoked its credential (default 120 s).
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "SlurmUser=root", "SlurmdUser=root",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            # A requeued job waits for the next periodic scheduling pass (main
            # loop every 60 s, backfill every 30 s by default): here every 2 s.
            "SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2",
            "MinJobAge=600", "EnforcePartLimits=ALL", "ReturnToService=2",
            "MpiDefault=none", "KillWait=5", "InactiveLimit=0",
            f"FirstJobId={random.randint(1000, 900000)}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",
            f"SlurmctldPidFile={self.root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd-%n.log'}",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 "
                         f"Port={_free_port()} CPUs={self.cpus} RealMemory=2000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "OverSubscribe=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for Slurm client commands against this cluster."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "PMI_", "MPI_LOCAL", "OMPI_", "HYDRA_"))}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def _spawn(self, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{Path(argv[0]).name}-{len(self.processes)}.out", "w")
        self.processes.append(subprocess.Popen(argv, env=self.env(), stdout=log,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True))

    def start(self, timeout: float = 30) -> "SlurmCluster":
        """Start munged, slurmctld and one slurmd per node; wait until idle."""
        self._write_config()
        self._spawn([_binary("munged"), "--foreground", "--force",
                     f"--socket={self.munge_socket}",
                     f"--key-file={self.root / 'munge' / 'munge.key'}",
                     f"--pid-file={self.root / 'run' / 'munged.pid'}",
                     f"--seed-file={self.root / 'munge' / 'seed'}",
                     f"--log-file={self.root / 'log' / 'munged.log'}"])
        deadline = time.monotonic() + timeout
        while not self.munge_socket.exists():
            self._check_alive(deadline, "munged")
        self._spawn([_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn([_binary("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        while True:
            states = self._node_states()
            if states and all(s.startswith("idle") for s in states):
                return self
            self._check_alive(deadline, f"nodes to become idle (states: {states})")

    def _check_alive(self, deadline: float, waiting_for: str) -> None:
        for proc in self.processes:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} while "
                                   f"waiting for {waiting_for}; logs in {self.root / 'log'}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {waiting_for}; logs in "
                               f"{self.root / 'log'}")
        time.sleep(0.1)

    def _node_states(self) -> list[str]:
        result = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env(),
                                capture_output=True, text=True)
        return result.stdout.split() if result.returncode == 0 else []

    def stop(self) -> None:
        """Cancel every job and wait for its processes, then stop the daemons
        (idempotent)."""
        if self.processes:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env(),
                           capture_output=True)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                queue = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(),
                                       capture_output=True, text=True)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.2)
        for proc in reversed(self.processes):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.processes = []

    # -- jobs ------------------------------------------------------------------
    def submit(self, script: str | Path, *sbatch_args: str, env: dict | None = None,
               cwd: str | Path | None = None) -> str:
        """``sbatch --parsable``; returns the job id."""
        result = subprocess.run(["sbatch", "--parsable", *sbatch_args, str(script)],
                                env=self.env(**(env or {})), capture_output=True,
                                text=True, cwd=cwd)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def job_fields(self, job_id: str) -> dict[str, str]:
        result = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env(),
                                capture_output=True, text=True)
        fields = {}
        for token in result.stdout.split():
            key, _, value = token.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait(self, job_id: str, timeout: float = 180) -> JobResult:
        """Poll until the job ends; cancel it and raise TimeoutError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job_fields(job_id)
            state = fields.get("JobState", "UNKNOWN")
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING",
                             "REQUEUED", "SUSPENDED", "UNKNOWN"):
                code = int(fields.get("ExitCode", "0:0").split(":")[0])
                out = Path(fields.get("StdOut", ""))
                text = out.read_text(errors="replace") if out.is_file() else ""
                return JobResult(job_id, state, code, text)
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env(), capture_output=True)
                raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s "
                                   "(cancelled)")
            time.sleep(0.2)

    def run(self, script: str | Path, *sbatch_args: str, env: dict | None = None,
            cwd: str | Path | None = None, timeout: float = 180) -> JobResult:
        """Submit and wait."""
        return self.wait(self.submit(script, *sbatch_args, env=env, cwd=cwd), timeout)


def started_cluster(directory: Path) -> Iterator[SlurmCluster]:
    """A running two-node cluster in ``directory``, stopped afterwards; for a
    fixture to ``yield from``. Skips the test without Slurm or root, and fails
    it instead when ``MPIDP_REQUIRE_SLURM=1`` (CI)."""
    import pytest

    missing = missing_binaries()
    reason = None
    if missing:
        reason = (f"Slurm is not installed (missing: {', '.join(missing)}); install "
                  "slurmctld slurmd slurm-client munge (Debian) to run these tests")
    elif os.geteuid() != 0:
        reason = "the test cluster runs its daemons as root (SlurmUser=root)"
    if reason:
        if os.environ.get("MPIDP_REQUIRE_SLURM") == "1":
            pytest.fail(reason + " [MPIDP_REQUIRE_SLURM=1]")
        pytest.skip(reason)
    slurm = SlurmCluster(directory, nodes=2, cpus_per_node=4)
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()


# -- a fake Slurm, for the scripts' own logic in a second --------------------

#: Programs a job script calls, as small bash scripts. Each logs its words to
#: $FAKE_LOG. sbatch runs the job at once (a copy of the script, as Slurm runs
#: one, with SLURM_JOB_ID, SLURM_SUBMIT_DIR, SLURM_NTASKS, SLURM_JOB_NUM_NODES);
#: srun drops its options and runs the rest (a bash -c step is only logged, or
#: sends $FAKE_STEP_SIGNAL to the batch shell: a signal during it); mpiexec
#: drops its -n N and runs the rest; squeue answers the time left
#: ($FAKE_TIME_LEFT, default UNLIMITED) and an empty queue; scontrol shows a
#: RUNNING job and accepts a requeue. mpidp: `train` appends a record to its
#: --metrics file, then exits $FAKE_MPIDP_EXIT (default 0; only where its
#: words hold $FAKE_MPIDP_EXIT_WHERE, when that is set), or with
#: FAKE_MPIDP_WAIT=1 waits up to 20 s for SIGUSR1 and exits 75 as mpidp does;
#: `bench scaling --collect` prints the directories it was given.
FAKE_PROGRAMS = {
    "sbatch": r'''
echo "sbatch $*" >> "$FAKE_LOG"
out="slurm-%j.out"; ntasks=1; nodes=1
for arg in "$@"; do
    case "$arg" in
        --output=*) out="${arg#--output=}" ;;
        --ntasks=*) ntasks="${arg#--ntasks=}" ;;
        --nodes=*) nodes="${arg#--nodes=}" ;;
    esac
done
script="${!#}"
id=$(( $(cat "$FAKE_SLURM_DIR/last-id" 2>/dev/null || echo 100) + 1 ))
echo "$id" > "$FAKE_SLURM_DIR/last-id"
spool="$FAKE_SLURM_DIR/spool/job$id"
mkdir -p "$spool" && cp "$script" "$spool/slurm_script"
SLURM_JOB_ID=$id SLURM_SUBMIT_DIR="$PWD" SLURM_NTASKS=$ntasks SLURM_JOB_NUM_NODES=$nodes \
    bash "$spool/slurm_script" > "${out//%j/$id}" 2>&1
echo "$id"
''',
    "srun": r'''
echo "srun $*" >> "$FAKE_LOG"
while [[ "${1:-}" == -* ]]; do shift; done
if [ "$1" = bash ]; then   # a step of the script's own (the /dev/shm cleanup): logged only,
    [ -n "${FAKE_STEP_SIGNAL:-}" ] && kill -s "$FAKE_STEP_SIGNAL" "$PPID"   # or a signal during it
    exit 0
fi
exec "$@"
''',
    "mpiexec": r'''
echo "mpiexec $*" >> "$FAKE_LOG"
[ "$1" = -n ] && shift 2
exec "$@"
''',
    "squeue": r'''
case "$*" in *%L*) echo "${FAKE_TIME_LEFT:-UNLIMITED}" ;; esac
''',
    "scontrol": r'''
echo "scontrol $*" >> "$FAKE_LOG"
case "$1" in show) echo "JobId=${!#} JobState=RUNNING Reason=None" ;; esac
''',
    "mpidp": r'''
echo "mpidp $*" >> "$FAKE_LOG"
if [ "$1 $2 ${3:-}" = "bench scaling --collect" ]; then echo "collected ${*:4}"; exit 0; fi
[ "$1" = train ] || exit 0
code="${FAKE_MPIDP_EXIT:-0}"
[[ "$*" == *"${FAKE_MPIDP_EXIT_WHERE:-}"* ]] || code=0
metrics=""
while [ $# -gt 0 ]; do [ "$1" = --metrics ] && metrics="$2"; shift; done
if [ "${FAKE_MPIDP_WAIT:-0}" = 1 ]; then
    trap 'echo "mpidp: got SIGUSR1" >> "$FAKE_LOG"; exit 75' USR1
    for _ in $(seq 200); do sleep 0.1; done
    exit 1
fi
[ -n "$metrics" ] && echo '{"epoch": 1}' >> "$metrics"
exit "$code"
''',
}


def fake_slurm(directory: Path) -> dict[str, str]:
    """Write the FAKE_PROGRAMS into ``directory/bin`` and a fake virtualenv
    (``directory/venv``, whose activate puts them first on PATH); returns the
    environment for a job script or jobs/sweep_scaling.sh run against them:
    this process's, less Slurm's own variables, with MPIDP_VENV, FAKE_LOG
    (``directory/log``) and FAKE_SLURM_DIR set."""
    directory = Path(directory)
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in FAKE_PROGRAMS.items():
        program = bin_dir / name
        program.write_text("#!/bin/bash\n" + body.lstrip("\n"))
        program.chmod(0o755)
    venv = directory / "venv" / "bin"
    venv.mkdir(parents=True, exist_ok=True)
    (venv / "activate").write_text(f'PATH="{bin_dir}:$PATH"; export PATH\n')
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "MPIDP_", "DATA", "OUT_DIR", "TRAIN_ARGS",
                                "BENCH_ARGS", "TUNE_ARGS", "INPUTS", "JOBS_DIR"))}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", MPIDP_VENV=str(directory / "venv"),
               FAKE_LOG=str(directory / "log"), FAKE_SLURM_DIR=str(directory))
    return env
