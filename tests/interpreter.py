"""Run kernel checks under Triton's CPU interpreter, in a fresh Python (the switch must be set before
triton is imported, so it cannot be flipped inside the test process)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A kernel test module's run_all('cpu') and run_model(tiny model dir), the pattern of the decode kernels.
KERNEL_AND_HOOK = """
import sys, tempfile, pathlib
from tests.conftest import make_model_dir
from tests.{module} import run_all, run_model
run_all('cpu')
run_model(str(make_model_dir(pathlib.Path(tempfile.mkdtemp(dir=sys.argv[1])) / 'tiny', seed=0, mtp=False)))
"""


def run_interpreted(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
