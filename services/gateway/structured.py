"""Checks on a structured-output request at the gateway, before it is queued: the JSON
schema is a valid schema (its own meta-schema), its references resolve inside it, and it
uses no keyword the workers' grammar engine (xgrammar) would not enforce, since an output
could then break the schema. The gateway stays free of xgrammar and torch; a grammar the
workers still cannot compile fails the request with the same 400 from there."""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema

from shared.errors import InvalidRequest
from shared.messages import GrammarSpec

UNENFORCED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
    "contains", "minContains", "maxContains", "uniqueItems", "unevaluatedProperties",
    "unevaluatedItems", "propertyNames", "multipleOf", "patternProperties",
    "$dynamicRef", "$recursiveRef",
})
PARAM = "response_format"


@functools.lru_cache(maxsize=1024)
def check_grammar(spec: GrammarSpec, param: str = PARAM) -> None:
    """Raise `InvalidRequest` naming what is wrong with the spec's schema (as `param`)."""
    try:
        _check_spec(spec)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, param=param) from exc


def _check_spec(spec: GrammarSpec) -> None:
    if spec.kind != "json_schema":
        return
    schema = json.loads(spec.source)
    if not isinstance(schema, dict):
        raise InvalidRequest("json_schema.schema must be a JSON object", param=PARAM)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the root"
        raise InvalidRequest(f"json_schema.schema is not a valid JSON schema at {where}: "
                             f"{exc.message}", param=PARAM) from exc
    _check_node(schema, schema, "#")


def _check_node(node: Any, root: dict[str, Any], path: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_node(item, root, f"{path}/{i}")
        return
    if not isinstance(node, dict):
        return
    is_property_map = path.endswith(("/properties", "/$defs", "/definitions"))
    for key, value in node.items():
        if not is_property_map:
            if key in UNENFORCED_KEYWORDS:
                raise InvalidRequest(f"the json_schema keyword {key!r} (at {path}) is not "
                                     "supported", param=PARAM)
            if key == "$ref":
                _check_ref(value, root, path)
        _check_node(value, root, f"{path}/{key}")


def _check_ref(ref: object, root: dict[str, Any], path: str) -> None:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise InvalidRequest(f"$ref {ref!r} (at {path}): only references inside the schema "
                             "(#/...) are supported", param=PARAM)
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        key = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or key not in node:
            raise InvalidRequest(f"$ref {ref!r} (at {path}) does not resolve", param=PARAM)
        node = node[key]
