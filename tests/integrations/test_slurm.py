"""A real single-node Slurm (Debian's slurm-wlm and munge, started here as
root): srun and sbatch with what ``cpupin plan --emit slurm`` prints, each
rank running ``cpupin verify``."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.helpers import run

CPUPIN = str(Path(sys.executable).with_name("cpupin"))
DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch")


def _missing():
    if os.geteuid() != 0:
        return "runs slurmd and munged as root"
    if not sys.platform.startswith("linux"):
        return "Linux only"
    lost = [d for d in DAEMONS if not shutil.which(d, path="/usr/sbin:/usr/bin:/sbin:/bin")]
    if lost:
        return f"{', '.join(lost)} not installed (apt-get install slurm-wlm munge; .ci/run does)"
    if len(os.sched_getaffinity(0)) < 2:
        return "needs two CPUs: a rank on each"
    return None


pytestmark = [
    pytest.mark.skipif(_missing() is not None, reason=str(_missing())),
    pytest.mark.xdist_group("slurm"),
]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _munge_works():
    out = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, timeout=30)
    return out.returncode == 0


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A cluster of this machine alone: its own state, spool and ports."""
    root = tmp_path_factory.mktemp("slurm")
    (root / "state").mkdir()
    (root / "spool").mkdir()
    if not _munge_works():
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        # (one that another run started a moment ago refuses to start twice)
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], timeout=30, check=False)
        deadline = time.monotonic() + 30
        while not _munge_works():
            assert time.monotonic() < deadline, "munged did not start"
            time.sleep(0.2)
    host = socket.gethostname().split(".")[0]
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60, check=True)
    shape = node.stdout.splitlines()[0].split(None, 1)[1]  # CPUs=... after NodeName=
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=cpupin
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 {shape}
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in [n for n in env if n.startswith("SLURM_") and n != "SLURM_CONF"]:
        env.pop(name)
    daemons = [
        subprocess.Popen([d, "-D"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for d in ("slurmctld", "slurmd")
    ]
    try:
        deadline = time.monotonic() + 60
        while True:
            out = run(["sinfo", "-h", "-o", "%T"], env=env, timeout=30)
            if out.returncode == 0 and out.stdout.strip() == "idle":
                break
            assert time.monotonic() < deadline, (out.stdout, out.stderr, _logs(root))
            time.sleep(0.3)
        yield env, root
    finally:
        for proc in daemons:
            proc.terminate()
        for proc in daemons:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _logs(root):
    return "".join(p.read_text(errors="replace")[-2000:] for p in root.glob("*.log") if p.is_file())


def emit(env, *argv):
    out = run([CPUPIN, "plan", "--emit", "slurm", *argv], env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def srun(env, root, *argv):
    return run(["srun", *argv], env={**env, "PWD": str(root)}, timeout=120)


def test_srun_with_the_emitted_options_puts_each_rank_on_its_cpus(slurm):
    env, root = slurm
    opts = emit(env, "--ranks", "2", "--node", "0").split()
    assert any(o.startswith("--cpu-bind=mask_cpu:") for o in opts)
    out = srun(env, root, *opts, CPUPIN, "verify", "--ranks", "2", "--node", "0")
    assert out.returncode == 0, out.stdout + out.stderr + _logs(root)
    lines = sorted(out.stdout.splitlines())
    assert len(lines) == 2 and all(" as planned " in line for line in lines), lines
    assert lines[0].startswith("rank 0: CPU ") and lines[1].startswith("rank 1: CPU ")
    assert lines[0].split()[3] != lines[1].split()[3]  # each rank its own CPU


def test_a_wrong_binding_is_named_by_rank_and_by_slurms_option(slurm):
    env, root = slurm
    first = min(os.sched_getaffinity(0))
    opts = [
        f"--cpu-bind=map_cpu:{first},{first}" if o.startswith("--cpu-bind=") else o
        for o in emit(env, "--ranks", "2", "--node", "0").split()
    ]
    out = srun(env, root, *opts, CPUPIN, "verify", "--ranks", "2", "--node", "0")
    assert out.returncode != 0
    wrong = [line for line in out.stdout.splitlines() if "plan wants" in line]
    assert len(wrong) == 1 and wrong[0].startswith("rank 1: "), out.stdout
    assert wrong[0].endswith(f"launched with --cpu-bind=map_cpu:{first},{first}?"), wrong


def test_sbatch_with_the_emitted_lines_runs_each_rank_where_planned(slurm):
    env, root = slurm
    header = emit(env, "--ranks", "2", "--node", "0", "--batch")
    assert header.startswith("#SBATCH ") and "export SLURM_CPU_BIND=mask_cpu:" in header
    script = root / "job.sh"
    script.write_text(f"#!/bin/bash\n{header}srun {CPUPIN} verify --ranks 2 --node 0\n")
    log = root / "job.out"
    out = run(["sbatch", "-W", "-o", str(log), str(script)], env=env, timeout=180)
    assert out.returncode == 0, out.stderr + log.read_text(errors="replace")
    lines = sorted(line for line in log.read_text().splitlines() if line.startswith("rank "))
    assert len(lines) == 2 and all(" as planned " in line for line in lines), lines


def test_inside_an_allocation_smaller_than_the_node_the_plan_stays_within_it(slurm):
    env, root = slurm
    script = root / "small.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"opts=$({CPUPIN} plan --emit slurm --ranks 1 --node 0) || exit 9\n"
        'echo "opts $opts"\n'
        f"srun $opts {CPUPIN} verify --ranks 1 --node 0\n"
    )
    log = root / "small.out"
    out = run(["sbatch", "-n1", "-c1", "-W", "-o", str(log), str(script)], env=env, timeout=180)
    text = log.read_text(errors="replace")
    assert out.returncode == 0, out.stderr + text
    (opts,) = [line for line in text.splitlines() if line.startswith("opts ")]
    assert "--exclusive" not in opts and "CPUPIN_PLAN_MASK=" in opts
    (line,) = [line for line in text.splitlines() if line.startswith("rank 0: ")]
    assert " as planned " in line and "within " in line, text
