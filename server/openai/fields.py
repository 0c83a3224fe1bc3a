"""What a request body's fields that pdserve does not implement get: never silence.

- `refused(...)`: a field of OpenAI's (or vLLM's) API that pdserve does not implement: null or a
  value that asks for nothing passes; anything else is a 400 naming the field.
- `Lenient`: the base of every request model. A field of no API at all (a typo) is ignored, as
  OpenAI and vLLM do, and logged once per name and model."""

from __future__ import annotations

import functools
import json
import logging
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

log = logging.getLogger(__name__)


def one_of(expected: str) -> WrapValidator:
    """Replace pydantic's one-error-per-union-member report by one message naming what is accepted."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("wrong_type", f"must be {expected}") from None

    return WrapValidator(validate)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _same(value: Any, accepted: Any) -> bool:
    """Equal, numbers as numbers (`1` is `1.0`), anything else of the same type too (`0 == False` in
    Python, but `store: 0` is not `store: false`)."""
    if _number(value) and _number(accepted):
        return value == accepted
    return type(value) is type(accepted) and value == accepted


def refused(*accepted: Any, hint: str = "") -> Any:
    """The type of a field pdserve refuses unless it is null or one of `accepted` (values that ask
    for nothing). Left out of every dump: it never reaches the engine."""
    allowed = ", ".join(["null", *(json.dumps(a) for a in accepted)])

    def check(value: Any) -> Any:
        if value is None or any(_same(value, a) for a in accepted):
            return value
        raise ValueError(f"not supported by pdserve (accepted: {allowed}){hint}")

    return Annotated[Any, AfterValidator(check), Field(exclude=True)]


@functools.cache  # once per process, model and name
def _warn_once(model: str, name: str) -> None:
    log.warning("%s: ignoring unknown field '%s' (no API pdserve implements has it; a typo?)", model, name)


class Lenient(BaseModel):
    """Unknown fields are ignored, each name logged once."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in sorted({k for k in data if isinstance(k, str)} - _known_names(cls)):
                _warn_once(cls.__name__, name)
        return data


@functools.cache
def _known_names(model: type[BaseModel]) -> frozenset[str]:
    fields = model.model_fields
    return frozenset(fields) | {f.alias for f in fields.values() if f.alias}
