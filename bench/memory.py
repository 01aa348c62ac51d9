"""Case 5, memory: peak RSS of the real command line planning and draining one large batch.

Exactly what an operator runs, each in its own process:

    hail-guard batch plan leads.jsonl        (N sends, JSON Lines)
    hail-guard batch run BATCH --concurrency 32

with a SQLite ledger and the sandbox as upstream in a process of its own (`bench.stdio_sandbox`
over stdio), so the fake Hail's memory is not counted. The peak is the process's VmHWM, read from
/proc while it runs. The baseline is the same two commands for a batch of one send.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.figures import Figure
from bench.workload import lead_email

TARGET_MB = 150.0
REPO = Path(__file__).resolve().parent.parent
POLL_SECONDS = 0.02


@dataclass(frozen=True)
class Peak:
    megabytes: float
    seconds: float
    stdout: str


def watch(command: list[str], env: dict[str, str]) -> Peak:
    """Run `command` to the end, reading its VmHWM from /proc as it goes."""
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.DEVNULL)
        peak_kb = 0
        while process.poll() is None:
            peak_kb = max(peak_kb, _high_water_kb(process.pid))
            time.sleep(POLL_SECONDS)
        seconds = time.perf_counter() - started
        out.seek(0)
        stdout = out.read().decode()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[2:])} exited {process.returncode}: {stdout[-500:]}")
    return Peak(peak_kb / 1024, seconds, stdout)


def _high_water_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def plan_and_run(folder: Path, sends: int, concurrency: int) -> tuple[Peak, Peak]:
    work = Path(tempfile.mkdtemp(prefix=f"memory-{sends}-", dir=folder))
    leads = work / "leads.jsonl"
    with leads.open("w", encoding="utf-8") as file:
        for n in range(sends):
            file.write(json.dumps({"tool": "send_email", "arguments": lead_email(n, "mem")}) + "\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("HAIL_GUARD_")}
    env |= {
        "HAIL_GUARD_LEDGER_URL": f"sqlite:///{work / 'ledger.db'}",
        "HAIL_GUARD_UPSTREAM_COMMAND": f"{sys.executable} -m bench.stdio_sandbox",
        "PYTHONPATH": str(REPO),
    }
    hail_guard = [sys.executable, "-m", "hail_guard"]
    plan = watch([*hail_guard, "batch", "plan", str(leads), "--name", "bench"], env)
    batch_id = json.loads(plan.stdout)["batch_id"]
    run = watch([*hail_guard, "batch", "run", batch_id, "--concurrency", str(concurrency)], env)
    return plan, run


def measure(folder: Path, sends: int, concurrency: int) -> list[Figure]:
    base_plan, base_run = plan_and_run(folder, 1, concurrency)
    plan, run = plan_and_run(folder, sends, concurrency)
    result = []
    for what, peak, base in (("batch plan", plan, base_plan), ("batch run", run, base_run)):
        per_send_kb = (peak.megabytes - base.megabytes) * 1024 / sends
        result.append(
            Figure(
                case="memory",
                name=f"{what}, {sends:,} sends: peak RSS",
                unit="MB",
                median=peak.megabytes,
                baseline=base.megabytes,
                ratio=peak.megabytes / base.megabytes,
                target=f"<= {TARGET_MB:g} MB",
                met=peak.megabytes <= TARGET_MB,
                note=f"~{per_send_kb:.1f} KB per send over a 1-send batch; took {peak.seconds:.1f} s",
            )
        )
    return result
