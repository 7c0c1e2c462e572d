"""The interpreter accepts code the real compiler rejects: compile the select, compact (both phases)
and score kernels (the scorer at the small policy width, head_dim 64) for sm_90 with Triton's bundled ptxas (no
GPU needed) in a fresh process (no TRITON_INTERPRET); ~10 s on a 2-core machine. The full matrix,
reference-size scorer included, is `python benchmarks/compile_check.py` (minutes)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_select_compact_and_score_compile_for_sm90():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_check.py"), "--smoke"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count('"status": "ok"') == 4, r.stdout   # select, compact stage + move, score
    assert '"kernel": "score"' in r.stdout, r.stdout
