"""``python -m harness.cli.config_reference``: the config reference page, generated from the schemas.

Walks the config tree as Hydra composes it (the run schema, each strategy's schema, the target's keys) and the
preregistration's keys, and renders one table per group: key, type, default and the first line of the key's
attribute docstring. ``--write`` rewrites ``docs/reference/config.md``; ``--check`` exits 1 when the page is stale
or a key has no doc.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from harness.train.config import CONF_DIR, DOC_SOURCE, MOVED_TO, run_schema, strategy_schemas

PAGE = CONF_DIR.parent / "docs" / "reference" / "config.md"
#: packages whose dataclasses must document every field (a class from elsewhere is documented by TARGET_KEYS)
PROJECT_PACKAGES = ("harness", "strategies", "analysis", "batchlab")
TARGET_INTRO = ("The frozen target: the keyword arguments of transformers' `Qwen3_5TextConfig`, plus `pretrained`. "
                "An unset key (`null`) keeps transformers' default; the values are checked again when the target is "
                "built.")

#: the target keys conf/ sets (transformers' ``Qwen3_5TextConfig`` keyword arguments): key -> (type, one-line doc);
#: a dotted key is a key inside a mapping value
TARGET_KEYS: dict[str, tuple[str, str]] = {
    "vocab_size": ("int", "Vocabulary size; a random-weight target takes `data.vocab_size` (conf/train.yaml)."),
    "hidden_size": ("int", "Width of the hidden states (the drafter's width too)."),
    "intermediate_size": ("int", "Width of the MLP."),
    "num_hidden_layers": ("int", "Decoder layers."),
    "num_attention_heads": ("int", "Query heads of the full-attention layers."),
    "num_key_value_heads": ("int", "Key and value heads of the full-attention layers (grouped-query attention)."),
    "hidden_act": ("str", "The MLP's activation function."),
    "max_position_embeddings": ("int", "Longest sequence the rotary embeddings are built for."),
    "rms_norm_eps": ("float", "Epsilon of the RMS norms."),
    "use_cache": ("bool", "Keep a key/value cache when generating."),
    "tie_word_embeddings": ("bool", "Share the weights of the input embedding and the LM head."),
    "rope_parameters": ("mapping", "The rotary position embeddings' settings (the keys below)."),
    "rope_parameters.rope_type": ("str", "The RoPE variant (`default`: unscaled)."),
    "rope_parameters.rope_theta": ("float", "Base of the rotary frequencies."),
    "rope_parameters.partial_rotary_factor": ("float", "Fraction of each head's dimensions that rotate."),
    "rope_parameters.mrope_section": ("list[int]", "Multimodal RoPE: the rotary dimensions of each position axis."),
    "rope_parameters.mrope_interleaved": ("bool", "Multimodal RoPE: interleave the axes' frequencies."),
    "attention_bias": ("bool", "Bias in the attention projections."),
    "head_dim": ("int", "Dimension of each full-attention head."),
    "linear_conv_kernel_dim": ("int", "Kernel size of the Gated DeltaNet layers' short convolution."),
    "linear_key_head_dim": ("int", "Dimension of each Gated DeltaNet key head."),
    "linear_value_head_dim": ("int", "Dimension of each Gated DeltaNet value head."),
    "linear_num_key_heads": ("int", "Key heads of the Gated DeltaNet (linear attention) layers."),
    "linear_num_value_heads": ("int", "Value heads of the Gated DeltaNet layers."),
    "layer_types": ("list[str]", "Each layer's kind: `linear_attention` (Gated DeltaNet) or `full_attention`."),
    "full_attention_interval": ("int", "Without `layer_types`: every n-th layer is full attention, the rest linear."),
    "partial_rotary_factor": ("float", "Fraction of each head's dimensions that rotate (0.25 when unset)."),
    "model_type": ("str", "A checkpoint's model type (`qwen3_5` or `qwen3_5_text`): checked, then dropped."),
}


@dataclass(frozen=True)
class Key:
    """One documented key: its dotted name, type, default and doc line, and the class that documents it."""

    key: str
    type: str
    default: str
    """As Markdown: a value in backticks, or words."""
    doc: str
    source: str = ""


@dataclass
class Section:
    """One group of the page: a heading, lines of prose, and tables of keys (a subheading each, or none)."""

    title: str
    intro: list[str] = field(default_factory=list)
    tables: list[tuple[str, list[Key]]] = field(default_factory=list)
    outro: list[str] = field(default_factory=list)

    @property
    def keys(self) -> list[Key]:
        return [key for _, keys in self.tables for key in keys]


# ------------------------------------------------------------------ docstrings, types and defaults
@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (a string literal right under the field) in ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # a generated or compiled class has no source to read
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def doc_line(doc: str) -> str:
    """The first line of a docstring as Markdown: reST's ``x`` and :role:`x` become `x`."""
    line = doc.strip().splitlines()[0].strip() if doc.strip() else ""
    line = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", line)
    return line.replace("``", "`")


def is_project_class(cls: Any) -> bool:
    return isinstance(cls, type) and cls.__module__.split(".")[0] in PROJECT_PACKAGES


def type_name(hint: Any) -> str:
    """A type hint as a reader writes it: ``int | None``, ``list[int]``; a dataclass is a ``mapping``."""
    if hint is type(None):
        return "None"
    if hint is Any:
        return "Any"
    if isinstance(hint, str):
        return hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin in (list, tuple, Sequence):
        inner = [arg for arg in args if arg is not Ellipsis]
        name = "list" if origin in (list, tuple) else "Sequence"
        return f"{name}[{', '.join(type_name(arg) for arg in inner)}]" if inner else name
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(hint):
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def yaml_value(value: Any) -> str:
    """A default as it reads in a YAML file."""
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def field_default(f: dataclasses.Field) -> str:
    """The field's default as Markdown (``required`` without one)."""
    if f.default is not dataclasses.MISSING:
        return f"`{yaml_value(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{yaml_value(f.default_factory())}`"
    return "required"


def field_doc(f: dataclasses.Field, schema: type) -> str:
    """The doc line of ``schema``'s field ``f``: in its metadata's :data:`DOC_SOURCE`, else in ``schema``."""
    return doc_line(attribute_docs(f.metadata.get(DOC_SOURCE, schema)).get(f.name, ""))


def field_key(prefix: str, f: dataclasses.Field, schema: type) -> Key:
    """The row of ``schema``'s field ``f`` (its type as the documenting class declares it)."""
    source = f.metadata.get(DOC_SOURCE, schema)
    hints = typing.get_type_hints(source) if is_project_class(source) else {}
    return Key(prefix + f.name, type_name(hints.get(f.name, f.type)), field_default(f), field_doc(f, schema),
               f"{source.__module__}.{source.__qualname__}")


def dataclass_keys(prefix: str, schema: type) -> list[Key]:
    """Every field of ``schema`` but the old names and what is read from another key's file (``read_from``: the
    preregistration's pilot differences, from ``pilot_runs``); a list of dataclasses also by its items' keys
    (``name[].key``)."""
    keys = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if not f.init or MOVED_TO in f.metadata or "read_from" in f.metadata:
            continue
        keys.append(field_key(prefix, f, schema))
        items = [arg for arg in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(arg)]
        if typing.get_origin(hints[f.name]) in (list, tuple) and items:
            keys.extend(dataclass_keys(f"{prefix}{f.name}[].", items[0]))
    return keys


# ------------------------------------------------------------------ conf/
def group_options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def default_choices() -> dict[str, str]:
    """conf/train.yaml's defaults list: group -> the option chosen by default."""
    defaults = yaml.safe_load((CONF_DIR / "train.yaml").read_text())["defaults"]
    return {group: option for entry in defaults if isinstance(entry, dict) for group, option in entry.items()}


def choices_line(group: str, chosen: dict[str, str]) -> str:
    options = [f"`{option}`" + (" (default)" if chosen.get(group) == option else "") for option in group_options(group)]
    return f"Group `conf/{group}/`, chosen with `{group}=NAME`: {', '.join(options)}."


# ------------------------------------------------------------------ the sections
def run_sections() -> list[Section]:
    """The run's config as Hydra composes it: top-level keys, then each section of the run schema."""
    schema = run_schema()
    chosen = default_choices()
    top = Section("Run", ["Top-level keys of `conf/train.yaml`."], [("", [])])
    sections = [top]
    for f in dataclasses.fields(schema):
        hint = f.type
        if f.name == "strategy":
            sections.append(strategy_section(field_doc(f, schema), chosen))
        elif dataclasses.is_dataclass(hint):
            where = (choices_line(f.name, chosen) if (CONF_DIR / f.name).is_dir()
                     else "Set in `conf/train.yaml` (no group directory).")
            if f.name == "target":
                sections.append(target_section(hint, where))
                continue
            section = Section(f.name, [field_doc(f, schema), where], [("", dataclass_keys(f"{f.name}.", hint))])
            moved = [moved_key(f.name, g) for g in dataclasses.fields(hint) if MOVED_TO in g.metadata]
            if moved:
                section.tables.append(("Old names", moved))
            sections.append(section)
        else:
            top.tables[0][1].append(field_key("", f, schema))
    return sections


def moved_key(section: str, f: dataclasses.Field) -> Key:
    new = f.metadata[MOVED_TO]
    return Key(f"{section}.{f.name}", type_name(f.type), "`null`",
               f"Old name of `{new}`, still accepted (when set, it wins over `{new}`).", "MOVED_KEYS")


def strategy_section(doc: str, chosen: dict[str, str]) -> Section:
    """The keys every strategy group has, then each registered strategy's own options (its class's fields)."""
    from strategies import Strategy

    section = Section("strategy", [doc, choices_line("strategy", chosen)])
    common: dict[str, Key] = {}
    for name, schema in strategy_schemas().items():
        own = []
        for f in dataclasses.fields(schema):
            key = field_key("strategy.", f, schema)
            source = f.metadata.get(DOC_SOURCE)
            if isinstance(source, type) and issubclass(source, Strategy):
                own.append(key)
            else:
                common.setdefault(key.key, key if f.name != "name" else dataclasses.replace(key, default="its name"))
        section.tables.append((f"strategy={name}", own))
    section.tables.insert(0, ("Every strategy", list(common.values())))
    return section


def target_section(schema: type, where: str) -> Section:
    """The target's keys: its own documented fields, the keys conf/ sets (TARGET_KEYS), a pointer for the rest."""
    section = Section("target", [TARGET_INTRO, where])
    keys, others = [], []
    names = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(key for key in TARGET_KEYS if key.split(".")[0] not in names)
    if unknown:
        raise ValueError(f"TARGET_KEYS names {unknown}, which the target schema does not have")
    for f in dataclasses.fields(schema):
        source = f.metadata.get(DOC_SOURCE, schema)
        if is_project_class(source):
            keys.append(field_key("target.", f, schema))
        elif f.name in TARGET_KEYS:
            for name, (kind, doc) in TARGET_KEYS.items():
                if name == f.name or name.startswith(f.name + "."):
                    keys.append(Key(f"target.{name}", kind, "`null`" if name == f.name else "", doc,
                                    f"{source.__module__}.{source.__qualname__}"))
        else:
            others.append(f"`{f.name}`")
    section.tables.append(("", keys))
    if others:
        section.outro.append("Also accepted (unset in `conf/`; see transformers' documentation of `Qwen3_5TextConfig` "
                             f"and `PreTrainedConfig`): {', '.join(others)}.")
    return section


def file_sections() -> list[Section]:
    """The groups under conf/ that are no section of the run: presets, the preregistration, the launcher."""
    from analysis.planned import Preregistration

    def listed(group: str) -> str:
        return ", ".join(f"`{name}`" for name in group_options(group)) + "."

    return [
        Section("experiment", [
            "Presets chosen with `experiment=NAME`: " + listed("experiment"),
            "Each is a `# @package _global_` file: it picks group options and sets keys documented above (no keys "
            "of its own); its `hydra.sweeper.params` name the sweep.",
        ]),
        Section("step_mode", [
            "How optimizer steps are formed (the ablation of `experiment=ablation_steps`), chosen with "
            "`step_mode=NAME`: " + listed("step_mode"),
            "Each is a `# @package _global_` file that sets `trainer.step_tokens` and `trainer.grad_accum`.",
        ]),
        Section("preregistration", [
            "A sweep's planned analysis, read by `batchlab-report --preregistration conf/preregistration/NAME.yaml` "
            "(not composed into a run; keys as written in the file): " + listed("preregistration"),
        ], [("", dataclass_keys("", Preregistration))]),
        Section("hydra/launcher", [
            "Hydra launchers, chosen with `hydra/launcher=NAME`: " + listed("hydra/launcher"),
            "Their keys (package `hydra.launcher`) are the hydra-submitit-launcher plugin's, documented there.",
        ]),
    ]


def sections() -> list[Section]:
    return run_sections() + file_sections()


# ------------------------------------------------------------------ the page
def cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(parts: list[Section]) -> str:
    lines = [
        "# Config reference",
        "",
        "Every key of `batchlab-train`'s configuration, generated from the schemas' attribute docstrings by "
        "`python -m harness.cli.config_reference --write` (`make config-reference`); "
        "`tests/harness/cli/test_config_reference.py` fails when a key has no doc or this page is stale.",
        "",
        "Set a key in a group file under `conf/` or on the command line (`batchlab-train trainer.max_tokens=4096`). "
        "The default is the schema's; the group file chosen by default (named under each group) may set another. "
        "`None` in a type is YAML's `null`.",
    ]
    for part in parts:
        lines += ["", f"## {part.title}", ""]
        lines += [line for paragraph in part.intro for line in (paragraph, "")][:-1]
        for title, keys in part.tables:
            if title:
                lines += ["", f"### {title}"]
            if not keys:
                lines += ["", "No options of its own."]
                continue
            lines += ["", "| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
            for key in keys:
                lines.append(f"| `{key.key}` | `{cell(key.type)}` | {cell(key.default)} | {cell(key.doc)} |")
        for paragraph in part.outro:
            lines += ["", paragraph]
    return "\n".join(lines) + "\n"


def undocumented(parts: list[Section]) -> list[str]:
    """The keys with no doc line (a field of the project's with no attribute docstring)."""
    return [f"{key.key} ({key.source})" for part in parts for key in part.keys if not key.doc]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.cli.config_reference", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {PAGE.relative_to(CONF_DIR.parent)}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page is stale or a key has no doc")
    args = parser.parse_args(argv)
    parts = sections()
    page = render(parts)
    missing = undocumented(parts)
    for key in missing:
        print(f"config reference: {key} has no doc: give the field a docstring (a string right under it)",
              file=sys.stderr)
    where = PAGE.relative_to(CONF_DIR.parent)
    if args.write:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(page)
        print(f"wrote {where} ({sum(len(part.keys) for part in parts)} keys)")
    elif args.check:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print(f"{where} is stale: run python -m harness.cli.config_reference --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
