"""Registration of mergekit-ext's methods with mergekit, plus the metadata mergekit lacks.

mergekit knows a method by its :class:`~mergekit.merge_methods.MergeMethodSpec` (name,
parameters). We also need to know whether a method needs calibration data, which
executor runs it (its kind, ``methods/kinds.py``), and which paper it implements;
:class:`MethodInfo` holds that.

Adding a method: one new module in ``mergekit_ext/methods/`` that declares its parameters
(one :class:`~mergekit_ext.methods.parameters.MethodParameters` model), builds a
``MethodInfo`` and registers it (:func:`tensorwise_method` or :func:`data_aware_method`
derive mergekit's side from the same model), plus one line in
``mergekit_ext/methods/__init__.py`` that imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import mergekit.merge_methods as mk_methods
import torch
from mergekit.merge_methods.base import MergeMethod

from mergekit_ext.methods.kinds import TENSORWISE, MethodKind, Tensorwise
from mergekit_ext.methods.parameters import MethodParameters, ParameterDoc

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class MethodReport:
    """How a method's diagnostics appear on the model card.

    - ``title``: the card section's heading;
    - ``summarize(section, parameters)``: the method's diagnostics section (the JSON) and its
      typed parameters → the numbers the template shows;
    - ``plot(section, images_dir, parameters)``: draws the figures into ``images_dir`` and
      returns their :class:`~mergekit_ext.plots.Plot` records (None: no plots);
    - ``template``: ``model_cards/sections/<template>.md.j2`` renders the summary; None shows
      it as a plain table of its top-level numbers, so a new method needs no template.
    """

    title: str
    summarize: Callable[[Any, Any], dict[str, Any]]
    plot: Optional[Callable[[Any, str, Any], list[Any]]] = None
    template: Optional[str] = None


@dataclass(frozen=True)
class MethodInfo:
    name: str
    pretty_name: str
    # How it runs: Tensorwise(), Layerwise(its LayerwiseMethod) or Adaptation(its run)
    # (methods/kinds.py); the runner picks the executor by the kind's type.
    kind: MethodKind
    needs_calibration: bool
    paper: str
    paper_url: str
    # The one declaration of the method's parameters (see methods/parameters.py).
    parameters_model: type[MethodParameters] = MethodParameters
    # Its model-card section and plots (None: the card lists the section without a summary).
    report: Optional[MethodReport] = None

    @property
    def implementation(self) -> Any:
        """The object the executor calls: a layer-wise kind's ``method``, an adaptation kind's
        ``run``, None for a tensor-wise method (read-only, for callers of the field this was)."""
        return getattr(self.kind, "method", None) or getattr(self.kind, "run", None)

    @property
    def parameters(self) -> tuple[ParameterDoc, ...]:
        return self.parameters_model.docs()

    @property
    def parameter_names(self) -> set[str]:
        return set(self.parameters_model.model_fields)

    def parse_parameters(self, values: Any) -> MethodParameters:
        """The YAML's ``parameters:`` validated into the typed model (``ConfigError`` if not)."""
        return self.parameters_model.parse(values, self.name)


_INFOS: dict[str, MethodInfo] = {}
# Each of our methods' mergekit face (its ``MergeMethod``: name, parameter specs). Only the
# tensor-wise ones go into mergekit's own registry: mergekit's contract for a registered
# method is that it merges a group of tensors (its own suite calls every registered method
# on state dicts), which a data-aware method cannot do. The data-aware faces stay here,
# where our validation and listing find them (issue #48: importing us changes nothing of
# what mergekit does, it only adds methods mergekit can run).
_FACES: dict[str, MergeMethod] = {}


def _mergekit_names() -> set[str]:
    return {m.spec.name for m in mk_methods.registered_methods()}


def register_method(info: MethodInfo, mergekit_method: MergeMethod) -> None:
    """Register ``info`` with mergekit-ext and, for a tensor-wise method, ``mergekit_method``
    with mergekit.

    Idempotent for the same name (importing the package twice must not fail). A name
    mergekit already has for a method of its own is refused: registering adds methods to
    mergekit, it never changes one of mergekit's (issue #48).
    """
    if mergekit_method.spec.name != info.name:
        raise ValueError(
            f"MethodInfo name {info.name!r} != mergekit spec name {mergekit_method.spec.name!r}"
        )
    in_mergekit = info.name in _mergekit_names()
    if in_mergekit and info.name not in _INFOS:
        raise ValueError(
            f"merge method {info.name!r} is one of mergekit's own: give the new method another name"
        )
    if isinstance(info.kind, Tensorwise) and not in_mergekit:
        mk_methods.register(mergekit_method)
    _FACES[info.name] = mergekit_method
    _INFOS[info.name] = info


def mergekit_method(name: str) -> MergeMethod:
    """The ``MergeMethod`` (name, parameter specs) of any method, ours or mergekit's.

    Raises mergekit's own ``RuntimeError`` ("Unimplemented merge method") for an unknown name.
    """
    face = _FACES.get(name)
    return face if face is not None else mk_methods.get(name)


def ext_method_info(name: str) -> Optional[MethodInfo]:
    """mergekit-ext's metadata for ``name``, or None for mergekit's own methods."""
    return _INFOS.get(name)


def method_kind(name: str) -> MethodKind:
    """How method ``name`` runs; mergekit's own methods are tensor-wise."""
    info = _INFOS.get(name)
    return info.kind if info is not None else TENSORWISE


def ext_methods() -> tuple[MethodInfo, ...]:
    return tuple(_INFOS.values())


def all_method_names() -> list[str]:
    return sorted(_mergekit_names() | set(_FACES))


def describe_method(name: str) -> dict[str, Any]:
    """A plain description of any registered method (mergekit's or ours), for ``methods``."""
    mk = mergekit_method(name)
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
                "allowed": doc.allowed if doc is not None else "",
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
                    "allowed": p.allowed,
                }
            )
    return {
        "name": name,
        "pretty_name": (info.pretty_name if info else mk.spec.pretty_name) or name,
        "source": "mergekit-ext" if info else "mergekit",
        "kind": method_kind(name).name,
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


def tensorwise_method(
    info: MethodInfo,
    kernel: Callable[[Any, Any], torch.Tensor],
    **spec_options: Any,
) -> MergeMethod:
    """A mergekit group method whose parameters come from ``info.parameters_model``.

    mergekit's ``@merge_method`` reads parameters from a kernel's signature; ours are
    declared once in the pydantic model instead, so the spec is built from the model and
    the kernel receives the typed parameters: ``kernel(group, parameters)``.
    ``spec_options`` go to mergekit's ``MergeMethodSpec`` (contract, optional-tensor policy).
    """
    from mergekit.merge_methods.base import (
        FunctionalGroupMergeMethod,
        MergeMethodSpec,
        TensorGroup,
    )

    spec = MergeMethodSpec(
        name=info.name,
        pretty_name=info.pretty_name,
        reference_url=info.paper_url,
        parameters=info.parameters_model.mergekit_specs(),
        **spec_options,
    )
    parsed: dict[tuple[tuple[str, Any], ...], MethodParameters] = {}

    def run(group: TensorGroup, **values: Any) -> torch.Tensor:
        # mergekit calls once per tensor with the same values: parse once per distinct set
        key = tuple(sorted((k, repr(v)) for k, v in values.items()))
        if key not in parsed:
            parsed[key] = info.parse_parameters(values)
        return kernel(group, parsed[key])

    return FunctionalGroupMergeMethod(spec, run)


def data_aware_method(info: MethodInfo) -> MergeMethod:
    """The mergekit-side face of a layerwise/adaptation method.

    Its name and parameter specs let ``mergekit-ext methods`` and YAML validation treat it as
    any mergekit method. It stays in our registry (:func:`mergekit_method`), never in
    mergekit's: such a method cannot run one tensor at a time. Called through mergekit's
    planner anyway, it fails before anything is written, pointing to ``mergekit-ext run`` and
    :func:`mergekit_ext.run_merge`.
    """
    from mergekit.merge_methods.base import (
        BasePolicy,
        GroupMergeMethod,
        InputContract,
        MergeMethodSpec,
        TensorGroup,
    )

    from mergekit_ext.errors import ConfigError

    spec = MergeMethodSpec(
        name=info.name,
        pretty_name=info.pretty_name,
        reference_url=info.paper_url,
        contract=InputContract(base=BasePolicy.REQUIRED, min_inputs=2),
        parameters=info.parameters_model.mergekit_specs(),
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
            raise ConfigError(message)

        def merge_group(self, group: TensorGroup, /, **parameters: Any):  # type: ignore[override]
            raise ConfigError(message)

    return _ExecutorOnly()
