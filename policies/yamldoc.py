"""One YAML document as the project's files read it (policies, the sidecar's config): safe YAML only,
with the line of every field, and refused when a person would be misled or a parser hurt.

What must hold: a document with a key given twice in one mapping is refused (PyYAML keeps the last
silently, so the author's first value, maybe a whole ``spec``, would be dropped unread); so is one
nested deeper than ``max_depth`` or whose aliases expand beyond ``max_nodes`` ("billion laughs"),
and one that would hit the parser's recursion limit. Errors are ``YamlProblem`` with the line and the
field path; each caller turns it into its own error type.

Merge keys (``<<: [*a, *b]``): a key that two of the merged mappings both give is refused too. YAML
gives it the earlier mapping's value; PyYAML 6 keeps the earlier one only where the two keys are the
same string object (one-character keys, which CPython interns) and the later one otherwise, so
``{<<: [{name: p1}, {name: p2}]}`` read as ``p2``. A key given beside the merge key overrides the
merged ones, as YAML says and PyYAML does: allowed (such a key given by two merged mappings too).
``load(..., saved=True)`` skips this rule, for a document an earlier version accepted and saved
(restoring it must not drop it).

YAML 1.1's other numbers are refused where written plain: a leading zero is octal (``seed: 017`` read
as 15) and colons are base 60 (``min_dwell_s: 1:30`` read as 90); YAML 1.2 and JSON read neither so,
and a reader of the file would not. Quoted, they are strings; ``0x1F`` and ``0b1`` say what they
are and stay. ``saved=True`` skips this rule too.

Numbers: PyYAML follows YAML 1.1, which reads an exponent without a dot or without a sign (``1e-3``,
``1.0e3``) as a *string*, so ``decision_interval_s: 1e-1`` was refused as "expected a number, got
str". ``Loader`` also resolves YAML 1.2's floats (``[-+]?(.N|N[.N])[eE][-+]?N``); every other scalar
(ints, booleans, 1.1 floats, null, timestamps, strings) resolves as before. A field that takes text
can get such a scalar back as written from ``Lines.yaml12_float_text`` (a policy named ``1e3``).
``Dumper`` quotes strings that ``Loader`` would read as numbers, so what it writes reads back.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import yaml

_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_INT_TAG = "tag:yaml.org,2002:int"
#: Plain scalars YAML 1.1 reads as numbers that no other reader would: octal by a leading zero, and
#: base 60 (``1:30``). The forms with a prefix (``0x``, ``0b``) say what they are and are left.
_YAML11_ONLY_NUMBER = re.compile(r"^[-+]?(?:0[0-7_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)$")
#: YAML 1.2 core schema floats that have an exponent (without one, YAML 1.1 already reads them alike).
_YAML12_FLOAT = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$")


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats such as ``1e-3`` as numbers."""


class Dumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes a string ``Loader`` would read as a number (``'1e3'``)."""


for _cls in (Loader, Dumper):
    # Appended after the YAML 1.1 resolvers: a scalar they resolve keeps its type; only what they left
    # a string, and this matches, becomes a float.
    _cls.add_implicit_resolver(_FLOAT_TAG, _YAML12_FLOAT, list("-+0123456789."))


def _yaml11_string(node: yaml.Node) -> bool:
    """Whether YAML 1.1 (``yaml.SafeLoader``) read this plain scalar as a string."""
    v = node.value
    return not any(rx.match(v) for _, rx in yaml.SafeLoader.yaml_implicit_resolvers.get(v[:1], []))


class YamlProblem(ValueError):
    """What is wrong with the document, at ``line`` (1-based, None: unknown) and field ``path``."""

    def __init__(self, message: str, *, line: int | None = None, path: str = "") -> None:
        super().__init__(message)
        self.message, self.line, self.path = message, line, path


class Lines:
    """Line numbers of every node in a composed document, by field path (``a.b[2].c``)."""

    def __init__(self, *, max_depth: int, max_nodes: int, saved: bool = False) -> None:
        self.by_path: dict[str, int] = {}
        #: Plain scalars read as YAML 1.2 floats that YAML 1.1 read as strings, as written, by path.
        self.yaml12_floats: dict[str, str] = {}
        self.max_depth, self.max_nodes = max_depth, max_nodes
        self.visits = 0
        self.saved = saved
        #: The keys (and their lines) each mapping node gives once its merges are applied, by node id:
        #: an anchored mapping merged in many places is walked for its keys once.
        self._keys: dict[int, dict[str, int]] = {}

    def walk(self, node: yaml.Node, path: str, depth: int = 0) -> None:
        # Aliases make the composed document a graph: every visit counts, so that a small document
        # whose aliases expand exponentially is refused instead of walked.
        self.visits += 1
        line = node.start_mark.line + 1
        if self.visits > self.max_nodes:
            raise YamlProblem(
                f"document expands to more than {self.max_nodes} nodes (YAML aliases)", line=line, path=path
            )
        if depth > self.max_depth:
            raise YamlProblem(f"nested deeper than {self.max_depth} levels", line=line, path=path)
        self.by_path[path] = line
        if isinstance(node, yaml.MappingNode):
            if not self.saved:
                self._merged_once(node, path)
            first: dict[str, int] = {}
            for k, v in node.value:
                key = str(k.value) if isinstance(k, yaml.ScalarNode) else "?"
                at = f"{path}.{key}" if path else key
                if isinstance(k, yaml.ScalarNode) and key in first:
                    raise YamlProblem(
                        f"duplicate key (first on line {first[key]}; YAML would keep only the last)",
                        line=k.start_mark.line + 1,
                        path=at,
                    )
                first[key] = k.start_mark.line + 1
                self.by_path.setdefault(at, k.start_mark.line + 1)
                self.walk(v, at, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self.walk(v, f"{path}[{i}]", depth + 1)
        elif isinstance(node, yaml.ScalarNode) and node.style is None and node.tag in (_INT_TAG, _FLOAT_TAG):
            if node.tag == _FLOAT_TAG and _yaml11_string(node):
                self.yaml12_floats[path] = node.value
            elif not self.saved and _YAML11_ONLY_NUMBER.match(node.value):
                n = yaml.safe_load(node.value)
                why = "base 60" if ":" in node.value else "octal: a leading 0"
                raise YamlProblem(
                    f"{node.value}: YAML 1.1 reads it as {n!r} ({why}), unlike YAML 1.2 and JSON: write "
                    f"{n!r}, or quote it for text",
                    line=line,
                    path=path,
                )

    def _merged_once(self, node: yaml.MappingNode, path: str) -> None:
        """Refuse a key that two mappings of one merge sequence (``<<: [*a, *b]``) both give, unless
        the mapping gives it itself (its own value overrides both)."""
        own = {str(k.value) for k, _ in node.value if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE_TAG}
        for k, v in node.value:
            if k.tag != _MERGE_TAG or not isinstance(v, yaml.SequenceNode):
                continue
            given: dict[str, int] = {}
            for m in v.value:
                for key, line in self._keys_of(m).items():
                    if key in given and key not in own:
                        at = f"{path}.{key}" if path else key
                        raise YamlProblem(
                            f"given by two of the mappings merged on line {k.start_mark.line + 1} (lines "
                            f"{given[key]} and {line}): YAML takes the first, PyYAML sometimes the last; "
                            "give it in one of them, or beside the merge key",
                            line=line,
                            path=at,
                        )
                    given[key] = line

    def _keys_of(self, node: yaml.Node) -> dict[str, int]:
        """The scalar keys a mapping node gives, its own merges applied, with their lines ({} for
        anything else: the constructor refuses a merge of a non-mapping)."""
        if not isinstance(node, yaml.MappingNode):
            return {}
        known = self._keys.get(id(node))
        if known is not None:
            return known
        self._keys[id(node)] = {}  # a mapping that merges itself (an alias to its own anchor) stops here
        keys: dict[str, int] = {}
        for k, v in node.value:
            if k.tag == _MERGE_TAG:
                for m in v.value if isinstance(v, yaml.SequenceNode) else [v]:
                    for key, line in self._keys_of(m).items():
                        keys.setdefault(key, line)
            elif isinstance(k, yaml.ScalarNode):
                keys[str(k.value)] = k.start_mark.line + 1
        self._keys[id(node)] = keys
        return keys

    def line(self, path: str) -> int | None:
        """The line of ``path``, else of its nearest parent."""
        while path:
            if path in self.by_path:
                return self.by_path[path]
            path = path.rpartition(".")[0] if "." in path else ""
        return self.by_path.get("")

    def yaml12_float_text(self, path: str) -> str | None:
        """The text of the plain scalar at ``path`` when it was read as a YAML 1.2 float that YAML 1.1
        read as a string (``1e3``), else None: for fields that take text, to keep it as written."""
        return self.yaml12_floats.get(path)


def load(text: str, *, max_depth: int, max_nodes: int, saved: bool = False) -> tuple[Any, Lines]:
    """The document (None when empty) and its lines. Raises YamlProblem. ``saved``: a document an
    earlier version accepted (see the module docstring: the rules for merges and YAML 1.1 numbers are
    not applied to it)."""
    lines = Lines(max_depth=max_depth, max_nodes=max_nodes, saved=saved)
    try:
        loader = Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None, lines
            lines.walk(node, "")
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise YamlProblem(
            f"invalid YAML: {e.problem or e.context}", line=mark.line + 1 if mark is not None else None
        ) from None
    except yaml.YAMLError as e:
        raise YamlProblem(f"invalid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:  # the composer recurses per level, before ``walk`` can count them
        raise YamlProblem("document nested too deeply") from None
    except YamlProblem:
        raise
    except ValueError as e:  # int() of a number beyond Python's 4,300-digit limit, in the constructor
        line, key = _long_integer_at(text)
        if line is not None:  # Python's message names its own limit and no line: say it in the file's terms
            raise YamlProblem(
                f"an integer longer than {sys.get_int_max_str_digits()} digits", line=line, path=key
            ) from None
        raise YamlProblem(f"invalid value: {str(e).splitlines()[0]}") from None
    return data, lines


def _long_integer_at(text: str) -> tuple[int | None, str]:
    """The line of the first integer in ``text`` too long for Python to convert, and the key that
    starts that line ("" when none)."""
    m = re.search(rf"\d{{{sys.get_int_max_str_digits() + 1},}}", text)
    if m is None:
        return None, ""
    line = text.count("\n", 0, m.start()) + 1
    key = re.match(r"\s*([^\s:#][^:#]*?)\s*:", text.splitlines()[line - 1])
    return line, key.group(1) if key else ""
