"""Structured-output request pieces: OpenAI's `response_format` and vLLM's `structured_outputs`
(server/api/structured.py turns them into the engine's `StructuredSpec`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from server.openai.fields import Lenient, refused


class JSONSchemaFormat(Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # none: any JSON object
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self


class StructuredOutputs(Lenient):
    """vLLM's `structured_outputs`: exactly one of the constraints."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON schema (object or text)
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None  # EBNF / Lark
    json_object: bool | None = None
    structural_tag: refused() = None
    whitespace_pattern: refused() = None
    disable_fallback: refused(False) = None
    disable_any_whitespace: refused(False) = None
    disable_additional_properties: refused(False) = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        chosen = [name for name, _ in self.chosen()]
        if len(chosen) != 1:
            raise ValueError("set exactly one of json, regex, choice, grammar, json_object "
                             f"(got {', '.join(chosen) or 'none'})")
        return self

    def chosen(self) -> list[tuple[str, Any]]:
        """(name, value) of each constraint set."""
        constraints = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                       "json_object": self.json_object}
        return [(name, value) for name, value in constraints.items() if value not in (None, False)]
