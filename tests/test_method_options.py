"""Each method's options are declared once, in its settings dataclass (lightning_putm/methods/options.py;
``conf/method/<name>.yaml`` is written from it, tests/test_option_sources.py), every declared bound is enforced
through the registry (``build_method``) with an error naming ``method.<name>.<key>``, and ``--help`` reads types
and help text from the dataclass."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from omegaconf import OmegaConf

from lightning_putm.config import conf_dir
from lightning_putm.errors import ConfigError
from lightning_putm.methods import METHOD_CLASSES, build_method
from lightning_putm.methods.options import MethodOptions, OptionField, config_fields, option, option_fields

METHODS = sorted(METHOD_CLASSES)
#: Keys of a yaml that are not method options (applied by the evaluation before the method is built).
NOT_OPTIONS = {"preset"}


def settings_of(name: str) -> type[MethodOptions]:
    cls = METHOD_CLASSES[name].Settings
    assert cls is not None, f"{name} declares no settings dataclass"
    return cls


def test_every_builtin_method_is_covered() -> None:
    assert set(METHODS) >= {"putm", "simpleshot", "protonet", "ptmap", "tim", "alpha_tim", "bdcspn",
                            "laplacianshot", "ilpc", "bavardage", "alpha_am", "unem"}


@pytest.mark.parametrize("name", METHODS)
def test_defaults_build_and_match_the_settings(name: str) -> None:
    """The yaml's values through the registry give back the dataclass defaults (by-setting ones resolved)."""
    yaml = OmegaConf.to_container(OmegaConf.load(conf_dir() / "method" / f"{name}.yaml"))
    params = {k: v for k, v in yaml.items() if k not in NOT_OPTIONS}
    for shots, balanced in ((1, False), (5, True)):
        built = build_method(name, params, shots=shots, balanced=balanced)
        plain = build_method(name, {}, shots=shots, balanced=balanced)
        assert built.settings == plain.settings
        assert all(getattr(built.settings, f.name) is not None for f in config_fields(settings_of(name))
                   if f.spec.by_setting), "a by-setting option was left unresolved"


def list_template(f: OptionField) -> list[Any]:
    """A valid value of a list option: its default, or (default null) ``low + 1`` repeated."""
    return list(f.default) if f.default is not None else [f.spec.low + 1] * (f.spec.length or 1)


def outside(f: OptionField) -> list[Any]:
    """Values just outside each declared bound of ``f`` (one per bound)."""
    s, bad = f.spec, []
    step = 1 if f.element == "int" else None
    if s.low is not None:
        bad.append(s.low if s.low_open else (s.low - 1 if step else math.nextafter(s.low, -math.inf)))
    if s.high is not None:
        bad.append(s.high if s.high_open else (s.high + 1 if step else math.nextafter(s.high, math.inf)))
    if s.choices is not None:
        bad.append(s.choices[0] + "x")
    if f.kind == "list":
        template = list_template(f)
        bad = [[value, *template[1:]] for value in bad]
        if s.length is not None:
            bad.append(template + template[:1])  # one element too many
    return bad


def inside(f: OptionField) -> list[Any]:
    """The closed bounds themselves, which must be accepted."""
    s, good = f.spec, []
    if s.low is not None and not s.low_open:
        good.append(s.low)
    if s.high is not None and not s.high_open:
        good.append(s.high)
    if f.kind == "list":
        good = [[value, *list_template(f)[1:]] for value in good]
    return [float(g) if f.kind == "float" else g for g in good]


CASES = [(name, f) for name in METHODS for f in config_fields(settings_of(name))]


@pytest.mark.parametrize("name,f", CASES, ids=[f"{n}.{f.name}" for n, f in CASES])
def test_every_declared_bound_is_enforced(name: str, f: OptionField) -> None:
    """Kills: a bound declared but not checked, ``<`` written for ``<=`` (the closed bound itself is accepted), and
    an error that does not name the key."""
    for bad in outside(f):
        with pytest.raises(ConfigError, match=rf"^method\.{name}\.{f.name} must .*got "):
            build_method(name, {f.name: bad}, shots=1, balanced=False)
    for good in inside(f):
        assert settings_of(name).from_mapping({f.name: good}) is not None


@pytest.mark.parametrize("name", METHODS)
def test_wrong_types_are_refused_and_numbers_converted(name: str) -> None:
    """An int for a float option becomes a Python float and a list a tuple, as the hand-written ``float(x)`` did
    (kills a missing conversion, which would change later arithmetic); a text value for a number is refused."""
    cls = settings_of(name)
    for f in config_fields(cls):
        if f.kind == "float" and f.default is not None and float(f.default).is_integer():
            value = getattr(cls.from_mapping({f.name: int(f.default)}), f.name)
            assert type(value) is float and value == f.default
        if f.kind in ("float", "int"):
            with pytest.raises(ConfigError, match=rf"method\.{name}\.{f.name}"):
                cls.from_mapping({f.name: "abc"})
        if f.kind == "bool":
            with pytest.raises(ConfigError, match=rf"method\.{name}\.{f.name} must be true or false"):
                cls.from_mapping({f.name: "no"})
        if f.kind == "list" and f.default is not None:
            assert isinstance(getattr(cls.from_mapping({f.name: list(f.default)}), f.name), tuple)


def test_unknown_option_suggests_the_nearest_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown option method\.ptmap\.iteration; did you mean "
                                          r"method\.ptmap\.iterations\? valid keys: beta, lam"):
        build_method("ptmap", {"iteration": 3}, shots=1, balanced=False)


def test_by_setting_options_are_resolved_per_setting_and_explicit_values_win() -> None:
    putm = {(s, b): build_method("putm", {}, shots=s, balanced=b).settings for s in (1, 5) for b in (False, True)}
    assert (putm[1, False].rho, putm[1, False].theta, putm[1, False].inertia) == (0.5, 0.0, 0.2)
    assert (putm[5, True].rho, putm[5, True].theta, putm[5, True].inertia) == (1.0, 0.001, 0.1)
    assert build_method("putm", {"rho": 0.3}, shots=1, balanced=True).settings.rho == 0.3
    assert build_method("laplacianshot", {}, shots=5, balanced=True).lmd == 0.3
    assert build_method("laplacianshot", {}, shots=1, balanced=False).proto_rect is False
    assert build_method("alpha_tim", {}, shots=3, balanced=False).alpha == 5.0
    assert build_method("tim", {}, shots=1, balanced=True).loss_weights == (0.1, 1.0, 0.1)


def test_a_settings_object_or_options_but_not_both() -> None:
    from lightning_putm.methods import PTMAP
    from lightning_putm.methods.ptmap import PTMAPSettings

    assert PTMAP(PTMAPSettings(iterations=3)).iterations == 3
    assert PTMAP(iterations=3).settings == PTMAPSettings(iterations=3)
    with pytest.raises(ConfigError, match="not both"):
        PTMAP(PTMAPSettings(), iterations=3)


def test_options_module_example() -> None:
    """The mechanism on its own: declared bounds, nullable fields, choices and list lengths."""

    @dataclass(frozen=True)
    class DemoSettings(MethodOptions):
        method: ClassVar[str] = "demo"

        rate: float = option(0.5, low=0, high=1, high_open=True, help="a rate")
        cap: int | None = option(None, low=1, null="automatic", help="a cap")
        mode: str = option("fast", choices=("fast", "exact"), help="a mode")
        pair: tuple[float, ...] = option((1.0, 2.0), low=0, length=2, help="a pair")

    assert [f.name for f in option_fields(DemoSettings)] == ["rate", "cap", "mode", "pair"]
    assert DemoSettings(rate=0, cap=2, pair=[0, 3]).pair == (0.0, 3.0)
    messages = {
        "rate": (1.0, "method.demo.rate must lie in [0, 1), got 1.0"),
        "cap": (0, "method.demo.cap must be null (automatic) or an integer >= 1, got 0"),
        "mode": ("exakt", "method.demo.mode must be one of fast, exact; got 'exakt'; did you mean exact?"),
        "pair": ([1.0], "method.demo.pair must be a list of 2 numbers >= 0, got [1.0]"),
    }
    for key, (value, message) in messages.items():
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            DemoSettings(**{key: value})


def test_help_reads_types_and_help_text_from_the_dataclass() -> None:
    from lightning_putm.help import job_help, method_argument_type, value_type

    assert method_argument_type("putm", "max_chunk_tasks") == "int"
    assert method_argument_type("putm", "rho") == "float"
    assert method_argument_type("laplacianshot", "proto_rect") == "bool"
    assert method_argument_type("tim", "loss_weights") == "list"
    assert value_type("method.bdcspn.top_z", None) == "int"
    assert method_argument_type("putm", "preset") is None
    text = " ".join(job_help("evaluate", "summary").split())
    # putm.yaml has no comment beside inertia_one_shot: the dataclass's help fills in
    assert re.search(r"method\.putm\.inertia_one_shot\s+float\s+0\.2\s+inertia at 1 shot", text)
