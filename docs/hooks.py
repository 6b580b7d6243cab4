"""MkDocs hook: the pages that come from the code or from the repository's root, made at build time.

One source of truth for each, so no table in the site can drift from the code:

- ``reference/cli.md``: every ``flyspec`` command and flag, walked from ``flyspec.cli.build_parser()``
  (the argparse parsers the command line itself uses);
- ``reference/config.md``: every field of the frozen config dataclasses in ``flyspec.config``, walked
  with ``dataclasses.fields``: type, default, the comment that documents it, and the CLI flag / vLLM
  key that sets it;
- ``project/*.md``: BENCHMARKS.md, EVALUATION.md, DEPLOYMENT.md and ARCHITECTURE.md from the repository
  root, their links rewritten for the site. A link to another repository file becomes its path in code
  (the site has no copy of it); a link to a file that does not exist fails the build.

Nothing here imports torch: building the parsers and the configs is what ``flyspec --help`` does.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import logging
import posixpath
import re
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.flyspec")
REPO = Path(__file__).resolve().parent.parent

# repository files shown in the site: root file → page
ROOT_PAGES = {
    "BENCHMARKS.md": "project/benchmarks.md",
    "EVALUATION.md": "project/evaluation.md",
    "DEPLOYMENT.md": "project/deployment.md",
    "ARCHITECTURE.md": "project/architecture.md",
}
GENERATED_NOTE = "<!-- generated at build time by docs/hooks.py from {source}; edit that, not this page -->\n\n"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    pages = {
        "reference/cli.md": cli_reference(),
        "reference/config.md": config_reference(),
        **{page: root_page(source) for source, page in ROOT_PAGES.items()},
    }
    for uri, content in pages.items():
        files.append(File.generated(config, uri, content=content))
    return files


# --- the command line -------------------------------------------------------------------------------


def cli_reference() -> str:
    from flyspec.cli import build_parser

    parser = build_parser()
    lines = [
        GENERATED_NOTE.format(source="flyspec.cli.build_parser()"),
        "# Command line reference\n",
        "Every command and flag of `flyspec`, generated from the argparse parsers the command line runs "
        "(`flyspec.cli.build_parser()`), so it is what `flyspec COMMAND --help` says. How to use them: "
        "the [guides](../guides/cli.md). Bad options exit with code 2 and one line saying what to change.\n",
        f"```text\n{parser.format_usage().strip()}\n```\n",
        _description(parser),
    ]
    for name, subparser in _subcommands(parser):
        lines += [f"## `flyspec {name}`\n", _description(subparser), f"```text\n{_usage(subparser)}\n```\n"]
        lines += _argument_tables(subparser)
    return "\n".join(lines)


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def _usage(parser: argparse.ArgumentParser) -> str:
    return parser.format_usage().strip().removeprefix("usage: ")


def _description(parser: argparse.ArgumentParser) -> str:
    return f"{parser.description}\n" if parser.description else ""


def _argument_tables(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    out: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS and not _is_help(a)]
        if not actions:
            continue
        title = {"positional arguments": "arguments", "options": "options"}.get(group.title or "", group.title)
        out += [f"**{title}**\n", "| option | meaning | default |", "|---|---|---|"]
        for action in actions:
            help_text = formatter._expand_help(action) if action.help else ""
            if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
                help_text += f" (choices: {', '.join(f'`{c}`' for c in action.choices)})"
            out.append(f"| {_cell(_option_names(action))} | {_cell(help_text)} | {_cell(_default(action))} |")
        out.append("")
    return out


def _is_help(action: argparse.Action) -> bool:
    return isinstance(action, argparse._HelpAction | argparse._VersionAction)


def _option_names(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`" + (" (optional)" if action.nargs == "?" else "")
    takes_value = action.nargs != 0
    metavar = action.metavar or action.dest.upper()
    return ", ".join(f"`{name} {metavar}`" if takes_value else f"`{name}`" for name in action.option_strings)


def _default(action: argparse.Action) -> str:
    default = action.default
    if default in (None, False, argparse.SUPPRESS) or default == []:
        return ""
    return f"`{default}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


# --- the configs ------------------------------------------------------------------------------------


def config_reference() -> str:
    import flyspec.config as config
    from flyspec.config.mapping import FLAT_OPTIONS, VLLM_KEYS

    flags, helps = _cli_flags()
    # SpeculationConfig fields by their dotted path; DecodeConfig's and SamplingConfig's by the flag's dest
    dests = {path: name for name, path in FLAT_OPTIONS.items()} | DECODE_DESTS
    flag_of = {path: flags.get(dest, "") for path, dest in dests.items()}
    help_of = {path: helps.get(dest, "") for path, dest in dests.items()}
    vllm_of = {path: key for key, path in VLLM_KEYS.items()}
    lines = [
        GENERATED_NOTE.format(source="the dataclasses of flyspec.config"),
        "# Configuration reference\n",
        "Every field of flyspec's frozen config dataclasses, generated from the classes themselves "
        "(`dataclasses.fields`, their defaults, and the comment or docstring that documents each field). "
        "`flyspec.config` is the one place these defaults live. Each config checks itself when built and "
        "raises `flyspec.ConfigError` with a message saying what to change.\n",
        "A `SpeculationConfig` is written as nested JSON with the same names (`--speculative-config`, "
        '`SpeculationConfig.from_dict({"fly": {"window_size": 4}})`, the server\'s defaults); the column '
        "*flag* names the `flyspec generate` / `bench` / `eval` / `serve` flag that sets a field, *vLLM key* "
        "the `speculative_config` key that `from_dict` also reads.\n",
    ]
    nested: dict[type, str] = {}
    for name, value in vars(config.SpeculationConfig()).items():
        if dataclasses.is_dataclass(value):
            nested[type(value)] = name
    nested[config.SamplingConfig] = ""
    # the configs live in three modules of flyspec.config, which re-exports them all
    modules = ("flyspec.config.speculation", "flyspec.config.rules", "flyspec.config.drafters")
    classes = [c for c in vars(config).values() if any(_is_config_class(c, module) for module in modules)]
    ordered = sorted(classes, key=lambda c: (c is not config.SpeculationConfig, c is not config.DecodeConfig))
    for cls in ordered:
        prefix = nested.get(cls)
        lines += _config_section(cls, prefix, flag_of, help_of, vllm_of)
    lines.append(
        "`flyspec calibrate`'s own settings (`CalibrationConfig`, `Budget`) are in the "
        "[Python API reference](api.md#calibration).\n"
    )
    return "\n".join(lines)


def _is_config_class(value: Any, module: str) -> bool:
    return (
        inspect.isclass(value)
        and dataclasses.is_dataclass(value)
        and value.__module__ == module
        and value.__dataclass_params__.frozen  # type: ignore[attr-defined]
    )


def _config_section(
    cls: type, prefix: str | None, flag_of: dict[str, str], help_of: dict[str, str], vllm_of: dict[str, str]
) -> list[str]:
    doc = inspect.getdoc(cls) or ""
    comments = _field_comments(cls)
    hints = typing.get_type_hints(cls)
    where = f" (`SpeculationConfig.{prefix}`)" if prefix else ""
    out = [
        f"## `{cls.__name__}`{where} {{ #{cls.__name__.lower()} }}\n",
        f"`{cls.__module__}.{cls.__name__}`\n",
        _doc_markdown(doc) + "\n",
    ]
    out += ["| field | type | default | flag | vLLM key | meaning |", "|---|---|---|---|---|---|"]
    for item in dataclasses.fields(cls):
        path = f"{prefix}.{item.name}" if prefix else item.name
        known = prefix is not None or cls.__name__ in ("SpeculationConfig", "DecodeConfig")
        flag = flag_of.get(path, "") if known else ""
        vllm = vllm_of.get(path, "") if known else ""
        meaning = comments.get(item.name) or (help_of.get(path, "") if known else "")
        out.append(
            f"| `{item.name}` | `{_cell(_type_name(hints.get(item.name, item.type)))}` | {_cell(_field_default(item))} "
            f"| {_cell(flag)} | {f'`{vllm}`' if vllm else ''} | {_cell(_doc_markdown(meaning))} |"
        )
    out.append("")
    return out


def _doc_markdown(doc: str) -> str:
    """A docstring as Markdown: reST double backticks become code, Sphinx roles their name."""
    doc = re.sub(r":(?:class|func|meth|mod|attr):`~?([^`]+)`", r"`\1`", doc)
    return doc.replace("``", "`")


def _type_name(annotation: Any) -> str:
    text = inspect.formatannotation(annotation)
    return re.sub(r"flyspec\.config\.(?:\w+\.)?", "", text.replace("typing.", ""))


def _field_default(item: dataclasses.Field[Any]) -> str:
    if item.default is not dataclasses.MISSING:
        return f"`{item.default!r}`"
    if item.default_factory is not dataclasses.MISSING:
        value = item.default_factory()
        if dataclasses.is_dataclass(value):
            return f"[`{type(value).__name__}()`](#{type(value).__name__.lower()})"
        return f"`{value!r}`"
    return "required"


def _field_comments(cls: type) -> dict[str, str]:
    """Field name → its comment: the ``# ...`` on the field's line, or the comment lines just above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    comment_at: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comment_at[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line = node.lineno
            text = comment_at.get(line, "")
            above: list[str] = []
            previous = line - 1
            while previous in comment_at and lines[previous - 1].lstrip().startswith("#"):
                above.insert(0, comment_at[previous])
                previous -= 1
            out[node.target.id] = " ".join([*above, text]).strip()
    return out


# DecodeConfig / SamplingConfig field (as the config reference names it) → the ``dest`` of its generate flag
DECODE_DESTS = {
    "max_new_tokens": "max_new_tokens",
    "stop_strings": "stop",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
}


def _cli_flags() -> tuple[dict[str, str], dict[str, str]]:
    """``dest`` → the ``flyspec generate`` flags that set it (``--window-size``), and ``dest`` → their help."""
    from flyspec.cli import build_parser

    generate = dict(_subcommands(build_parser()))["generate"]
    formatter = generate._get_formatter()
    flags: dict[str, str] = {}
    helps: dict[str, str] = {}
    for action in generate._actions:
        if action.option_strings and action.dest not in flags:
            flags[action.dest] = ", ".join(f"`{name}`" for name in action.option_strings)
            helps[action.dest] = formatter._expand_help(action) if action.help else ""
    return flags, helps


# --- the root files ---------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]+)\)")


def root_page(source: str) -> str:
    text = (REPO / source).read_text(encoding="utf-8")
    page = ROOT_PAGES[source]
    body = _LINK.sub(lambda match: _rewrite(match, source, page), text)
    return GENERATED_NOTE.format(source=source) + body


def _rewrite(match: re.Match[str], source: str, page: str) -> str:
    text, target = match["text"], match["target"]
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return match.group(0)  # a web address or a link inside the page
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    suffix = f"#{anchor}" if anchor else ""
    if resolved in ROOT_PAGES:
        return f"[{text}]({posixpath.relpath(ROOT_PAGES[resolved], posixpath.dirname(page))}{suffix})"
    if resolved == "README.md":
        return f"[{text}]({posixpath.relpath('index.md', posixpath.dirname(page))})"
    if resolved.startswith("docs/"):
        return f"[{text}]({posixpath.relpath(resolved.removeprefix('docs/'), posixpath.dirname(page))}{suffix})"
    if not (REPO / resolved).exists():
        log.warning("%s links to %r, which does not exist in the repository", source, target)
        return match.group(0)
    if text.strip("`").rstrip("/") == path.rstrip("/"):
        return f"`{path}`"
    return f"{text} (`{path}`)"
