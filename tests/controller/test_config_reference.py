"""docs/config.md is generated from SidecarConfig and kept up to date; it names every key."""

from dataclasses import fields
from pathlib import Path

from controller.cli import main
from controller.config import SidecarConfig
from controller.config_reference import field_comments, field_ranges, reference_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_committed_reference_is_up_to_date() -> None:
    assert DOC.read_text() == reference_markdown(), (
        "docs/config.md is stale: run controllerctl config reference --out docs/config.md"
    )


def test_every_key_is_described_with_its_default_and_range() -> None:
    text = reference_markdown()
    rows = {
        line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")
    }
    assert list(rows) == [f.name for f in fields(SidecarConfig)]
    assert '| `admin_listen` | str | `"127.0.0.1:50062"` |' in rows["admin_listen"]
    assert "131,072..268,435,456" in rows["max_message_bytes"]  # 256 * 1024 * 1024, read from the check
    assert "`0600` (octal)" in rows["engine_socket_mode"]
    # Every key has a comment of its own or shares the one above its group.
    assert all(not line.rstrip().endswith("| - |") for line in rows.values())


def test_comments_and_ranges_come_from_the_code() -> None:
    comments = field_comments(SidecarConfig)
    assert comments["snapshot_interval_s"].startswith("Seconds between periodic snapshots")
    assert comments["engine_tls_key_file"] == ""  # covered by the comment above engine_tls_cert_file
    assert field_ranges(SidecarConfig)["decision_tick_s"] == "0.005..60"


def test_cli_writes_the_reference(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "config.md"
    assert main(["config", "reference", "--out", str(out)]) == 0
    assert out.read_text() == reference_markdown()
    # a pod's config: its token is a mounted secret, not on this machine
    assert main(["config", "validate", "deploy/base/sidecar.yaml"]) == 2
    assert main(["config", "validate", "--no-files", "deploy/base/sidecar.yaml"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("OK deploy/base/sidecar.yaml")


def test_the_reference_replaces_a_file_whole(tmp_path: Path) -> None:
    # A reader holding the old file (an editor, `git diff` mid-run) sees it whole, never a truncated
    # or half-written one: the new text is a new file renamed over the old.
    out = tmp_path / "config.md"
    out.write_text("old reference\n")
    with out.open() as reader:
        assert main(["config", "reference", "--out", str(out)]) == 0
        assert reader.read() == "old reference\n"
    assert out.read_text() == reference_markdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.md"]
