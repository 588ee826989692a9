"""Values of mergekit's own methods' parameters, checked before anything loads.

mergekit declares each parameter's type (``ParameterSpec.value_type``) and validates a
value only when a tensor needs it, mid-merge, with a raw pydantic error that names no model;
it declares no ranges, so ``density: 1.7`` merges silently (as if 1). Here every value of
the YAML (scalars, gradients, ``{filter, value}`` lists) goes through mergekit's own type
validation, must be finite, and must lie in the range its method defines (docs/methods.md,
"Validation of mergekit's parameters").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Optional

from mergekit_ext.errors import ConfigError

# (low, high) inclusive, by parameter name (and by method where it differs): what the
# methods define. density/gamma/select_topk are fractions of a tensor's entries; slerp's t
# interpolates between two models; della's epsilon spreads the drop probabilities around
# density (its own check: density ± epsilon in (0, 1), below).
_RANGES: dict[str, tuple[Optional[float], Optional[float]]] = {
    "density": (0.0, 1.0),
    "gamma": (0.0, 1.0),
    "select_topk": (0.0, 1.0),
    "epsilon": (0.0, None),
    "eps": (0.0, None),
    "tol": (0.0, None),
    "max_iter": (1, None),
}
_METHOD_RANGES: dict[tuple[str, str], tuple[Optional[float], Optional[float]]] = {
    ("slerp", "t"): (0.0, 1.0),
    ("della", "epsilon"): (0.0, 1.0),
    ("della_linear", "epsilon"): (0.0, 1.0),
}


def _scalars(setting: Any) -> Iterator[Any]:
    """Every scalar of a mergekit parameter setting: a scalar, a gradient (list of
    scalars), a ``{filter, value}`` mapping or a list of them."""
    if isinstance(setting, dict):
        if "value" in setting:
            yield from _scalars(setting["value"])
        else:
            yield setting  # a mapping without `value`: its type check names it
    elif isinstance(setting, (list, tuple)):
        for item in setting:
            yield from _scalars(item)
    else:
        yield setting


def _describe_range(low: Optional[float], high: Optional[float]) -> str:
    return f"[{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}]"


def check_values(
    method: str, where: str, values: dict[str, Any], inherited: Optional[dict[str, Any]] = None
) -> None:
    """Check the parameters of one YAML site (``parameters:`` of the config, a model or a
    slice source) for mergekit's ``method``; unknown names are left to the name check.

    Args:
        method: a mergekit merge method name (``ties``, ``slerp``, ...).
        where: how the error names the site (``models[1] (./b).parameters``).
        values: the site's mapping of parameter name to setting.
        inherited: the config's global ``parameters:`` (for checks across parameters).

    Raises:
        ConfigError: naming the site, the parameter, the value and what is allowed.
    """
    from pydantic import ValidationError

    from mergekit_ext.methods.registry import mergekit_method

    specs = {p.name: p for p in mergekit_method(method).spec.parameters}
    for name, setting in values.items():
        spec = specs.get(name)
        if spec is None:
            continue
        low, high = _METHOD_RANGES.get((method, name), _RANGES.get(name, (None, None)))
        kind = getattr(spec.value_type, "__name__", str(spec.value_type))
        for raw in _scalars(setting):
            try:
                value = spec.validate(raw)
            except ValidationError:
                numeric = kind in ("float", "int")
                hint = (
                    f" in {_describe_range(low, high)}; write a number such as 0.5, a gradient "
                    "[0.2, 0.8], or a list of {filter: ..., value: ...}"
                    if numeric
                    else ""
                )
                raise ConfigError(
                    f"{where}: {name}: {raw!r} is not a valid value for {method}'s {name}, "
                    f"which takes a {kind}{hint}"
                ) from None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                raise ConfigError(f"{where}: {name} is {raw!r}; {method} needs a finite number")
            if (low is not None and value < low) or (high is not None and value > high):
                raise ConfigError(
                    f"{where}: {name} is {value:g}, outside {_describe_range(low, high)} "
                    f"({method}'s {name}; docs/methods.md, \"Validation of mergekit's parameters\")"
                )
    if method in ("della", "della_linear"):
        merged = {**(inherited or {}), **values}
        density = merged.get("density", specs["density"].default)
        epsilon = merged.get("epsilon", specs["epsilon"].default)
        _check_della(where, density, epsilon)


def _check_della(where: str, density: Any, epsilon: Any) -> None:
    """della's drop probabilities ``density ± epsilon`` must lie in (0, 1) (mergekit checks
    this per tensor, mid-merge) unless density is 0 or 1, which della takes as is."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (density, epsilon)):
        return
    if 0 < density < 1 and not (density - epsilon > 0 and density + epsilon < 1):
        raise ConfigError(
            f"{where}: della needs density ± epsilon inside (0, 1); density {density:g} with "
            f"epsilon {epsilon:g} gives [{density - epsilon:g}, {density + epsilon:g}]: lower "
            "epsilon or move density away from 0 and 1"
        )
