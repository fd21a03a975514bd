"""YAML 1.1's numbers that no other reader takes (policies.yamldoc): octal by a leading zero, base 60.

What must hold: a plain ``017`` (YAML 1.1: 15) or ``1:30`` (YAML 1.1: 90) in a policy, the sidecar's
config or a simulator profile is refused naming its line and field, with the value YAML 1.1 gives it,
and nothing is read; quoted it is text, ``0x1F`` / ``0b1`` and numbers without a leading zero read as
before; a saved policy (a snapshot's, accepted by an earlier version) still reads as it did.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import parse_config
from controller.errors import ConfigError
from policies.spec import PolicyError, parse_policy
from sim.costmodel import ProfileError, load_profile

LIBRARY = Path(__file__).resolve().parents[2] / "policies" / "library"
DEFAULT = (LIBRARY / "default.yaml").read_text()


def _policy(seed: str) -> str:
    assert "\n  seed: 0\n" in DEFAULT
    return DEFAULT.replace("\n  seed: 0\n", f"\n  seed: {seed}\n")


def _seed_line() -> int:
    return DEFAULT.splitlines().index("  seed: 0") + 1


@pytest.mark.parametrize(
    ("written", "read"), [("017", "15"), ("00", "0"), ("-012", "-10"), ("1:30", "90"), ("1:00:00", "3600")]
)
def test_a_policy_number_yaml_11_reads_otherwise_is_refused_by_line(written: str, read: str) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(_policy(written), source="p.yaml")
    assert (e.value.line, e.value.field) == (_seed_line(), "spec.seed")
    assert f"{written}: YAML 1.1 reads it as {read} (" in str(e.value)
    assert f"write {read}, or quote it" in str(e.value)


@pytest.mark.parametrize(
    ("written", "seed"), [("17", 17), ("0", 0), ("0x1F", 31), ("0b101", 5), ("1_000", 1000)]
)
def test_numbers_every_reader_takes_alike_still_read(written: str, seed: int) -> None:
    assert parse_policy(_policy(written), source="p.yaml").seed == seed


def test_a_saved_policy_reads_as_before() -> None:
    # Restoring a snapshot must never drop what an earlier version accepted.
    assert parse_policy(_policy("017"), source="snapshot", saved=True).seed == 15


def test_the_sidecar_config_refuses_base_60_by_line() -> None:
    with pytest.raises(
        ConfigError, match=r"2.*snapshot_interval_s.*1:30: YAML 1\.1 reads it as 90 \(base 60\)"
    ):
        parse_config("# mine\nsnapshot_interval_s: 1:30\n", source="sidecar.yaml")
    assert parse_config("snapshot_interval_s: 90\n", source="s.yaml").snapshot_interval_s == 90


def test_a_profile_refuses_octal_by_line(tmp_path: Path) -> None:
    shipped = (
        Path(__file__).resolve().parents[2] / "sim" / "profiles" / "llama-3.1-8b-h100.yaml"
    ).read_text()
    lines = shipped.splitlines()
    at = next(i for i, s in enumerate(lines) if s.strip().startswith("num_gpus:"))
    lines[at] = lines[at].split(":")[0] + ": 01"
    p = tmp_path / "mine.yaml"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ProfileError, match=rf"mine\.yaml:{at + 1}: .*01: YAML 1\.1 reads it as 1 \(octal"):
        load_profile(str(p))
