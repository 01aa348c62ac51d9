"""The registry of hail-guard's own tools: each entry is one tool, declared once, with a schema that holds."""

from __future__ import annotations

import jsonschema
import pytest

from hail_guard.tools import OWN, OwnTool, offered


@pytest.mark.parametrize("entry", OWN.values(), ids=OWN)
def test_each_own_tool_takes_exactly_the_properties_it_declares(entry: OwnTool) -> None:
    schema = entry.tool.input_schema
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["additionalProperties"] is False
    assert set(schema.get("required", ())) <= set(schema["properties"])
    assert entry.tool.annotations is not None
    assert entry.tool.description


def test_the_review_queue_is_offered_only_when_exposed() -> None:
    review = {name for name, entry in OWN.items() if entry.review}
    assert review == {"review_list", "review_resolve", "review_resend"}
    assert set(offered(review=False)) == set(OWN) - review
    assert list(offered(review=True)) == list(OWN)
