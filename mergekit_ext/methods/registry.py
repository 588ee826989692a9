"""Registration of mergekit-ext's methods with mergekit, plus the metadata mergekit lacks.

mergekit knows a method by its :class:`~mergekit.merge_methods.MergeMethodSpec` (name,
parameters). We also need to know whether a method needs calibration data, which
executor runs it, and which paper it implements; :class:`MethodInfo` holds that.

Adding a method: one new module in ``mergekit_ext/methods/`` that builds a
``MethodInfo`` and a mergekit ``MergeMethod``, plus one line in
``mergekit_ext/methods/__init__.py`` that imports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import mergekit.merge_methods as mk_methods
from mergekit.merge_methods.base import MergeMethod

LOG = logging.getLogger(__name__)

# "tensorwise": mergekit's planner/executor runs it one tensor at a time.
# "layerwise": mergekit-ext's sequential executor runs it block by block with calibration data.
# "adaptation": test-time adaptation over whole models (SyMerge).
MethodKind = Literal["tensorwise", "layerwise", "adaptation"]


@dataclass(frozen=True)
class ParameterDoc:
    name: str
    default: Any
    description: str


@dataclass(frozen=True)
class MethodInfo:
    name: str
    pretty_name: str
    kind: MethodKind
    needs_calibration: bool
    paper: str
    paper_url: str
    parameters: tuple[ParameterDoc, ...] = field(default_factory=tuple)
    # For layerwise/adaptation methods: the object the executor calls (see methods/layerwise.py).
    implementation: Optional[Any] = None

    @property
    def parameter_names(self) -> set[str]:
        return {p.name for p in self.parameters}


_INFOS: dict[str, MethodInfo] = {}


def register_method(info: MethodInfo, mergekit_method: MergeMethod) -> None:
    """Register ``mergekit_method`` with mergekit and ``info`` with mergekit-ext.

    Idempotent for the same name (importing the package twice must not fail).
    """
    if mergekit_method.spec.name != info.name:
        raise ValueError(
            f"MethodInfo name {info.name!r} != mergekit spec name {mergekit_method.spec.name!r}"
        )
    if info.name not in {m.spec.name for m in mk_methods.registered_methods()}:
        mk_methods.register(mergekit_method)
    _INFOS[info.name] = info


def ext_method_info(name: str) -> Optional[MethodInfo]:
    """mergekit-ext's metadata for ``name``, or None for mergekit's own methods."""
    return _INFOS.get(name)


def ext_methods() -> tuple[MethodInfo, ...]:
    return tuple(_INFOS.values())


def all_method_names() -> list[str]:
    return sorted(m.spec.name for m in mk_methods.registered_methods())


def describe_method(name: str) -> dict[str, Any]:
    """A plain description of any registered method (mergekit's or ours), for ``methods``."""
    mk = mk_methods.get(name)
    info = _INFOS.get(name)
    params = []
    docs = {p.name: p for p in info.parameters} if info else {}
    for p in mk.spec.parameters:
        default = None if p.required else p.default
        doc = docs.get(p.name)
        params.append(
            {
                "name": p.name,
                "scope": p.scope.value,
                "required": p.required,
                "default": doc.default if doc is not None else _plain(default),
                "description": doc.description if doc is not None else (p.description or ""),
            }
        )
    for p in docs.values():  # parameters that only our executor reads
        if p.name not in {q["name"] for q in params}:
            params.append(
                {
                    "name": p.name,
                    "scope": "shared",
                    "required": False,
                    "default": p.default,
                    "description": p.description,
                }
            )
    return {
        "name": name,
        "pretty_name": (info.pretty_name if info else mk.spec.pretty_name) or name,
        "source": "mergekit-ext" if info else "mergekit",
        "kind": info.kind if info else "tensorwise",
        "needs_calibration": bool(info and info.needs_calibration),
        "needs_base_model": mk.spec.contract.base.value == "required",
        "paper": (info.paper if info else "") or "",
        "paper_url": (info.paper_url if info else mk.spec.reference_url) or "",
        "parameters": params,
    }


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def executor_only_method(info: MethodInfo, parameter_types: dict[str, Any]) -> MergeMethod:
    """The mergekit-side face of a layerwise/adaptation method.

    mergekit's registry needs a ``MergeMethod`` so that ``mergekit-ext methods`` and YAML
    validation see the method and its parameters. Such a method cannot run one tensor at a
    time, so mergekit's own executor (``mergekit-yaml``, ``mergekit.merge.run_merge``) gets a
    clear error while planning, before it writes anything, pointing to ``mergekit-ext run``
    and :func:`mergekit_ext.run_merge`.

    ``parameter_types`` maps each parameter to its Python type (``float``, ``bool``,
    ``Literal[...]``, ``Optional[list[float]]`` ...); defaults come from ``info.parameters``.
    """
    from mergekit.merge_methods.base import (
        BasePolicy,
        GroupMergeMethod,
        InputContract,
        MergeMethodSpec,
        ParameterScope,
        ParameterSpec,
        TensorGroup,
    )

    from mergekit_ext.errors import MergekitExtError

    defaults = {p.name: p.default for p in info.parameters}
    missing = set(parameter_types) ^ set(defaults)
    if missing:
        raise ValueError(f"{info.name}: parameter types and docs disagree on {sorted(missing)}")
    spec = MergeMethodSpec(
        name=info.name,
        pretty_name=info.pretty_name,
        reference_url=info.paper_url,
        contract=InputContract(base=BasePolicy.REQUIRED, min_inputs=2),
        parameters=tuple(
            ParameterSpec(
                name=name,
                value_type=ty,
                scope=ParameterScope.SHARED,
                default=defaults[name],
            )
            for name, ty in parameter_types.items()
        ),
    )

    message = (
        f"merge method {info.name!r} needs data and runs on mergekit-ext's own executor, not "
        "on mergekit's (mergekit's `run_merge` / `mergekit-yaml` merge one tensor at a time and "
        "drop the YAML's `calibration:` section): run the same YAML with `mergekit-ext run "
        "CONFIG OUT`, or from Python with `mergekit_ext.run_merge(CONFIG, OUT)`"
    )

    class _ExecutorOnly(GroupMergeMethod):
        def __init__(self) -> None:
            self.spec = spec

        # mergekit's planner validates every tensor's inputs before it writes anything:
        # the earliest point at which mergekit calls a method.
        def validate_inputs(self, *args: Any, **kwargs: Any) -> None:
            raise MergekitExtError(message)

        def merge_group(self, group: TensorGroup, /, **parameters: Any):  # type: ignore[override]
            raise MergekitExtError(message)

    return _ExecutorOnly()
