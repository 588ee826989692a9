"""The method registry: one parameter declaration per method, everything derived from it."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from mergekit_ext.errors import ConfigError, MergekitExtError
from mergekit_ext.methods import ext_methods
from mergekit_ext.methods.kinds import TENSORWISE, Layerwise
from mergekit_ext.methods.parameters import MethodParameters, describe_allowed
from mergekit_ext.methods.registry import describe_method, mergekit_method

EXPECTED = {"ace", "regmean", "chain_of_merges", "qp_projection", "symerge", "wudi"}


def test_every_method_has_its_mergekit_face_and_our_info():
    names = {info.name for info in ext_methods()}
    assert EXPECTED <= names
    for info in ext_methods():
        assert issubclass(info.parameters_model, MethodParameters)
        assert mergekit_method(info.name).spec.name == info.name
        if isinstance(info.kind, Layerwise):  # the executor's object uses the same declaration
            assert getattr(info.kind.method, "parameters_model", None) in (
                None,
                info.parameters_model,
            )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_descriptions_say_what_a_parameter_does_not_what_it_scored(name):
    """Benchmark numbers and sweeps stay in docs/methods.md and benchmarks/results (issue #29)."""
    info = next(i for i in ext_methods() if i.name == name)
    for doc in info.parameters:
        assert not re.search(r"\d%|\bsuites?\b|\bsweep|\bbenchmark", doc.description), (
            f"{name}.{doc.name}: {doc.description}"
        )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_listing_mergekit_spec_and_model_agree(name):
    info = next(i for i in ext_methods() if i.name == name)
    fields = info.parameters_model.model_fields
    listed = {p["name"]: p for p in describe_method(name)["parameters"]}
    spec = {p.name: p for p in mergekit_method(name).spec.parameters}
    assert set(listed) == set(fields) == set(spec)
    defaults = info.parameters_model()
    for field_name, field in fields.items():
        assert field.description, f"{name}.{field_name} has no description"
        default = getattr(defaults, field_name)
        assert spec[field_name].default == default
        listed_default = listed[field_name]["default"]
        assert listed_default == (list(default) if isinstance(default, tuple) else default)
        assert listed[field_name]["allowed"] == describe_allowed(field)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_mergekit_validation_enforces_the_same_ranges(name):
    info = next(i for i in ext_methods() if i.name == name)
    spec = {p.name: p for p in mergekit_method(name).spec.parameters}
    for field_name, field in info.parameters_model.model_fields.items():
        for m in field.metadata:
            for attr, outside in (("ge", -1.0), ("le", 1.0), ("gt", 0.0), ("lt", 0.0)):
                bound = getattr(m, attr, None)
                if bound is None:
                    continue
                bad = bound + outside
                with pytest.raises(ValidationError):
                    spec[field_name].validate(bad)
                with pytest.raises(ConfigError, match=rf"parameters\.{field_name} = "):
                    info.parse_parameters({field_name: bad})


def test_parse_gives_defaults_for_null_and_returns_typed_objects_unchanged():
    info = next(i for i in ext_methods() if i.name == "qp_projection")
    parsed = info.parse_parameters({"ridge": None, "bounds": [0, 1]})
    assert parsed.ridge == 1.0 and parsed.bounds == (0.0, 1.0)
    assert info.parse_parameters(parsed) is parsed
    with pytest.raises(ConfigError, match=r"bounds must be \[lo, hi\] with lo <= hi"):
        info.parse_parameters({"bounds": [1, 0]})


def test_describe_allowed_words():
    from pydantic import Field

    class P(MethodParameters):
        a: float = Field(0.5, ge=0, le=1)
        b: float = Field(1.0, gt=0)
        c: float = 0.0

    f = P.model_fields
    assert describe_allowed(f["a"]) == "[0, 1]"
    assert describe_allowed(f["b"]) == "(0, inf)"
    assert describe_allowed(f["c"]) == ""


@pytest.mark.parametrize("name", ["regmean", "chain_of_merges", "qp_projection", "symerge"])
def test_data_aware_methods_refuse_mergekits_executor_before_writing(name):
    method = mergekit_method(name)
    with pytest.raises(MergekitExtError, match=r"mergekit-ext run"):
        method.validate_inputs()


def test_ace_kernel_parses_each_parameter_set_once(monkeypatch):
    import torch
    from mergekit.merge_methods.base import TensorGroup

    from mergekit_ext.methods import ace

    calls = []
    original = ace.ACEParameters.parse.__func__

    def counting(cls, values, method):
        calls.append(dict(values or {}))
        return original(cls, values, method)

    monkeypatch.setattr(ace.ACEParameters, "parse", classmethod(counting))
    base = torch.zeros(3)
    experts = [torch.ones(3), 2 * torch.ones(3)]
    for i in range(5):
        group = TensorGroup.from_tensors([base, *experts], base_index=0, name=f"n{i}.bias")
        ace.ace_merge.merge_group(group, scale=0.5)
    # the kernel factory memoises per distinct value set; a fresh kernel is built per method
    assert len(calls) <= 1


def test_a_new_method_gets_its_card_section_through_its_report(tmp_path):
    """The card loops over registered methods: a new one needs no edit in hub/."""
    from pydantic import Field

    from mergekit_ext.hub.card import _diagnostic_sections
    from mergekit_ext.methods.registry import (
        MethodInfo,
        MethodReport,
        register_method,
        tensorwise_method,
    )
    from mergekit_ext.plots import Plot, new_figure, save_figure

    class HookParameters(MethodParameters):
        strength: float = Field(2.0, ge=0, description="how strong")

    def summarize(section, parameters):
        return {"tensors": len(section["tensors"]), "strength": parameters.strength}

    def plot(section, images_dir, parameters):
        fig, (ax,) = new_figure()
        ax.plot([1, 2, 3])
        return [Plot(save_figure(fig, images_dir, "hook.png"), "hook", "a test plot")]

    info = MethodInfo(
        name="registry_test_hook",
        pretty_name="Hook test",
        kind=TENSORWISE,
        needs_calibration=False,
        paper="",
        paper_url="",
        parameters_model=HookParameters,
        report=MethodReport("Hook test", summarize, plot),
    )
    register_method(info, tensorwise_method(info, lambda group, p: group.tensors[0] * p.strength))
    assert describe_method("registry_test_hook")["parameters"][0]["allowed"] == "[0, inf)"
    diag = {"sections": {"registry_test_hook": {"tensors": {"a": {}, "b": {}}}, "unknown": {}}}
    sections = {
        s["key"]: s for s in _diagnostic_sections(diag, str(tmp_path / "images"), {"strength": 3})
    }
    hook = sections["registry_test_hook"]
    assert hook["title"] == "Hook test" and hook["summary"] == {"tensors": 2, "strength": 3.0}
    assert hook["rows"] == [("tensors", 2), ("strength", 3.0)]  # no template: a plain table
    assert (tmp_path / "images" / "hook.png").read_bytes()[:4] == b"\x89PNG"
    assert sections["unknown"]["summary"] == {} and sections["unknown"]["plots"] == []
