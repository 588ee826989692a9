"""One declaration per method parameter: a pydantic model from which everything is derived.

Each method declares its parameters once, as a :class:`MethodParameters` subclass whose
fields carry the default, the type, the allowed range (``ge``/``le``/``gt``/``lt``) and the
description (``Field(description=...)``). From that one declaration come:

- the ``mergekit-ext methods`` listing and the card's parameter table (:meth:`docs`);
- mergekit's :class:`~mergekit.merge_methods.base.ParameterSpec` tuple, so mergekit's own
  validation sees the same types and ranges (:meth:`mergekit_specs`);
- validation with a message that names the field, the value and the range, run on the
  YAML before anything loads (:meth:`parse`), whose typed result the executor hands to the
  method (parsed once per merge, not per tensor).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from mergekit_ext.errors import ConfigError

P = TypeVar("P", bound="MethodParameters")


@dataclass(frozen=True)
class ParameterDoc:
    """One parameter as users see it (``methods`` listing, card table)."""

    name: str
    default: Any
    description: str
    allowed: str = ""  # e.g. "[0, 1]" or "pinv | solve"; empty when any value of the type goes


def describe_allowed(field: FieldInfo) -> str:
    """The allowed values of ``field`` in words: an interval from its bounds, or the choices;
    for a union (``ridge: auto | [0, inf)``) every member's."""
    from typing import Union, get_origin

    if get_origin(field.annotation) is Union and not any(
        hasattr(m, a) for m in field.metadata for a in ("ge", "gt", "le", "lt")
    ):
        parts = [_describe_member(arg) for arg in _union_args(field.annotation)]
        if len([p for p in parts if p]) > 1:
            return " | ".join(p for p in parts if p)
    return _interval(field.metadata) or " | ".join(
        str(c) for c in _literal_choices(field.annotation)
    )


def _union_args(annotation: Any) -> tuple[Any, ...]:
    from typing import get_args

    return tuple(a for a in get_args(annotation) if a is not type(None))


def _describe_member(annotation: Any) -> str:
    """One member of a union: its choices, or the interval of ``Annotated[float, Field(...)]``."""
    from typing import Annotated, get_args, get_origin

    if get_origin(annotation) is Annotated:
        metadata = []
        for m in get_args(annotation)[1:]:
            metadata += list(getattr(m, "metadata", [])) or [m]
        return _interval(metadata) or get_args(annotation)[0].__name__
    choices = _literal_choices(annotation)
    if choices:
        return " | ".join(str(c) for c in choices)
    return getattr(annotation, "__name__", "")


def _interval(metadata: Any) -> str:
    """``[lo, hi)`` from ``ge``/``gt``/``le``/``lt`` constraints ('' without any)."""
    lo, hi, lo_open, hi_open = None, None, False, False
    for m in metadata:
        for attr, is_open in (("ge", False), ("gt", True)):
            if getattr(m, attr, None) is not None:
                lo, lo_open = getattr(m, attr), is_open
        for attr, is_open in (("le", False), ("lt", True)):
            if getattr(m, attr, None) is not None:
                hi, hi_open = getattr(m, attr), is_open
    if lo is None and hi is None:
        return ""
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    return (
        f"{left}{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}{right}"
    )


def _literal_choices(annotation: Any) -> list[Any]:
    from typing import Literal, Union, get_args, get_origin

    origin = get_origin(annotation)
    if origin is Literal:
        return list(get_args(annotation))
    if origin is Union:
        return [c for arg in get_args(annotation) for c in _literal_choices(arg)]
    return []


StatisticsDtype = Literal["float64", "float32"]


def statistics_dtype_field() -> Any:
    """The ``statistics_dtype`` parameter of the layerwise methods (one declaration)."""
    return Field(
        "float64",
        description="dtype of the running sums of the calibration statistics (Grams, means): "
        "float64 | float32, which halves the memory of every in x in Gram (for very wide "
        "layers) at float32 rounding of the sums",
    )


ComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]


def compute_dtype_field() -> Any:
    """The ``compute_dtype`` parameter of the layerwise methods (one declaration)."""
    return Field(
        "auto",
        description="dtype of the block forward passes (expert and merged paths): auto | "
        "float32 | bfloat16 | float16; the linears (and attention) run in it with float32 "
        "accumulation, the residual stream and the hidden states carried between blocks stay "
        "float32, the Grams keep float32-or-wider sums; auto: bfloat16 where the checkpoints "
        "are bfloat16 and the device has fast bfloat16 (CPU avx512_bf16 / AMX, CUDA "
        'is_bf16_supported), else float32 (docs/methods.md, "Compute dtype")',
    )


class MethodParameters(BaseModel):
    """Base of every method's parameter model: frozen, unknown keys ignored.

    Unknown keys are ignored here because ``checks.check_parameter_names`` already warns
    about them with a did-you-mean hint (mergekit's methods ignore them too).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    @classmethod
    def parse(cls: type[P], values: Mapping[str, Any] | None, method: str) -> P:
        """Validate ``values`` (absent or null: the default).

        Args:
            values: the YAML's ``parameters:`` mapping (or a subset of it).
            method: the method's name, for the message.

        Returns:
            The typed, frozen parameters.

        Raises:
            ConfigError: naming the field, the value given and what is allowed.
        """
        if isinstance(values, cls):
            return values
        given = {k: v for k, v in (values or {}).items() if v is not None}
        for name, value in given.items():
            field = cls.model_fields.get(name)
            if isinstance(value, bool) and field is not None and not _allows_bool(field):
                # pydantic's lax mode reads true as 1.0: a number was meant, or a typo
                allowed = describe_allowed(field)
                raise ConfigError(
                    f"{method}: parameters.{name} = {value!r} is not valid: true/false is "
                    f"not a value of {name}{f' (allowed: {allowed})' if allowed else ''}; "
                    "fix it in the YAML's parameters: section"
                )
        try:
            return cls.model_validate(given)
        except ValidationError as e:
            first = e.errors()[0]
            if not first["loc"]:  # a rule across fields (a model validator): its own words
                message = first["msg"].removeprefix("Value error, ")
                raise ConfigError(
                    f"{method}: parameters: {message}; fix it in the YAML's parameters: section"
                ) from e
            name = str(first["loc"][0])
            field = cls.model_fields.get(name)
            allowed = describe_allowed(field) if field is not None else ""
            where = f" (allowed: {allowed})" if allowed else ""
            # a Union (ridge: auto or a number): pydantic's first message names one branch
            branches = sum(1 for err in e.errors() if err["loc"][:1] == (name,))
            why = "it is none of the allowed values" if branches > 1 else first["msg"].lower()
            raise ConfigError(
                f"{method}: parameters.{name} = {given.get(name)!r} is not valid: "
                f"{why}{where}; fix it in the YAML's parameters: section"
            ) from e

    @classmethod
    def docs(cls) -> tuple[ParameterDoc, ...]:
        """Every parameter with its default, description and allowed values."""
        return tuple(
            ParameterDoc(
                name,
                _plain(field.get_default(call_default_factory=True)),
                field.description or "",
                describe_allowed(field),
            )
            for name, field in cls.model_fields.items()
        )

    @classmethod
    def mergekit_specs(cls) -> tuple[Any, ...]:
        """mergekit ``ParameterSpec`` s (shared scope) with the same types and constraints."""
        from mergekit.merge_methods.base import ParameterScope, ParameterSpec

        specs = []
        for name, field in cls.model_fields.items():
            value_type: Any = field.annotation
            if field.metadata:
                value_type = Annotated[(value_type, *field.metadata)]
            specs.append(
                ParameterSpec(
                    name=name,
                    value_type=value_type,
                    scope=ParameterScope.SHARED,
                    default=field.get_default(call_default_factory=True),
                    description=field.description,
                )
            )
        return tuple(specs)


def _allows_bool(field: FieldInfo) -> bool:
    from typing import Union, get_args, get_origin

    def allows(annotation: Any) -> bool:
        if annotation is bool or annotation is Any:
            return True
        if get_origin(annotation) in (Union, Annotated):
            return any(allows(a) for a in get_args(annotation))
        return False

    return allows(field.annotation)


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value
