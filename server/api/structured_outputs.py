"""vLLM's structured-output request fields, as the Grammar the engine applies.

Users moving from vLLM send `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's older
names) or `structured_outputs: {json | regex | choice | grammar | json_object}` (its newer ones) next to or
instead of OpenAI's `response_format`. Each is applied; at most one of them may constrain a request. A grammar
is Lark (llguidance's dialect) or GBNF/EBNF (`root ::= ...`, xgrammar's, which vLLM uses by default; grammar.py
converts it). `guided_choice` is one of the given strings, exactly.

Pure functions of the field values; protocol.py declares the fields and app.py compiles what these return.
"""
from __future__ import annotations

import json
from typing import Any

from metronome.contract.errors import InvalidRequestError
from metronome.server.api.json_schemas import closed_objects
from metronome.server.engine.sampling import Grammar

# Fields a vLLM client may send that only steer how vLLM builds its grammar: accepted, nothing to apply.
IGNORED_OPTIONS = ("guided_decoding_backend", "guided_whitespace_pattern")
# Every vLLM extension field of this kind (refused with a 400 under --strict-openai).
VLLM_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
               "chat_template_kwargs", *IGNORED_OPTIONS)


def json_grammar(value: Any, param: str, close_objects: bool = False) -> Grammar:
    """A JSON schema given as an object, a boolean or JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise InvalidRequestError(f"{param} must be a JSON schema (an object, or its JSON text)",
                                      param=param) from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError(f"{param} must be a JSON schema (an object or a boolean)", param=param)
    if close_objects:
        value = closed_objects(value)
    return Grammar("json_schema", json.dumps(value))


def choice_grammar(choices: Any, param: str) -> Grammar:
    """Exactly one of `choices` (a non-empty list of non-empty strings)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings", param=param)
    return Grammar("lark", "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


def text_grammar(kind: str, text: Any, param: str) -> Grammar:
    if not isinstance(text, str) or not text:
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return Grammar(kind, text)


def guided_grammar(fields: dict[str, Any]) -> tuple[Grammar, str] | None:
    """The Grammar of vLLM's `guided_*` fields and its field name, or None when none is set."""
    found = [(name, value) for name, value in fields.items() if value is not None and name in GUIDED_KINDS]
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError(f"only one structured output constraint may be given, got "
                                  f"{' and '.join(name for name, _ in found)}", param=found[1][0])
    name, value = found[0]
    return GUIDED_KINDS[name](value, name), name


def structured_outputs_grammar(options: dict[str, Any]) -> Grammar | None:
    """The Grammar of vLLM's `structured_outputs` object, or None when it constrains nothing."""
    param = "structured_outputs"
    if options.get("structural_tag") is not None:
        raise InvalidRequestError("structured_outputs.structural_tag is not supported", param=f"{param}.structural_tag")
    kinds = [k for k in ("json", "regex", "choice", "grammar") if options.get(k) is not None]
    if options.get("json_object"):
        kinds.append("json_object")
    if not kinds:
        return None
    if len(kinds) > 1:
        raise InvalidRequestError(f"structured_outputs may set one of json, regex, choice, grammar and json_object, "
                                  f"got {', '.join(kinds)}", param=param)
    kind = kinds[0]
    where = f"{param}.{kind}"
    if kind == "json":
        return json_grammar(options["json"], where, close_objects=bool(options.get("disable_additional_properties")))
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "choice":
        return choice_grammar(options["choice"], where)
    return text_grammar("regex" if kind == "regex" else "lark", options[kind], where)


GUIDED_KINDS = {
    "guided_json": json_grammar,
    "guided_regex": lambda value, name: text_grammar("regex", value, name),
    "guided_choice": choice_grammar,
    "guided_grammar": lambda value, name: text_grammar("lark", value, name),
}
