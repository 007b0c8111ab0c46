"""The config reference is generated from the typed config: every field documented, docs/config.md
current, and ``streamrl config --help`` / ``streamrl config show`` print it."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from streamrl.config import RunConfig, field_description, field_types, load_config, struct_in
from streamrl.config_reference import (
    REGENERATE,
    STAGE_OPTIONS,
    commented_yaml,
    find_section,
    render_markdown,
    sections,
)

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "config.md"
DIGITS = REPO / "configs" / "grpo_digits.yaml"


def _structs(root: type[msgspec.Struct]) -> Iterator[type[msgspec.Struct]]:
    """``root`` and every struct reachable from its fields (dict values and unions included)."""
    seen: list[type[msgspec.Struct]] = []

    def visit(tp: Any) -> None:
        sub = struct_in(tp)
        if sub is not None:
            if sub not in seen:
                seen.append(sub)
                for field_tp in field_types(sub).values():
                    visit(field_tp)
            return
        for arg in getattr(tp, "__args__", ()) or ():
            visit(arg)

    visit(root)
    for _, _, struct, _ in STAGE_OPTIONS:
        visit(struct)
    yield from seen


def test_every_field_of_every_config_struct_has_a_description() -> None:
    missing = [f"{struct.__module__}.{struct.__qualname__}.{name}"
               for struct in _structs(RunConfig)
               for name, tp in field_types(struct).items() if not field_description(tp).strip()]
    assert missing == [], f"fields without msgspec.Meta(description=...): {missing}"


def test_the_reference_covers_every_struct_and_the_requested_sections() -> None:
    names = [s.name for s in sections()]
    for wanted in ["top", "model", "model.tiny", "task", "algo", "algo.loss", "resources", "resources.dock",
                   "resources.ray", "eval", "output", "output.wandb", "stages", "options.source",
                   "options.generate", "options.generate.vllm", "options.train",
                   "options.score"]:
        assert wanted in names
    assert {s.struct for s in sections()} == set(_structs(RunConfig))
    algo = {r.key: r for r in find_section("algo").rows}
    assert algo["algo.lr"].default == "0.001" and algo["algo.lr"].type == "float"
    assert algo["algo.lr"].description == "AdamW peak learning rate (after warmup)"
    assert algo["algo.max_grad_norm"].type == "float or null"
    dock = {r.key: r for r in find_section("resources.dock").rows}
    assert dock["resources.dock.max_clients"].type.startswith("int (>= 1, <=")  # the bounds show
    assert find_section("stages").rows[0].key == "stages.<name>.workers"


def test_the_built_in_stages_take_the_documented_option_structs() -> None:
    """The reference documents the structs the stage classes check their options with."""
    from streamrl.stages.score import ScoreStage

    for _, _, struct, classes in STAGE_OPTIONS:
        for path in classes:
            module, _, name = path.partition(":")
            cls = getattr(importlib.import_module(module), name)
            if cls is ScoreStage:
                assert isinstance(ScoreStage.check_options({}), struct)
            else:
                assert cls.Options is struct, path


def test_docs_config_md_is_current() -> None:
    assert DOC.is_file(), f"docs/config.md is missing; generate it with `{REGENERATE}`"
    assert DOC.read_text() == render_markdown(), (
        f"docs/config.md is stale (a config field or description changed); regenerate it with `{REGENERATE}`")


def test_an_unknown_section_has_a_did_you_mean() -> None:
    with pytest.raises(KeyError, match=r"did you mean 'algo\.loss'"):
        find_section("algo.los")


def test_the_commented_yaml_loads_back_to_the_same_config() -> None:
    cfg = load_config(DIGITS, ["algo.lr=3e-4", "stages.train.workers=2", "output.wandb={project: p}"])
    text = commented_yaml(cfg)
    assert "# AdamW peak learning rate (after warmup)\n  lr: 0.0003\n" in text
    assert load_config(yaml.safe_load(text)) == cfg
