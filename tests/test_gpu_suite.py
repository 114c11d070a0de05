"""The GPU tests (tests/gpu) do not run on a CPU, and the CPU suite ignores that folder, so
an import, a fixture or a parametrisation broken there would only show on a GPU machine.
Collecting them here imports every module and expands every parametrisation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_tests_collect_on_a_cpu():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"tests/gpu does not collect:\n{out[-6000:]}"
    found = re.search(r"(\d+) tests? collected", out)
    assert found and int(found.group(1)) > 100, f"unexpected collection:\n{out[-3000:]}"
    # Not a bare "error": test names may hold the word.
    assert "ERROR " not in out and "during collection" not in out, f"collection reported errors:\n{out[-6000:]}"
