"""JSON Schema (draft-07 subset) of every spec kind, for editors and CI."""

from __future__ import annotations

import json
from typing import Any

from . import __version__
from .ops import families

SCHEMA_ID = "https://tsgen.dev/schema/tsgen.schema.json"


def _to_draft07(node: Any) -> Any:
    """Pydantic emits 2020-12 `$defs`; draft-07 tools expect `definitions`."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = value.replace("#/$defs/", "#/definitions/")
            else:
                out["definitions" if key == "$defs" else key] = _to_draft07(value)
        return out
    if isinstance(node, list):
        return [_to_draft07(v) for v in node]
    return node


def json_schema() -> dict[str, Any]:
    definitions: dict[str, Any] = {}
    branches = []
    for family in families():
        schema = family.Spec.model_json_schema(mode="validation")
        for name, sub in schema.pop("$defs", {}).items():
            definitions[name] = sub
        title = schema.get("title", family.Spec.__name__)
        definitions[title] = schema
        branches.append({"if": {"properties": {"op": {"const": family.kind}}, "required": ["op"]},
                         "then": {"$ref": f"#/$defs/{title}"}})
    return _to_draft07(
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "$id": SCHEMA_ID,
            "title": f"tsgen spec (tsgen {__version__})",
            "type": "object",
            "required": ["op", "name", "world_sizes"],
            "properties": {"op": {"enum": [f.kind for f in families()]}},
            "allOf": branches,
            "$defs": dict(sorted(definitions.items())),
        }
    )


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=False) + "\n"
