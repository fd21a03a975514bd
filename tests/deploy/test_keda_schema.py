"""deploy/schemas/generate_keda_schema.py: CRD models in, a closed JSON Schema out, reproducibly.

The real input is the cloudcoil-models-keda wheel (pydantic models generated from KEDA's CRDs):
$SPECCONTROL_KEDA_WHEEL, or the copy scripts/ci_system_deps.sh downloads into .venv/wheels; from it,
the committed schema must be what the script writes (CI, SPECCONTROL_REQUIRE_DEPLOY_TOOLS: a missing
wheel fails instead of skipping).
"""

from __future__ import annotations

import importlib.util
import json
import os
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "schemas" / "generate_keda_schema.py"
DOWNLOADED = ROOT / ".venv" / "wheels" / "cloudcoil_models_keda-2.20.2.1-py3-none-any.whl"
_spec = importlib.util.spec_from_file_location("generate_keda_schema", SCRIPT)
assert _spec is not None and _spec.loader is not None
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

MODELS = """
from typing import Annotated, Literal
class ScaledObjectSpecScaleTargetRef(BaseModel):
    api_version: Annotated[str | None, Field(alias="apiVersion")] = None
    name: str
class Tolerance(RootModel[int]):
    root: Annotated[int, Field(ge=0)]
class ScaledObjectSpecTriggersItem(BaseModel):
    metadata: dict[str, str]
    metric_type: Annotated[Literal["AverageValue", "Value"] | None, Field(alias="metricType")] = None
    type: Annotated[str, Field(min_length=1)]
    tolerance: Tolerance | None = None
class ScaledObjectSpec(BaseModel):
    polling_interval: Annotated[int | None, Field(alias="pollingInterval", ge=1)] = None
    scale_target_ref: Annotated[ScaledObjectSpecScaleTargetRef, Field(alias="scaleTargetRef")]
    triggers: Annotated[list[ScaledObjectSpecTriggersItem], Field(min_length=1)]
"""


def test_models_become_a_closed_schema() -> None:
    schema = gen.build(MODELS, wheel="test.whl")
    spec = schema["$defs"]["ScaledObjectSpec"]
    assert spec["required"] == ["scaleTargetRef", "triggers"] and spec["additionalProperties"] is False
    assert spec["properties"]["pollingInterval"] == {"type": "integer", "minimum": 1}
    assert spec["properties"]["triggers"]["minItems"] == 1
    trig = schema["$defs"]["ScaledObjectSpecTriggersItem"]
    assert trig["properties"]["metricType"] == {"enum": ["AverageValue", "Value"]}
    assert trig["properties"]["tolerance"] == {"type": "integer", "minimum": 0}  # a RootModel is its root
    assert trig["properties"]["type"] == {"type": "string", "minLength": 1}
    assert trig["required"] == ["metadata", "type"]
    assert schema["$defs"]["ScaledObjectSpecScaleTargetRef"]["required"] == ["name"]


def test_unknown_annotations_are_refused() -> None:
    with pytest.raises(ValueError, match="Decimal"):
        gen.build(MODELS.replace("name: str", "name: Decimal"), wheel="test.whl")


def test_committed_schema_is_what_the_wheel_gives(tmp_path: Path) -> None:
    wheel = os.environ.get("SPECCONTROL_KEDA_WHEEL") or str(DOWNLOADED)
    if not Path(wheel).is_file():
        why = f"no cloudcoil-models-keda 2.20.2.1 wheel at {wheel} (scripts/ci_system_deps.sh downloads it)"
        if os.environ.get("SPECCONTROL_REQUIRE_DEPLOY_TOOLS"):
            pytest.fail(why)
        pytest.skip(why)
    with zipfile.ZipFile(wheel) as z:
        source = z.read(gen.MODULE).decode("utf-8")
    built = gen.build(source, wheel=Path(wheel).name)
    assert json.loads(gen.OUT.read_text()) == json.loads(json.dumps(built))
