"""What every benchmark script must do with a mistaken command line: exit 2 and say what, no traceback."""

import subprocess
import sys
from pathlib import Path


def assert_usage_error(script: Path, args: list[str], says: str) -> None:
    r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert says in r.stderr
    assert "Traceback" not in r.stderr
