"""benchmarks/readme_results.py rewrites a document whole or not at all: a write that fails part-way
(a full disk) leaves the document as it was and is one line, exit 1. It wrote the document in place,
so the failure left it cut off mid-table, and the OSError was a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import readme_results as rr  # noqa: E402

STALE = "# Doc\n\n<!-- results:sim-speed -->\nstale figures\n<!-- /results:sim-speed -->\n\nThe end.\n"


#: Runs readme_results.main on DOC alone, with files limited to LIMIT bytes (RLIMIT_FSIZE: a write past
#: it fails with EFBIG, as on a full disk; Python ignores SIGXFSZ), whatever the writer's internals.
_LIMITED = """
import resource, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import readme_results as rr
doc = Path(sys.argv[2])
rr.ROOT, rr.documents = doc.parent, lambda: [doc]
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))
sys.exit(rr.main([]))
"""


def test_a_write_that_fails_part_way_leaves_the_document_whole(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(STALE, encoding="utf-8")
    limit = len(STALE.encode()) + 40  # the new block is longer: its write fails part-way
    r = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(ROOT / "benchmarks"), str(doc), str(limit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert doc.read_text(encoding="utf-8") == STALE
    assert r.returncode == 1, r.stderr
    assert r.stderr == "error: doc.md: File too large\n"
    assert [p.name for p in tmp_path.iterdir()] == ["doc.md"]  # no NAME.tmp left beside it


def test_a_stale_block_is_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(STALE, encoding="utf-8")
    monkeypatch.setattr(rr, "ROOT", tmp_path)
    monkeypatch.setattr(rr, "documents", lambda: [doc])
    assert rr.main([]) == 0
    text = doc.read_text(encoding="utf-8")
    assert "stale figures" not in text and "request-steps/s" in text and text.endswith("The end.\n")
