"""sim/files.py: whole-file replacement, and failures reported against the path the user gave."""

from __future__ import annotations

import os
import signal
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from sim.files import (
    FileReplacement,
    missing_directory,
    output_problem,
    replace_file,
    save_figure,
    temporary_directory,
)


def test_replaces_the_whole_file_and_leaves_no_sibling(tmp_path: Path) -> None:
    p = tmp_path / "out.json"
    p.write_bytes(b"old, longer than the new content")
    replace_file(p, b"new")
    assert p.read_bytes() == b"new"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.json"]


def test_a_missing_directory_is_reported_against_the_given_path(tmp_path: Path) -> None:
    p = tmp_path / "no" / "such" / "dir" / "t.jsonl"
    with pytest.raises(OSError) as e:
        replace_file(p, b"x")
    assert e.value.filename == str(p)  # not t.jsonl.tmp, which the user never named


def test_a_failed_rename_removes_the_sibling_and_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()  # a directory where the file should go: the rename fails
    (target / "keep").write_bytes(b"1")
    with pytest.raises(OSError) as e:
        replace_file(target, b"x")
    assert e.value.filename == str(target)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["taken"]
    assert (target / "keep").read_bytes() == b"1"


def test_an_interrupted_write_removes_the_sibling_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C while the bytes are written (a plot, a report): NAME.tmp stayed beside the file.
    target = tmp_path / "plot.png"
    target.write_bytes(b"old")

    real_write = FileReplacement.write

    def interrupted(self: FileReplacement, data: bytes) -> None:
        real_write(self, data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(FileReplacement, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        replace_file(target, b"new")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["plot.png"]
    assert target.read_bytes() == b"old"


def test_missing_directory_names_the_directory_a_file_would_go_in(tmp_path: Path) -> None:
    assert missing_directory(tmp_path / "out.json") is None
    assert missing_directory(tmp_path / "a" / "b" / "out.json") == tmp_path / "a" / "b"
    assert missing_directory("relative.json") is None  # the working directory exists


def test_output_problem_is_the_one_message_every_command_gives(tmp_path: Path) -> None:
    assert output_problem("--json", None) is None  # none asked for
    assert output_problem("--json", tmp_path / "r.json") is None
    out = tmp_path / "no" / "r.json"
    assert output_problem("--out", out) == f"--out {out}: no directory {out.parent} to write it in"


@pytest.mark.parametrize(
    ("path", "kw", "says"),
    [
        # '' was ignored (the result went to stdout) or a ValueError traceback ("has an empty name")
        ("", {}, "--out '': not a file name"),
        ("", {"directory": True}, "--out '': not a directory name"),
        ("/", {}, "--out /: is a directory, not a file"),
        ("DIR", {}, "--out DIR: is a directory, not a file"),
        ("DIR/.", {}, "--out DIR/.: is a directory, not a file"),
        ("FILE", {"directory": True}, "--out FILE: is a file, not a directory"),
        ("FILE/x.json", {}, "--out FILE/x.json: no directory FILE to write it in"),
        # a plot's format is its extension: x.xyz failed after the run, and x silently became x.png
        ("DIR/p.xyz", {"suffix": ".png"}, "--out DIR/p.xyz: must name a .png file"),
        ("DIR/p", {"suffix": ".png"}, "--out DIR/p: must name a .png file"),
        ("DIR/p.PNG", {"suffix": ".png"}, None),
        ("DIR", {"directory": True}, None),
        ("DIR/new", {"directory": True}, None),  # made by the command
    ],
)
def test_an_output_that_cannot_be_written_there_is_named_before_the_run(
    tmp_path: Path, path: str, kw: dict[str, object], says: str | None
) -> None:
    (tmp_path / "DIR").mkdir()
    (tmp_path / "FILE").write_text("x")
    full = path.replace("DIR", str(tmp_path / "DIR")).replace("FILE", str(tmp_path / "FILE"))
    got = output_problem("--out", full, **kw)  # type: ignore[arg-type]
    expected = says and says.replace("DIR", str(tmp_path / "DIR")).replace("FILE", str(tmp_path / "FILE"))
    assert got == expected


def test_a_fifo_is_refused_before_the_run_and_never_replaced(tmp_path: Path) -> None:
    """A rename swaps the node itself: run as root, ``--out /dev/full`` replaced the device with a file.
    A FIFO stands in for every non-regular file here (tests must not touch real device nodes)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert (
        output_problem("--out", fifo)
        == f"--out {fifo}: is not a regular file (a device, FIFO or socket): name a file"
    )
    link = tmp_path / "to-fifo"
    link.symlink_to(fifo)
    assert output_problem("--out", link) is not None  # a link to one is the same node
    for p in (fifo, link):
        with pytest.raises(OSError, match="is not a regular file") as e:
            replace_file(p, b"x")
        assert e.value.filename == str(p)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and link.is_symlink()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["fifo", "to-fifo"]
    # An output appended to in place (serve --record-steps, a stream) may be a FIFO.
    assert output_problem("--record-steps", fifo, appended=True) is None


def test_a_symlinked_output_writes_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    target = tmp_path / "d" / "target.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)  # dangling: the target is made
    assert output_problem("--out", link) is None
    replace_file(link, b"first")
    replace_file(link, b"second")  # and replaced again, through the link
    assert link.is_symlink() and target.read_bytes() == b"second"
    assert sorted(x.name for x in (tmp_path / "d").iterdir()) == ["target.json"]


def test_cli_outputs_refuse_a_fifo_and_write_through_a_symlink(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sim.cli import main

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main(["trace", "generate", "--scenario", "chat", "--requests", "3", "--out", str(fifo)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"--out {fifo}: is not a regular file (a device, FIFO or socket): name a file"
    )
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    target = tmp_path / "t.jsonl"
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert main(["trace", "generate", "--scenario", "chat", "--requests", "3", "--out", str(link)]) == 0
    assert link.is_symlink() and target.read_text().startswith('{"spectrace"')


def test_a_figure_replaces_the_file_whole_and_a_failed_one_leaves_it(tmp_path: Path) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    p = tmp_path / "plot.png"
    p.write_bytes(b"old image")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    with p.open("rb") as reader:
        save_figure(fig, p, dpi=50)
        assert reader.read() == b"old image"  # a reader of the old image sees it whole
    assert p.read_bytes().startswith(b"\x89PNG")
    ax.set_title(r"$\frac{$")  # mathtext that fails when drawn
    with pytest.raises(ValueError):
        save_figure(fig, p, dpi=50)
    assert p.read_bytes().startswith(b"\x89PNG")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["plot.png"]
    plt.close(fig)


class _Stopped(Exception):
    """What the test's SIGINT handler raises (a KeyboardInterrupt would stop pytest itself)."""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_as_the_temporary_directory_is_made_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals
) -> None:
    # The signal lands the moment the directory exists, before its clean-up is registered: with
    # tempfile.TemporaryDirectory alone, the handler's exception came out of mkdtemp and the directory
    # stayed (seen in CI, sidecar_load interrupted as its directory appeared).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = tempfile.mkdtemp

    def mkdtemp_then_signal(*args: Any, **kwargs: Any) -> str:
        d = made(*args, **kwargs)
        os.kill(os.getpid(), sig)
        return d

    def stop(*_: object) -> None:
        raise _Stopped

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_then_signal)
    previous = signal.signal(sig, stop)
    try:
        with pytest.raises(_Stopped), temporary_directory(prefix="run-"):
            pytest.fail("the body ran: the signal was lost")
    finally:
        signal.signal(sig, previous)
    assert list(tmp_path.iterdir()) == []
    assert sig not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # not left held


def test_the_temporary_directory_is_removed_when_its_body_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError), temporary_directory(prefix="run-") as d:
        assert Path(d).parent == tmp_path and Path(d).name.startswith("run-")
        (Path(d) / "state").mkdir()
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []
