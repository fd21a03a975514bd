"""The built-in policy presets (``policies/library/*.yaml``) and naming a policy by preset or file.

The presets are package data, read through ``importlib.resources`` (no path outside the package). A
policy file the user names is read here too, and only here, bounded to the document limit, so the
sidecar, ``controllerctl`` and the simulator resolve a name the same way. Nothing else in ``policies``
reads anything.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from policies.spec import MAX_DOCUMENT_BYTES, PolicyError, PolicySpec, parse_policy
from policies.text import error_text

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


def read_policy_file(path: Path) -> str:
    """A policy file's text, read no further than the document limit: a 64 MB file is refused after
    64 KiB + 1 bytes, not read whole first. Raises PolicyError."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as e:
        raise PolicyError(f"cannot read policy file: {error_text(e)}", source=str(path)) from None
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise PolicyError(f"document larger than {MAX_DOCUMENT_BYTES} bytes", source=str(path))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError(f"not UTF-8 text (byte {e.start})", source=str(path)) from None


def resolve_policy_text(name_or_path: str) -> tuple[str, str]:
    """``(yaml, source)`` for a policy file path if it exists, else a preset name."""
    if not name_or_path.strip():
        # Named by its repr: as the source of the error it named nothing (": not a regular file", for
        # '' is the path '.'; " : unknown policy preset ' '").
        raise PolicyError("not a policy file or preset name", source=repr(name_or_path))
    p = Path(name_or_path)
    try:  # stat() raises for a name longer than the file system takes (ENAMETOOLONG), or EACCES
        is_file, exists = p.is_file(), p.exists()
    except OSError as e:
        raise PolicyError(f"cannot read policy file: {error_text(e)}", source=name_or_path[:200]) from None
    if is_file:
        return read_policy_file(p), str(p)
    if exists:  # a directory, a FIFO (whose read would block), a device
        raise PolicyError(
            "not a regular file (a policy is a YAML file, or a preset name)", source=name_or_path
        )
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
