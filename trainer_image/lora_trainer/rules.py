"""Cross-field rules, each declared once, next to the model it is about.

A check that reads more than one field (or that a field's own type and bounds cannot express) is a
`Rule` in the `__rules__` of the model that holds those fields. Two readers, one declaration:
`config.ApiModel`'s validator runs every `check` (the trainer, run-local and the operator parse
specs with it), and `lora_operator.crdgen` writes every `cel` into the CRD's
`x-kubernetes-validations` at the schema node of that same model (the API server runs them on
`kubectl apply`). Both report a broken rule as `<path of field>: <message>`, in the same words.
Light on purpose (pydantic only): the trainer's config layer and the operator import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

#: The pydantic error type of a broken rule (`err["type"]`), so that callers can tell them apart.
RULE_ERROR = "rule"


@dataclass(frozen=True)
class Rule:
    """One cross-field rule of a model.

    `field` is the wire (camelCase) path, from the declaring model, of the field the error is
    reported at: the CRD rule's `fieldPath` and the pydantic error's location. `cel` is true when
    the object is valid, with `self` the declaring model's object as the API server holds it
    (defaults applied, unset optional fields absent: test them with `has()`); `check` is the
    same condition on the validated model. `message` says what is wrong and the fix, naming fields
    as the declaring model does; it starts with `field`, so it names the field wherever it is read.
    """

    field: str
    cel: str
    check: Callable[[Any], bool]
    message: str

    def __post_init__(self) -> None:
        if not self.message.startswith(self.field):
            raise ValueError(f"a rule's message starts with its field {self.field!r}: {self.message!r}")


@cache
def declared_rules(model: type[BaseModel]) -> tuple[Rule, ...]:
    """The rules of `model` and its bases (a subclass keeps its bases' rules, as it keeps their fields)."""
    return tuple(rule for cls in reversed(model.__mro__) for rule in cls.__dict__.get("__rules__", ()))


def _value_at(obj: Any, path: str) -> Any:
    """The value at a wire path of a model (None past an unset optional model)."""
    for part in path.split("."):
        if obj is None:
            return None
        fields = type(obj).model_fields
        obj = getattr(obj, next(name for name, f in fields.items() if (f.alias or name) == part))
    return obj


def enforce_rules(obj: BaseModel) -> None:
    """Raise one ValidationError listing every broken rule of `obj`, each at its field's location
    (pydantic prefixes the location of `obj` itself as the error travels up)."""
    broken = [rule for rule in declared_rules(type(obj)) if not rule.check(obj)]
    if broken:
        raise ValidationError.from_exception_data(type(obj).__name__, [
            InitErrorDetails(type=PydanticCustomError(RULE_ERROR, rule.message), loc=tuple(rule.field.split(".")),
                             input=_value_at(obj, rule.field))
            for rule in broken
        ])
