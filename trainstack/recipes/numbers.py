"""The recipe schema's number types: finite, real numbers (never text or booleans), bounded.

    PosInt, NonNegInt          integers > 0 / >= 0, at most INT_CEILING
    PosFloat, NonNegFloat      finite floats > 0 / >= 0, at most FLOAT_CEILING (-0.0 is read as 0.0)
    Fraction, Percent          (0, 1] and (0, 100]
    Max(limit, why), Min(...)  a field's own bound, with the reason its error states

A field takes one of the types and, for its own upper bound, `Max`: `steps: Annotated[PosInt, Max(10_000_000,
"10x Llama 3 405B's ~1M steps")]`. The ceilings are a backstop for a field that names no bound of its own;
every field of the recipe names one (tests/unit/test_recipe_bounds.py walks the schema for it), each from
what AWS allows, what the hardware holds, or a stated factor on published runs.

Why so strict: YAML reads `.inf`, `.nan` and `1e308` as floats and pydantic accepts them where any float
goes; `"20000"` and `true` pass as numbers in pydantic's lax mode. Each has reached the planner and
crashed it (ZeroDivisionError on an infinite price) or made it print absurd figures (a 1e20-step run
costing 5.9e18 USD; a node MTBF of 1e-300 h planned as "FITS").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import core_schema

# What a field without its own bound can hold: an int32 (every count the trainer, CloudWatch and JSON
# consumers handle) and a float far above any rate, price or size a run has.
INT_CEILING = 2**31 - 1
FLOAT_CEILING = 1e15


def _real_number(kind: str) -> BeforeValidator:
    """Refuse what is not a real number before pydantic's lax mode would convert it; `kind` names what
    the field takes ("an integer", "a number") in the error."""

    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"expected {kind}, got {str(value).lower()} (a boolean)")
        if isinstance(value, str):
            raise ValueError(f"expected {kind}, got the text {value!r} (write it without quotes)")
        if isinstance(value, float):
            if math.isnan(value) or math.isinf(value):
                raise ValueError(f"expected a finite number, got {value}")
            if value == 0.0:
                return 0.0  # -0.0 reads as 0: nothing downstream should print or divide by a negative zero
        return value

    return BeforeValidator(check)


def _judged(value: Any) -> bool:
    """Whether a bound can judge `value` (a finite real number); anything else is left to the type."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: float) -> str:
    if isinstance(value, int) and abs(value) < 10**16:
        return f"{value:,}"
    return f"{value:,g}" if abs(value) < 1e16 else f"{value:.3g}"


@dataclass(frozen=True)
class Max:
    """A field's upper bound and why: the error reads `1e+20 is above 10,000,000, the most this field
    allows (10x ...)`. Judged before the type's own checks, so the field's reason wins over a ceiling."""

    limit: float
    why: str

    def check(self, value: Any) -> Any:
        if _judged(value) and value > self.limit:
            raise ValueError(
                f"{_shown(value)} is above {_shown(self.limit)}, the most this field allows ({self.why})"
            )
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> Any:
        json_schema = handler(schema)
        json_schema["maximum"] = self.limit
        return json_schema


@dataclass(frozen=True)
class Min:
    """A field's lower bound (above the type's own 0) and why; `exclusive`: the limit itself is refused."""

    limit: float
    why: str
    exclusive: bool = False

    def check(self, value: Any) -> Any:
        if _judged(value) and (value <= self.limit if self.exclusive else value < self.limit):
            relation = "at or below" if self.exclusive else "below"
            least = "above" if self.exclusive else "at least"
            raise ValueError(
                f"{_shown(value)} is {relation} {_shown(self.limit)}: this field must be {least} "
                f"{_shown(self.limit)} ({self.why})"
            )
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> Any:
        json_schema = handler(schema)
        json_schema["exclusiveMinimum" if self.exclusive else "minimum"] = self.limit
        json_schema.pop("minimum" if self.exclusive else "exclusiveMinimum", None)
        return json_schema


_INTEGER, _REAL = _real_number("an integer"), _real_number("a number")
_INT_CEILING = Max(INT_CEILING, "a 32-bit integer")
_FLOAT_CEILING = Max(FLOAT_CEILING, "no setting of a run is larger")

# The constraints first (they are the JSON Schema editors read), then the checks that run before them.
PosInt = Annotated[int, Field(gt=0), _INTEGER, _INT_CEILING]
NonNegInt = Annotated[int, Field(ge=0), _INTEGER, _INT_CEILING]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False), _REAL, _FLOAT_CEILING]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False), _REAL, _FLOAT_CEILING]
Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False), _REAL]
Percent = Annotated[float, Field(gt=0, le=100, allow_inf_nan=False), _REAL]

NUMBER_TYPES = {"PosInt": PosInt, "NonNegInt": NonNegInt, "PosFloat": PosFloat, "NonNegFloat": NonNegFloat}
NUMBER_TYPES |= {"Fraction": Fraction, "Percent": Percent}
