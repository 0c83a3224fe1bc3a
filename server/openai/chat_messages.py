"""Chat request pieces, in OpenAI's shapes: messages (with tool calls and results) and function
tools. What pdserve does not implement is refused by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from server.openai.fields import Lenient, one_of, refused

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function (and response format) names


class TextPart(Lenient):
    type: str
    text: str | None = None


Content = Annotated[str | list[TextPart] | None, one_of("a string or a list of text parts")]


class CalledFunction(Lenient):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Lenient):
    """A call an assistant made in an earlier turn."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Lenient):
    role: str
    content: Content = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    function_call: refused(hint="; send tool_calls") = None
    audio: refused() = None
    refusal: refused() = None

    @field_validator("role")
    @classmethod
    def _no_function_role(cls, role: str) -> str:
        if role == "function":
            raise ValueError("role 'function' (the deprecated function calling) is not supported; use "
                             "role 'tool' with tool_call_id")
        return role


class FunctionDefinition(Lenient):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: a function without arguments
    strict: bool | None = None  # the arguments always follow `parameters` when it is forced (tool_choice)


class Tool(Lenient):
    type: str
    function: FunctionDefinition | None = None

    @model_validator(mode="after")
    def _function_tool(self) -> Tool:
        if self.type != "function":
            raise ValueError(f"only function tools are supported by pdserve (this one is {self.type!r})")
        if self.function is None:
            raise ValueError("a function tool needs its function")
        return self


class ChosenFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None,
                       one_of('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')]
