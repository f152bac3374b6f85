"""tsgen without torch: torch is an optional extra (`pip install ".[torch]"`). Runs with or
without torch installed (a subprocess hides it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_tsgen_without_torch():
    """tsgen, its CLI and runtime import with torch unavailable; tsgen.torch says what to install."""
    code = (
        "import sys; sys.modules['torch'] = None\n"  # `import torch` raises ImportError from here on
        "import tsgen, tsgen.cli, tsgen.runtime, tsgen.manifest, tsgen.harness\n"
        "try:\n"
        "    import tsgen.torch\n"
        "except ImportError as e:\n"
        "    print('REFUSED', e)\n"
        "else:\n"
        "    print('IMPORTED')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED" in proc.stdout and "pip install '.[torch]'" in proc.stdout, proc.stdout
