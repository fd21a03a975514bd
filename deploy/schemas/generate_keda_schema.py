"""Writes keda-scaledobject-v1alpha1.json from the KEDA CRD models in a cloudcoil-models-keda wheel.

    pip download --no-deps --only-binary=:all: --python-version 3.14 cloudcoil-models-keda==2.20.2.1
    python deploy/schemas/generate_keda_schema.py cloudcoil_models_keda-2.20.2.1-py3-none-any.whl

No package on PyPI or npm carries KEDA's CRD YAML itself; cloudcoil-models-keda carries pydantic
models generated from KEDA v2.20.2's CRDs (``cloudcoil/models/keda/v1alpha1.py``). This script reads
that module's syntax tree (nothing is imported: the wheel needs Python 3.14) and turns the models
reachable from ``ScaledObjectSpec`` into JSON Schema draft 2020-12: field aliases as property names,
fields without a default as required, ``Field`` bounds as minimum/maximum/minLength/pattern, every
object closed (additionalProperties false) so a misspelt field fails, as ``kubectl --validate=strict``
would. One addition that is not in the CRD, marked with a $comment: a ``prometheus`` trigger needs
``serverAddress``, ``query`` and ``threshold`` in its metadata (KEDA's prometheus scaler).
What must hold: the output is a pure function of the wheel; rerunning it reproduces the committed file.
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

MODULE = "cloudcoil/models/keda/v1alpha1.py"
OUT = Path(__file__).with_name("keda-scaledobject-v1alpha1.json")
SCALARS = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "bool": {"type": "boolean"},
    "float": {"type": "number"},
}
BOUNDS = {"ge": "minimum", "le": "maximum", "pattern": "pattern"}


class Converter:
    def __init__(self, source: str) -> None:
        tree = ast.parse(source)
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self.defs: dict[str, Any] = {}

    def type_of(self, node: ast.expr) -> dict[str, Any]:
        """JSON Schema of an annotation (``X | None`` is X: an absent field is how YAML leaves it out)."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            parts = [p for p in _union(node) if not (isinstance(p, ast.Constant) and p.value is None)]
            kinds = [self.type_of(p) for p in parts]
            return kinds[0] if len(kinds) == 1 else {"anyOf": kinds}
        if isinstance(node, ast.Constant) and node.value is None:
            return {"type": "null"}
        if isinstance(node, ast.Name):
            if node.id in SCALARS:
                return dict(SCALARS[node.id])
            if node.id in self.classes:
                return self.model(node.id)
            raise ValueError(f"unknown type {node.id}")
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            head, arg = node.value.id, node.slice
            if head == "Annotated":
                assert isinstance(arg, ast.Tuple)
                schema = self.type_of(arg.elts[0])
                for extra in arg.elts[1:]:
                    schema.update(_field_bounds(extra, schema))
                return schema
            if head == "list":
                return {"type": "array", "items": self.type_of(arg)}
            if head == "dict":
                assert isinstance(arg, ast.Tuple)
                return {"type": "object", "additionalProperties": self.type_of(arg.elts[1])}
            if head == "Literal":
                values = arg.elts if isinstance(arg, ast.Tuple) else [arg]
                return {"enum": [ast.literal_eval(v) for v in values]}
        raise ValueError(f"unsupported annotation {ast.unparse(node)}")

    def model(self, name: str) -> dict[str, Any]:
        cls = self.classes[name]
        bases = [ast.unparse(b) for b in cls.bases]
        if any(b.startswith("RootModel[") for b in bases):
            root = next(
                (s for s in cls.body if isinstance(s, ast.AnnAssign) and ast.unparse(s.target) == "root"),
                None,
            )
            if root is not None:
                return self.type_of(root.annotation)
            return self.type_of(ast.parse(bases[0].removeprefix("RootModel[")[:-1], mode="eval").body)
        if name not in self.defs:
            self.defs[name] = {}  # placeholder against cycles
            props: dict[str, Any] = {}
            required: list[str] = []
            for stmt in cls.body:
                if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                    continue
                if stmt.target.id.startswith("__"):
                    continue
                key = _alias(stmt.annotation) or stmt.target.id
                props[key] = self.type_of(stmt.annotation)
                if stmt.value is None:
                    required.append(key)
            out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": props}
            if required:
                out["required"] = required
            self.defs[name] = out
        return {"$ref": f"#/$defs/{name}"}


def _union(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return [*_union(node.left), *_union(node.right)]
    return [node]


def _alias(annotation: ast.expr) -> str | None:
    for n in ast.walk(annotation):
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "Field":
            for kw in n.keywords:
                if kw.arg == "alias":
                    return str(ast.literal_eval(kw.value))
    return None


def _field_bounds(node: ast.expr, schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "Field":
        for kw in node.keywords:
            if kw.arg in BOUNDS:
                out[BOUNDS[kw.arg]] = ast.literal_eval(kw.value)
            elif kw.arg == "min_length":
                out["minItems" if schema.get("type") == "array" else "minLength"] = ast.literal_eval(kw.value)
    return out


def build(source: str, *, wheel: str) -> dict[str, Any]:
    conv = Converter(source)
    spec = conv.model("ScaledObjectSpec")
    trigger = conv.defs["ScaledObjectSpecTriggersItem"]
    trigger["allOf"] = [
        {
            "$comment": "Added, not in the CRD: KEDA's prometheus scaler needs these metadata keys.",
            "if": {"properties": {"type": {"const": "prometheus"}}, "required": ["type"]},
            "then": {"properties": {"metadata": {"required": ["serverAddress", "query", "threshold"]}}},
        }
    ]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "speccontrol/deploy/schemas/keda-scaledobject-v1alpha1.json",
        "title": "KEDA ScaledObject (keda.sh/v1alpha1)",
        "description": (
            f"Generated by deploy/schemas/generate_keda_schema.py from {wheel} (pydantic models generated "
            "from KEDA v2.20.2's CRDs). Objects are closed so that a misspelt field fails. Do not edit."
        ),
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string", "minLength": 1}},
            },
            "spec": spec,
            "status": {"type": "object"},
        },
        "$defs": dict(sorted(conv.defs.items())),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with zipfile.ZipFile(argv[0]) as z:
        source = z.read(MODULE).decode("utf-8")
    schema = build(source, wheel=Path(argv[0]).name)
    OUT.write_text(json.dumps(schema, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({len(schema['$defs'])} definitions)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
