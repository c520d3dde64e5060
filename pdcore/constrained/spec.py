"""A request's grammar as the HTTP edge reads it: the fields that name one (`json_schema`,
`regex`, `ebnf`, `structural_tag`, OpenAI's `response_format`) checked and turned into a
`GrammarSpec`, and JSON a client sends as text parsed with its nesting bounded. Pure Python:
the HTTP process imports this, never the backend (xgrammar, torch) that compiles the spec in
the scheduler process (`constrained.backend`)."""

from __future__ import annotations

import json
from typing import Any

from pdcore.errors import InvalidRequestError
from pdcore.messages.io import GrammarSpec

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused (400)
MAX_JSON_TEXT_DEPTH = 32  # JSON a client sends as text (a schema, a structural tag, tool-call
# arguments) nested deeper than this is refused (400), as the same JSON sent as an object is


def load_client_json(text: str, field: str, max_depth: int = MAX_JSON_TEXT_DEPTH,
                     keep_text: bool = False) -> Any:
    """JSON a client sent inside a string, parsed with its nesting bounded: 400 naming `field`
    when it is nested deeper than `max_depth` levels, or when it is not JSON (unless
    `keep_text`: then the text itself is returned). json.loads recurses once per
    level: 2 KB of brackets raised RecursionError, which became a 500 that the router counted
    against the worker. The parse is C speed; the depth walk is iterative."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidRequestError(f"{field} is nested too deeply; send JSON nested at most "
                                  f"{max_depth} levels", field) from None
    except ValueError as e:
        if keep_text:
            return text
        raise InvalidRequestError(f"{field} is not valid JSON: {e}", field) from None
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise InvalidRequestError(f"{field} is nested deeper than {max_depth} levels; send "
                                      f"JSON nested at most {max_depth} levels", field)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


def _check_structures(tag: Any, field: str) -> None:
    """SGLang's structural tag {"structures": [{begin, schema, end}], "triggers": [...]}: its
    shape, and each schema given as text bounded as the tag itself is."""
    if not isinstance(tag, dict) or "structures" not in tag or "format" in tag:
        return  # xgrammar's own form: a JSON document it checks itself
    structures, triggers = tag.get("structures"), tag.get("triggers", [])
    if not isinstance(structures, list) or not isinstance(triggers, list) or \
            not all(isinstance(t, str) for t in triggers):
        raise InvalidRequestError(f"{field}: structures and triggers must be lists (triggers "
                                  "of strings)", field)
    for i, s in enumerate(structures):
        where = f"{field}.structures[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or \
                not isinstance(s.get("end"), str) or not isinstance(s.get("schema"), (str, dict)):
            raise InvalidRequestError(f"{where} must be {{\"begin\": str, \"schema\": object, "
                                      "\"end\": str}", where)
        if isinstance(s["schema"], str):
            load_client_json(s["schema"], where + ".schema")


def _checked_text(kind: str, value: Any, field: str) -> str:
    if isinstance(value, dict) and kind in ("json_schema", "structural_tag"):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field} must be a string", field)
    if not value.strip():
        raise InvalidRequestError(f"{field} must not be empty", field)
    if len(value) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"{field} has {len(value)} characters; at most "
                                  f"{MAX_GRAMMAR_CHARS}", field)
    if kind in ("json_schema", "structural_tag"):
        parsed = load_client_json(value, field)
        if kind == "structural_tag":
            _check_structures(parsed, field)
    return value


def spec_from_fields(fields: dict[str, Any], prefix: str = "") -> GrammarSpec | None:
    """The one grammar named by json_schema / regex / ebnf / structural_tag in `fields` (None
    when none is), checked for size and, for JSON kinds, for being JSON. json_schema and
    structural_tag may hold a JSON object or its text."""
    named = [(k, fields[k]) for k in ("json_schema", "regex", "ebnf", "structural_tag")
             if fields.get(k) is not None]
    if not named:
        return None
    if len(named) > 1:
        keys = ", ".join(prefix + k for k, _ in named)
        raise InvalidRequestError(f"at most one of json_schema, regex, ebnf, structural_tag may "
                                  f"be set; got {keys}", prefix + named[1][0])
    kind, value = named[0]
    return GrammarSpec(kind, _checked_text(kind, value, prefix + kind), prefix + kind)


def spec_from_response_format(rf: Any, field: str = "response_format") -> GrammarSpec | None:
    """OpenAI's response_format: text (None), json_object, json_schema {name, schema, strict},
    and SGLang's structural_tag {structures, triggers}."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidRequestError(f"{field} must be an object with a string `type`", field)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", field)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequestError(f"{field}.json_schema must be an object with a `schema`",
                                      f"{field}.json_schema")
        schema = js.get("schema", js.get("schema_"))
        if schema is None:  # OpenAI: a json_schema without `schema` means any JSON object
            return GrammarSpec("json_object", "", field)
        where = f"{field}.json_schema.schema"
        return GrammarSpec("json_schema", _checked_text("json_schema", schema, where), where)
    if kind == "structural_tag":
        return GrammarSpec("structural_tag", _checked_text("structural_tag", dict(rf), field),
                           field)
    raise InvalidRequestError(f"{field}.type must be text, json_object, json_schema or "
                              f"structural_tag; got {kind!r}", f"{field}.type")
