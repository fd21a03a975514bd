"""The built-in policy presets (``policies/library/*.yaml``), read as package resources.

``policies`` stays free of I/O, so reading the library lives here.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from policies.spec import PolicyError, PolicySpec, parse_policy

_PACKAGE = "policies"
_DIR = "library"


def preset_names() -> list[str]:
    """Names of the built-in presets, sorted."""
    lib = resources.files(_PACKAGE) / _DIR
    return sorted(p.name[: -len(".yaml")] for p in lib.iterdir() if p.name.endswith(".yaml"))


def preset_text(name: str) -> str:
    """The YAML document of a preset. Raises PolicyError for an unknown name."""
    if name not in preset_names():
        raise PolicyError(
            f"unknown policy preset {name!r} (presets: {', '.join(preset_names())})", source=name
        )
    return (resources.files(_PACKAGE) / _DIR / f"{name}.yaml").read_text(encoding="utf-8")


def load_preset(name: str) -> PolicySpec:
    return parse_policy(preset_text(name), source=f"preset:{name}")


def resolve_policy_text(name_or_path: str) -> tuple[str, str]:
    """``(yaml, source)`` for a policy file path if it exists, else a preset name."""
    p = Path(name_or_path)
    if p.is_file():
        try:
            return p.read_text(encoding="utf-8"), str(p)
        except (OSError, UnicodeDecodeError) as e:
            raise PolicyError(f"cannot read policy file: {e}", source=str(p)) from None
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        raise PolicyError(
            f"no such policy file, and not a preset (presets: {', '.join(preset_names())})",
            source=name_or_path,
        )
    return preset_text(name_or_path), f"preset:{name_or_path}"


def resolve_policy(name_or_path: str) -> PolicySpec:
    """A policy from a YAML file path if it exists, else from the preset of that name."""
    text, source = resolve_policy_text(name_or_path)
    return parse_policy(text, source=source)
