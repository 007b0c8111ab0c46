"""The config reference, generated from the typed config: every field's key, type, default and
description (``msgspec.Meta(description=...)`` on the field), section by section.

``docs/config.md`` is this module's Markdown (regenerate it with
``python -m streamrl.config_reference docs/config.md``; a test fails when it is stale);
``streamrl config --help [SECTION]`` prints one section, ``streamrl config show`` a resolved
config as YAML with each field's description as a comment.
"""

from __future__ import annotations

import inspect as pyinspect
import math
import re
import sys
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

import msgspec
import yaml

from streamrl.config import (
    RunConfig,
    StageOverride,
    bare_type,
    did_you_mean,
    field_description,
    field_types,
    struct_in,
)
from streamrl.engines.options import GenerateOptions
from streamrl.stages.agent import AgentOptions
from streamrl.stages.chain import ChainOptions
from streamrl.stages.critic import CriticOptions
from streamrl.stages.score import ScoreOptions
from streamrl.stages.source import SourceOptions
from streamrl.stages.train import TrainOptions

REGENERATE = "python -m streamrl.config_reference docs/config.md"
TOP = "top"  # the section of RunConfig's own scalar fields

# The built-in stages' options: (section, the stage's name in the built-in pipelines, the options
# struct, the classes that take it). Stages not listed (advantage, reference, eval, value) take no options.
STAGE_OPTIONS: list[tuple[str, str, type[msgspec.Struct], tuple[str, ...]]] = [
    ("options.source", "source", SourceOptions, ("streamrl.stages.source:SourceStage",)),
    ("options.generate", "generate", GenerateOptions, ("streamrl.stages.generate:GenerateStage",)),
    ("options.chain", "reward", ChainOptions, ("streamrl.stages.chain:ChainStage",)),  # before train: its rollout
    ("options.train", "train", TrainOptions, ("streamrl.stages.train:TrainStage",)),
    ("options.score", "score", ScoreOptions, ("streamrl.stages.score:ScoreStage",)),
    ("options.critic", "critic", CriticOptions, ("streamrl.stages.critic:CriticStage",)),
    ("options.agent", "agent", AgentOptions, ("streamrl.stages.agent:AgentStage",)),
]
NO_OPTIONS = ("advantage", "reference", "eval", "value")


@dataclass(frozen=True)
class Row:
    """One field: its dotted key, its type and default as YAML would write them, its description."""

    key: str
    type: str
    default: str
    description: str
    section: str = ""  # a field holding a struct: the section of its fields


@dataclass(frozen=True)
class Section:
    """The fields of one struct, under its dotted key prefix."""

    name: str  # what `streamrl config --help NAME` takes
    prefix: str  # the dotted key of the section in a run config ("" for the top level)
    struct: type[msgspec.Struct]
    about: str  # the struct's docstring, first paragraph
    rows: list[Row]


def _about(struct: type) -> str:
    doc = pyinspect.getdoc(struct) or ""
    if struct.__doc__ is None or doc.startswith(f"{struct.__name__}("):  # msgspec's generated signature
        return ""
    first = doc.split("\n\n")[0]
    return " ".join(first.split()).replace("``", "`")


def yaml_value(value: Any) -> str:
    """``value`` as YAML writes it in flow style (``null``, ``true``, ``[0.9, 0.999]``, ``{}``)."""
    value = msgspec.to_builtins(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def _literals(tp: Any) -> dict[frozenset[Any], tuple[Any, ...]]:
    """The ``Literal[...]`` values in ``tp`` in their declared order (msgspec.inspect sorts them)."""
    tp = bare_type(tp)
    if typing.get_origin(tp) is typing.Literal:
        return {frozenset(typing.get_args(tp)): typing.get_args(tp)}
    found: dict[frozenset[Any], tuple[Any, ...]] = {}
    for arg in typing.get_args(tp):
        found.update(_literals(arg))
    return found


def _type_text(t: Any, names: dict[type, str], order: dict[frozenset[Any], tuple[Any, ...]] | None = None) -> str:
    """A msgspec.inspect type in words: ``int (>= 1)``, ``one of a, b``, ``float or null``."""
    mi = msgspec.inspect
    order = order or {}
    if isinstance(t, mi.Metadata):
        return _type_text(t.type, names, order)
    if isinstance(t, (mi.IntType, mi.FloatType)):
        name = "int" if isinstance(t, mi.IntType) else "float"
        bounds = [f"{op} {v}" for op, v in ((">=", t.ge), (">", t.gt), ("<=", t.le), ("<", t.lt)) if v is not None]
        return f"{name} ({', '.join(bounds)})" if bounds else name
    simple = {mi.StrType: "str", mi.BoolType: "bool", mi.NoneType: "null", mi.AnyType: "any"}
    for kind, text in simple.items():
        if isinstance(t, kind):
            return text
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(str(v) for v in order.get(frozenset(t.values), t.values))
    if isinstance(t, mi.UnionType):
        return " or ".join(_type_text(u, names, order) for u in t.types)
    if isinstance(t, (mi.ListType, mi.SetType, mi.VarTupleType, mi.FrozenSetType)):
        return f"list of {_type_text(t.item_type, names, order)}"
    if isinstance(t, mi.TupleType):
        return "[" + ", ".join(_type_text(u, names, order) for u in t.item_types) + "]"
    if isinstance(t, mi.DictType):
        return f"mapping of {_type_text(t.key_type, names, order)} to {_type_text(t.value_type, names, order)}"
    if isinstance(t, mi.StructType):
        section = names.get(t.cls)
        return f"mapping (section {section})" if section else "mapping"
    return type(t).__name__.removesuffix("Type").lower()


def _default(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return msgspec.NODEFAULT


def _struct_of(tp: Any) -> tuple[Any, str]:
    """The Struct a field holds (``S``, ``S | None``) or lists (``list[S]``: its items' keys get ``[]``),
    and the key suffix of its fields; (None, "") for any other field."""
    sub = struct_in(tp)
    if sub is not None:
        return sub, ""
    bare = bare_type(tp)
    args = typing.get_args(bare)
    if typing.get_origin(bare) is list and len(args) == 1:
        item = struct_in(args[0])
        if item is not None:
            return item, "[]"
    return None, ""


def _rows(struct: type[msgspec.Struct], prefix: str, names: dict[type, str]) -> list[Row]:
    types = field_types(struct)
    rows = []
    for field in msgspec.structs.fields(struct):
        tp = types[field.name]
        default = _default(field)
        sub, _ = _struct_of(tp)
        if default is msgspec.NODEFAULT:
            shown = "(required)"
        elif isinstance(default, msgspec.Struct) and sub in names:
            shown = f"(section {names[sub]})"
        else:
            shown = yaml_value(default)
        rows.append(Row(key=f"{prefix}{field.encode_name}", type=_type_text(msgspec.inspect.type_info(tp), names, _literals(tp)),
                        default=shown, description=field_description(tp), section=names.get(sub, "")))
    return rows


def sections() -> list[Section]:
    """Every section of the reference: the run config's, depth first in field order, then
    ``stages`` (per-stage overrides) and the built-in stages' options."""
    plan: list[tuple[str, str, type[msgspec.Struct]]] = []  # (name, prefix, struct)

    def visit(struct: type[msgspec.Struct], name: str, prefix: str) -> None:
        plan.append((name, prefix, struct))
        for field_name, tp in field_types(struct).items():
            sub, items = _struct_of(tp)
            if sub is not None and sub not in {s for _, _, s in plan}:
                visit(sub, field_name if name == TOP else f"{name}.{field_name}", f"{prefix}{field_name}{items}.")

    visit(RunConfig, TOP, "")
    plan.append(("stages", "stages.<name>.", StageOverride))
    for name, stage, struct, _ in STAGE_OPTIONS:
        if struct not in {s for _, _, s in plan}:
            visit(struct, name, f"stages.{stage}.options.")
    names = {struct: name for name, _, struct in plan}
    return [Section(name=name, prefix=prefix.rstrip("."), struct=struct, about=_about(struct),
                    rows=_rows(struct, prefix, names)) for name, prefix, struct in plan]


def _option_note(section: Section) -> str:
    for name, stage, _, _ in STAGE_OPTIONS:
        if name == section.name:
            return (f"Set in the run config as `stages.{stage}.options.KEY` (for the stage named `{stage}` in the "
                    "built-in pipelines), or under `options:` of that stage in the pipeline file.")
    return ""


def find_section(name: str) -> Section:
    """The section ``name`` (``algo``, ``algo.loss``, ``options.train``), else KeyError with a
    did-you-mean."""
    found = {s.name: s for s in sections()}
    if name in found:
        return found[name]
    raise KeyError(f"no config section {name!r}{did_you_mean(name, list(found))}")


_INTRO = f"""\
# Config reference

Every field of a run config, generated from the typed config (`streamrl/config.py` and the
structs it holds; each field's `msgspec.Meta(description=...)`). Do not edit this file: change
the descriptions in the code and regenerate it with `{REGENERATE}`
(`tests/test_config_reference.py` fails while it is stale).

A run config is a YAML file of these sections; every field has the default shown, so an empty
file is a valid config, and an unknown key is an error with a did-you-mean. Values are YAML:
`true`, `null`, `3e-4`, `[0.9, 0.999]`, `{{n_digits: 3}}`. Any field can be set on the command
line as `key=value` after the config, with the dotted key and a YAML value:

```sh
streamrl run configs/grpo_digits.yaml algo.lr=3e-4 resources.launch=inprocess stages.train.workers=2
```

`streamrl config --help SECTION` prints one section in the terminal, `streamrl config show
[CONFIG] [key=value ...]` the resolved config with each field's description as a comment, and
`streamrl validate CONFIG` every problem in a config at once, each with its line.

The built-in stages' `options` (last sections) are set per stage: `stages.<name>.options` in the
run config, merged over `options:` of that stage in the pipeline file. The
{", ".join(NO_OPTIONS[:-1])} and {NO_OPTIONS[-1]} stages take no options.
"""


def _cell(text: str) -> str:
    """Text for Markdown: '|' would end a table cell, and outside `code` '<name>' reads as an HTML tag."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def _linked(type_text: str) -> str:
    """A type's ``(section X)`` as a link to that section."""
    return re.sub(r"\(section ([\w.-]+)\)", lambda m: f"(section [`{m[1]}`](#{_anchor(m[1])}))", _cell(type_text))


def render_markdown() -> str:
    """docs/config.md."""
    out = [_INTRO]
    all_sections = sections()
    out.append("## Sections\n")
    out += [f"- [`{s.name}`](#{_anchor(s.name)})" + (f": {_cell(s.about)}" if s.about else "") for s in all_sections]
    for s in all_sections:
        out.append(f"\n## {s.name}\n")
        lines = [_cell(s.about)] if s.about else []
        note = _option_note(s)
        if note:
            lines.append(note)
        elif s.prefix and s.name != s.prefix:
            lines.append(f"Keys under `{s.prefix}`.")
        if lines:
            out.append(" ".join(lines) + "\n")
        out.append("| key | type | default | description |")
        out.append("|---|---|---|---|")
        for r in s.rows:  # a struct's default is its section's defaults
            default = "" if r.section and r.default == f"(section {r.section})" else f"`{_cell(r.default)}`"
            out.append(f"| `{r.key}` | {_linked(r.type)} | {default} | {_cell(r.description)} |")
    return "\n".join(out) + "\n"


def _anchor(name: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than '-' and '_' dropped."""
    return "".join(c for c in name.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def _wrap(text: str, width: int, **kwargs: Any) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False, **kwargs)


def render_section_text(section: Section, width: int = 100) -> str:
    """One section for the terminal: each key with its type and default, its description below."""
    head = f"{section.name}" + (f" ({section.prefix}.*)" if section.prefix and section.prefix != section.name else "")
    out = [head]
    for text in (section.about, _option_note(section)):
        if text:
            out += _wrap(text, width, initial_indent="  ", subsequent_indent="  ")
    out.append("")
    for r in section.rows:
        out.append(f"  {r.key}: {r.type}, default {r.default}")
        out += _wrap(r.description, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(out) + "\n"


def render_section_list() -> str:
    out = ["Config sections (streamrl config --help SECTION prints one):"]
    all_sections = sections()
    pad = max(len(s.name) for s in all_sections)
    for s in all_sections:
        about = textwrap.shorten(s.about, 100 - pad - 4, placeholder="...") if s.about else ""
        out.append(f"  {s.name.ljust(pad)}  {about}".rstrip())
    return "\n".join(out) + "\n"


def commented_yaml(cfg: RunConfig, width: int = 100) -> str:
    """``cfg`` as YAML with each field's description as a comment above it; loads back to ``cfg``."""
    out: list[str] = []

    def struct(value: msgspec.Struct, indent: str) -> None:
        types = field_types(type(value))
        for field in msgspec.structs.fields(type(value)):
            tp = types[field.name]
            out.extend(_wrap(field_description(tp), width - len(indent) - 2,
                                     initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# "))
            item(field.encode_name, getattr(value, field.name), indent)

    def item(key: str, value: Any, indent: str) -> None:
        if isinstance(value, msgspec.Struct):
            out.append(f"{indent}{key}:")
            struct(value, indent + "  ")
        elif isinstance(value, dict) and value and any(isinstance(v, msgspec.Struct) for v in value.values()):
            out.append(f"{indent}{key}:")
            for k, v in value.items():
                item(yaml_value(k), v, indent + "  ")
        else:
            out.append(f"{indent}{key}: {yaml_value(value)}")

    struct(cfg, "")
    return "\n".join(out) + "\n"


def check_descriptions() -> list[str]:
    """The dotted keys of fields without a description (the reference would show an empty cell)."""
    return [f"{s.name}: {r.key}" for s in sections() for r in s.rows if not r.description.strip()]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and (args[0].startswith("-") or len(args) > 1):
        # an option here would otherwise be taken for the output file's name
        sys.stdout.write("usage: python -m streamrl.config_reference [OUTPUT.md]\n"
                         "writes the config reference to OUTPUT.md (default: stdout)\n")
        return 0 if args[0] in ("-h", "--help") else 2
    text = render_markdown()
    if args:
        with open(args[0], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
