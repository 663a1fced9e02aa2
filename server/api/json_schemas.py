"""Edits of client JSON schemas, iterative so that any nesting a JSON body can carry is safe to walk.

`closed_objects` is what a forced tool call's grammar follows: an object schema that leaves
`additionalProperties` unset admits no keys beyond its `properties` (vLLM's default grammar backend does the
same), so a small model cannot wander into keys the tool does not take. A schema that sets it, to true or to a
schema, keeps its choice. The members of an `allOf` are not closed themselves (each would refuse the others'
keys), only the objects inside them.
"""
from __future__ import annotations

from typing import Any

# Where JSON Schema keeps subschemas: one schema, a list of them, or a map of names to them.
ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "additionalProperties",
       "unevaluatedItems", "unevaluatedProperties")
LISTS = ("anyOf", "oneOf", "prefixItems", "items")
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def copy_json(value: Any) -> Any:
    """A deep copy of a JSON value (dicts, lists, scalars) without recursion."""
    if not isinstance(value, (dict, list)):
        return value
    root: Any = {} if isinstance(value, dict) else [None] * len(value)
    stack = [(value, root)]
    while stack:
        source, target = stack.pop()
        for key, item in (source.items() if isinstance(source, dict) else enumerate(source)):
            if isinstance(item, (dict, list)):
                target[key] = {} if isinstance(item, dict) else [None] * len(item)
                stack.append((item, target[key]))
            else:
                target[key] = item
    return root


def is_object_schema(schema: dict) -> bool:
    kind = schema.get("type")
    if kind is None:
        return "properties" in schema
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema without `additionalProperties` (or
    `unevaluatedProperties`) has `additionalProperties: false`."""
    root = copy_json(schema)
    stack: list[tuple[Any, bool]] = [(root, True)]
    while stack:
        node, closable = stack.pop()
        if not isinstance(node, dict):
            continue
        if (closable and is_object_schema(node) and "additionalProperties" not in node
                and "unevaluatedProperties" not in node):
            node["additionalProperties"] = False
        for key, value in node.items():
            if key in ONE and isinstance(value, dict):
                stack.append((value, True))
            elif key in LISTS and isinstance(value, list):
                stack.extend((item, True) for item in value)
            elif key in MAPS and isinstance(value, dict):
                stack.extend((item, True) for item in value.values())
            elif key == "allOf" and isinstance(value, list):
                stack.extend((item, False) for item in value)
    return root
