"""``tool_choice: "required"`` or a named function: decoding constrained to one call.

The output is forced to be exactly one call in the model's markup
(:meth:`freetoken.server.tool_call_formats.ToolCallFormat.call_rules`), e.g. for the
Hermes format::

    <tool_call>\\n{"name": "NAME", "arguments": {JSON object}}\\n</tool_call>

The whole call is one llguidance grammar (:func:`call_grammar`: a Lark rule per allowed
function -- one for a named choice, every offered tool for ``required`` -- its arguments a
``%json`` rule of the function's ``parameters`` schema, or any JSON object without one),
run by :class:`freetoken.server.schema_constraint.SchemaConstraint`: the arguments follow
the schema (property names, required properties, types, enums, ...), the masks are
computed off the engine step, and the call is kept closable within ``max_tokens`` as a
json_schema answer is.
"""

from __future__ import annotations

from typing import Any, Optional

from freetoken.server.schema_constraint import SchemaConstraint, lark_grammar, schema_constraint, schema_for_lark
from freetoken.server.tool_call_formats import ToolCallFormat


def call_grammar(fmt: ToolCallFormat, schemas: dict[str, Optional[dict[str, Any]]]) -> str:
    """The llguidance grammar of one call to any function of ``schemas`` (name -> parameters
    schema; None: any object). Raises SchemaError naming what the schemas use that
    llguidance does not support."""

    def schema_json(schema: Optional[dict[str, Any]]) -> str:
        return schema_for_lark(schema if schema is not None else {"type": "object"})

    rules = [fmt.call_rules(f"call_{i}", name, schema, schema_json)
             for i, (name, schema) in enumerate(sorted(schemas.items()))]
    start = "start: " + " | ".join(f"call_{i}" for i in range(len(rules))) + "\n"
    return lark_grammar(start + "".join(rules))


def tool_call_constraint(tokenizer: Any, grammar: str, fmt: Optional[ToolCallFormat] = None) -> SchemaConstraint:
    """A fresh constraint for one choice: one call following ``grammar`` (:func:`call_grammar`),
    closed the way ``fmt``'s arguments close (None: JSON arguments)."""
    return schema_constraint(tokenizer, grammar, fmt.closing_walk if fmt is not None else None)
