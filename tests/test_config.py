"""Run configs: typed, validated once, key=value overrides, errors that name the field and the fix."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from streamrl.config import (
    ConfigError,
    RunConfig,
    dump_config,
    load_config,
    parse_overrides,
    resolve_path,
)

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "configs" / "grpo_digits.yaml"


def _error(source: object, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)  # type: ignore[arg-type]
    return str(info.value)


# ---------------------------------------------------------------- unknown keys: did-you-mean


@pytest.mark.parametrize(
    ("override", "key", "suggestion"),
    [
        ("algo.lrr=1", "algo.lrr", "lr"),
        ("modl.path=x", "modl", "model"),
        ("algo.max_stalenes=1", "algo.max_stalenes", "max_staleness"),
        ("resources.dock.capacty=128", "resources.dock.capacty", "capacity"),
        ("output.tensorbord=false", "output.tensorbord", "tensorboard"),
    ],
)
def test_unknown_key_is_an_error_with_did_you_mean(override: str, key: str, suggestion: str) -> None:
    msg = _error(DIGITS, [override])
    assert "unknown key" in msg
    assert repr(key) in msg
    assert f"did you mean {suggestion!r}" in msg
    assert str(DIGITS) in msg  # names the file the config came from


def test_unknown_key_in_a_dict_config_and_in_a_yaml_file(tmp_path: Path) -> None:
    assert "did you mean 'lr'" in _error({"algo": {"lrr": 1}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  stepz: 3\n")
    msg = _error(bad)
    assert str(bad) in msg and "algo.stepz" in msg and "did you mean 'steps'" in msg


def test_unknown_key_without_a_close_match_lists_the_known_ones() -> None:
    msg = _error({"output": {"zzzz": 1}})
    assert "output.zzzz" in msg and "known:" in msg and "run_dir" in msg


@pytest.mark.parametrize(("override", "suggestion"), [("algo.loss.kl_coeff=0.1", "kl_coef"),
                                                      ("model.tiny.hiden=64", "hidden")])
def test_unknown_key_in_nested_structs_is_an_error(override: str, suggestion: str) -> None:
    assert f"did you mean {suggestion!r}" in _error(DIGITS, [override])


def test_unknown_key_in_a_stage_override_has_did_you_mean() -> None:
    msg = _error(DIGITS, ["stages.train.workerz=2"])
    assert "did you mean 'workers'" in msg


# ---------------------------------------------------------------- bad values name the field


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("algo.lr=abc", "algo.lr"),
        ("algo.steps=many", "algo.steps"),
        ("resources.launch=bogus", "resources.launch"),
        ("model.tiny.hidden=abc", "model.tiny.hidden"),
        ("algo.betas=[0.9]", "algo.betas"),
        ("algo.old_logprobs=sometimes", "algo.old_logprobs"),
        ("output.progress=loud", "output.progress"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_field(override: str, field: str) -> None:
    msg = _error(DIGITS, [override])
    assert field in msg
    assert "$." not in msg  # msgspec's JSON-path prefix is translated to the config's dotted name


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("algo.steps=0", "algo.steps"),
        ("algo.lr=-1", "algo.lr"),
        ("algo.temperature=0", "algo.temperature"),
        ("algo.top_p=1.5", "algo.top_p"),
        ("algo.top_k=-1", "algo.top_k"),
        ("algo.group_size=1", "algo.group_size"),
        ("algo.max_staleness=-1", "algo.max_staleness"),
        ("resources.dock.warehouses=0", "resources.dock.warehouses"),
        ("resources.dock.capacity=4", "resources.dock.capacity"),
        ("algo.loss.clip_low=1.5", "clip_low"),
        ("model.tiny.hidden=130", "hidden"),
    ],
)
def test_an_out_of_range_value_names_the_field(override: str, field: str) -> None:
    msg = _error(DIGITS, [override])
    assert field in msg and str(DIGITS) in msg


def test_group_size_one_is_allowed_without_std_normalisation() -> None:
    cfg = load_config({"algo": {"group_size": 1, "advantage": "dr_grpo"}})
    assert cfg.algo.group_size == 1


def test_a_missing_or_malformed_file_is_a_config_error(tmp_path: Path) -> None:
    assert "no such config file" in _error(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("algo: [1, 2\n")
    assert "not valid YAML" in _error(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    assert "top level must be a mapping" in _error(listy)


# ---------------------------------------------------------------- overrides


def test_overrides_parse_as_yaml_values() -> None:
    cfg = load_config(DIGITS, ["resources.launch=inprocess", "algo.steps=7", "algo.max_grad_norm=null",
                               "algo.betas=[0.8, 0.9]", "output.tensorboard=false", "task.options.n_digits=4",
                               "algo.lr=0.0003"])
    assert cfg.resources.launch == "inprocess"
    assert cfg.algo.steps == 7
    assert cfg.algo.max_grad_norm is None
    assert cfg.algo.betas == (0.8, 0.9)
    assert cfg.output.tensorboard is False
    assert cfg.task.options == {"n_digits": 4}
    assert cfg.algo.lr == pytest.approx(3e-4)
    # the rest of the file is kept
    assert cfg.algo.group_size == 8 and cfg.model.tiny.hidden == 128


@pytest.mark.parametrize("text", ["3e-4", "1e-3", "5E-5"])
def test_scientific_notation_override(text: str) -> None:
    assert load_config(DIGITS, [f"algo.lr={text}"]).algo.lr == pytest.approx(float(text))


def test_scientific_notation_in_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  lr: 1e-3\n")
    assert load_config(path).algo.lr == pytest.approx(1e-3)


def test_override_that_is_not_key_value_is_an_error() -> None:
    for bad in ["algo", "=3", "algo.lr"]:
        with pytest.raises(ConfigError, match="KEY=VALUE"):
            parse_overrides([bad])


def test_conflicting_overrides_are_an_error() -> None:
    with pytest.raises(ConfigError, match="conflicts"):
        parse_overrides(["algo.steps=3", "algo.steps.x=1"])


def test_parse_overrides_builds_a_nested_dict() -> None:
    assert parse_overrides(["a.b.c=1", "a.b.d=x", "a.e=[1, 2]", "f=true"]) == {
        "a": {"b": {"c": 1, "d": "x"}, "e": [1, 2]}, "f": True}


def test_later_override_wins_and_merges_into_nested_sections() -> None:
    cfg = load_config(DIGITS, ["algo.steps=5", "algo.steps=6", "stages.train.micro_batch=16",
                               "stages.train.options={a: 1}"])
    assert cfg.algo.steps == 6
    assert cfg.stages["train"].micro_batch == 16 and cfg.stages["train"].options == {"a": 1}
    assert cfg.stages["train"].workers is None  # unset fields of an override stay None (= keep the pipeline's)


# ---------------------------------------------------------------- defaults, round trips, paths


def test_every_field_has_a_default() -> None:
    """An empty config is valid: every field has a documented default (see streamrl/config.py)."""
    assert load_config({}) == RunConfig()
    cfg = RunConfig()
    assert cfg.pipeline == "auto"  # streamrl.runtime.prerun.choose_pipeline (tests/runtime/test_pipeline.py)
    assert cfg.resources.launch == "processes"
    assert cfg.algo.max_staleness == 0
    assert cfg.dock_capacity == 2 * cfg.batch_size  # (max_staleness + 2) steps' worth


def test_dump_config_lists_every_field_and_round_trips() -> None:
    cfg = load_config(DIGITS, ["algo.steps=11"])
    text = dump_config(cfg)
    data = yaml.safe_load(text)

    def keys(struct_type: type, prefix: str = "") -> list[str]:
        out = []
        for f in msgspec.structs.fields(struct_type):
            t = f.type
            if isinstance(t, type) and issubclass(t, msgspec.Struct):
                out += keys(t, prefix + f.name + ".")
            else:
                out.append(prefix + f.name)
        return out

    for dotted in keys(RunConfig):
        node = data
        for part in dotted.split("."):
            assert part in node, f"dump_config misses {dotted}"
            node = node[part]
    assert load_config(data) == cfg  # the dump is itself a valid config


def test_the_config_dir_resolves_relative_paths(tmp_path: Path) -> None:
    cfg = load_config(DIGITS)
    assert cfg.config_dir == str(DIGITS.parent)
    assert resolve_path(cfg, "../pipelines/grpo.yaml") == REPO / "pipelines" / "grpo.yaml"
    (tmp_path / "p.yaml").write_text("x")
    own = tmp_path / "c.yaml"
    own.write_text("pipeline: p.yaml\n")
    cfg = load_config(own)
    assert resolve_path(cfg, cfg.pipeline) == tmp_path / "p.yaml"


def test_load_config_accepts_a_runconfig_and_applies_overrides() -> None:
    base = load_config(DIGITS)
    again = load_config(base, ["algo.steps=3"])
    assert again.algo.steps == 3 and base.algo.steps == 300
    assert again.model == base.model


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "cispo", "ppo"])
def test_every_preset_loads_and_its_own_values_win(name: str) -> None:
    from streamrl.algos import ADVANTAGES, POLICY_LOSSES
    from streamrl.config import preset_names, read_preset

    assert name in preset_names()
    fields = read_preset(name, Path("."))["algo"]
    cfg = load_config({"preset": name})
    assert cfg.algo.advantage == fields["advantage"] and cfg.algo.advantage in ADVANTAGES
    assert cfg.algo.loss.policy_loss == fields["loss"]["policy_loss"] and cfg.algo.loss.policy_loss in POLICY_LOSSES
    assert cfg.algo.loss.loss_agg == fields["loss"]["loss_agg"]
    # the config's own values win over the preset's, and an override wins over both
    mine = load_config({"preset": name, "algo": {"loss": {"clip_high": 0.5}, "steps": 7}}, ["algo.steps=9"])
    assert (mine.algo.loss.clip_high, mine.algo.steps, mine.algo.advantage) == (0.5, 9, cfg.algo.advantage)
    # the resolved config (what a run writes as config.yaml) reloads to the same config
    assert load_config(msgspec.to_builtins(mine)) == mine


def test_presets_set_what_their_papers_say() -> None:
    gspo, cispo, dr = (load_config({"preset": p}).algo for p in ("gspo", "cispo", "dr_grpo"))
    assert (gspo.loss.clip_low, gspo.loss.clip_high) == (3e-4, 4e-4)
    assert (cispo.loss.clip_low, cispo.loss.clip_high) == (1.0, 0.28)
    assert dr.loss.loss_agg == "seq-mean-token-sum-norm" and dr.advantage == "dr_grpo"


def test_a_preset_may_be_a_file_next_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("algo:\n  advantage: rloo\n  loss: {policy_loss: cispo}\n")
    (tmp_path / "run.yaml").write_text("preset: mine.yaml\nalgo:\n  steps: 3\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.algo.advantage, cfg.algo.loss.policy_loss, cfg.algo.steps) == ("rloo", "cispo", 3)


def test_a_user_advantage_estimator_and_its_options_are_checked_at_load() -> None:
    cfg = load_config({"algo": {"advantage": "streamrl.algos.advantages:grpo", "advantage_options": {"eps": 0.1}}})
    assert cfg.algo.advantage_options == {"eps": 0.1}
