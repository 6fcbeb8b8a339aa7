"""The request fields that ask for guided decoding, and the one GuideSpec they come to.

Three spellings reach the same feature: OpenAI's `response_format`, vLLM's current
`structured_outputs` object (vLLM >= 0.12), and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, which clients still send.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from atom.server.errors import APIError

GuideKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class GuideSpec:
    kind: GuideKind
    value: Any  # a JSON schema, a regex, a list of choices, an EBNF grammar; None for json_object
    param: str  # the request field it came from, named in errors


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None


class GuidedFields(BaseModel):
    """Mixed into the completions and chat requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    def guide_spec(self) -> GuideSpec | None:
        """What the request asks its output to follow; a 400 when it asks for two things."""
        specs = [*self._response_format_specs(), *self._structured_output_specs()]
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                specs.append(GuideSpec(kind, value, f"guided_{kind}"))
        if len(specs) > 1:
            fields = ", ".join(spec.param for spec in specs)
            raise APIError(
                400, f"give one output constraint, not several: {fields}", param=specs[1].param
            )
        return specs[0] if specs else None

    def _response_format_specs(self) -> list[GuideSpec]:
        response_format = self.response_format
        if response_format is None or response_format.type == "text":
            return []
        if response_format.type == "json_object":
            return [GuideSpec("json_object", None, "response_format")]
        if response_format.json_schema is None:
            raise APIError(
                400,
                "response_format of type json_schema needs a json_schema",
                param="response_format.json_schema",
            )
        schema = response_format.json_schema.json_schema
        return [GuideSpec("json", schema, "response_format.json_schema.schema")]

    def _structured_output_specs(self) -> list[GuideSpec]:
        outputs = self.structured_outputs
        if outputs is None:
            return []
        specs = [
            GuideSpec(kind, value, f"structured_outputs.{kind}")
            for kind, value in (
                ("json", outputs.json_),
                ("regex", outputs.regex),
                ("choice", outputs.choice),
                ("grammar", outputs.grammar),
            )
            if value is not None
        ]
        if outputs.json_object:
            specs.append(GuideSpec("json_object", None, "structured_outputs.json_object"))
        return specs
