"""The probe that ``benchmarks.overhead_ab`` installs in both trees it compares: it counts
every action a step loop launches and the CPU time of the decision region, and writes them
when a step ends (in a process of its own: it patches ``StepLoop``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STEP = """
import json
from rrfp.core.hints import build_hint
from rrfp.sim.engine import simulate
hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4)
result = simulate(hint, lambda action: 1.0, policy="hint")
print(json.dumps(sum(len(actions) for actions in result.realized.values())))
"""


def test_the_probe_counts_every_launch_and_the_decision_cpu(tmp_path):
    site, out = tmp_path / "site", tmp_path / "out"
    site.mkdir()
    out.mkdir()
    shutil.copy(ROOT / "benchmarks" / "overhead_probe.py", site / "sitecustomize.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(site), str(ROOT))),
           "RRFP_PROBE_DIR": str(out)}
    done = subprocess.run([sys.executable, "-c", STEP], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    launched = json.loads(done.stdout.strip().splitlines()[-1])
    (written,) = list(out.iterdir())
    totals = json.loads(written.read_text())
    assert totals["launches"] == launched > 0
    assert totals["cpu_s"] > 0
