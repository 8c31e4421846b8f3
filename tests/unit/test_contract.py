"""The published contract under docs/contract/ is what the code generates, and it holds
together: every subject's messages have schemas, every reference resolves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from shared.contract import asyncapi, channels, json_schemas, write_contract
from shared.messages import RequestEvent

PUBLISHED = Path(__file__).resolve().parents[2] / "docs" / "contract"


def test_the_published_contract_is_current(tmp_path: Path) -> None:
    written = {p.relative_to(tmp_path) for p in write_contract(tmp_path)}
    published = {p.relative_to(PUBLISHED) for p in PUBLISHED.rglob("*.json")}
    assert published == written, "run `halfmoon schema` and commit docs/contract/"
    for relative in written:
        assert (PUBLISHED / relative).read_text() == (tmp_path / relative).read_text(), \
            f"{relative} is stale: run `halfmoon schema` and commit docs/contract/"


def _resolve(document: dict[str, Any], ref: str) -> Any:
    node: Any = document
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


def test_every_reference_in_the_asyncapi_document_resolves() -> None:
    document = asyncapi()
    refs = _refs(document)
    assert refs
    for ref in refs:
        assert _resolve(document, ref) is not None


def test_every_channel_address_is_a_halfmoon_subject_with_named_parameters() -> None:
    document = asyncapi()
    for channel in channels():
        entry = document["channels"][channel.key]
        assert entry["address"].startswith("halfmoon.{cluster}.v1.")
        for name in entry["parameters"]:
            assert "{" + name + "}" in entry["address"]
        assert "TOKEN" not in entry["address"]


def test_a_real_event_validates_against_its_published_schema() -> None:
    schema = json_schemas()["RequestEvent"]
    event = RequestEvent(kind="finished", request_id="cmpl-1", source="gw-1", at_s=1.0,
                         num_output_tokens=3, ttft_s=0.01)
    jsonschema.validate(json.loads(msgspec.json.encode(event)), schema)
    bad = {**json.loads(msgspec.json.encode(event)), "kind": "exploded"}
    with pytest.raises(jsonschema.ValidationError, match="exploded"):
        jsonschema.validate(bad, schema)
