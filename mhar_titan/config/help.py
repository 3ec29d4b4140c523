"""``python train.py --help [SECTION ...]``: the job config's sections and keys, read from the schema.

Every key of every section is listed with its TOML type, its default and the first sentence of
its description, all taken from the section dataclasses (``mhar_titan.config.sections``, and
``mhar_titan.models.args.ModelArgs`` for the ``[model]`` keys beside ``flavor``): a field's
description is the string literal after it (an attribute docstring) or, failing that, the
``#`` comment on its line. A key added to a dataclass therefore appears here with nothing else
to edit.

``help_request(argv)`` finds ``-h`` / ``--help [SECTION ...]`` on a training command line;
``config_help(section)`` is the text. Imports no torch.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import typing
from typing import Optional

from mhar_titan.config.sections import SECTIONS, JobConfig
from mhar_titan.errors import ConfigError

USAGE = """\
usage: python train.py --config FILE [--section.key=value ...]
       torchrun --nproc_per_node=N train.py --config FILE [--section.key=value ...]
       python train.py --help [SECTION ...]

Trains the job a TOML file describes (train_configs/*.toml); each --section.key=value (or
--section.key value) overrides one key: command line > TOML file > the defaults below.
Lists are comma-separated items (--data.files=a.parquet,b/*.parquet, --compile.components=whole_model)
or TOML arrays quoted for the shell (--compile.components='["model", "loss"]'); tables such as
[[data.sources]] are TOML inline tables. Exit status: 0 done (also after a preemption), 2 bad input
(one line naming the key or file), 1 stopped for training health (or the output's reader closed, as
after | head). Check a job without training: python -m mhar_titan.dryrun --config FILE."""


WIDTH = 100
"""Characters per line of the key descriptions."""


def help_request(argv: list[str]) -> Optional[tuple[Optional[str], ...]]:
    """The sections asked for when ``argv`` asks for help (``-h``, ``--help``, ``--help SECTION
    [SECTION ...]``, ``--help=SECTION``): ``(None,)`` for all, ``(section, ...)`` for those named;
    else None. The values of ``--section.key VALUE`` pairs are skipped."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            named = []
            for nxt in argv[i + 1:]:
                if nxt.startswith("-"):
                    break
                named.append(nxt)
            return tuple(named) or (None,)
        if arg.startswith("--help="):
            return (arg.split("=", 1)[1] or None,)
        if arg.startswith("--") and "=" not in arg:
            i += 1  # its value is the next token
        i += 1
    return None


ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.")
"""Periods that do not end a sentence."""


def _first_sentence(text: str) -> str:
    """The description's first sentence, on one line, without reST's double backquotes."""
    text = " ".join(text.replace("``", "").split())
    for cut in (i for i, c in enumerate(text) if c == "." and text[i + 1:i + 2] == " "):
        head = text[:cut + 1]
        if head.count("(") == head.count(")") and not head.endswith(ABBREVIATIONS):
            return head
    return text


@functools.lru_cache(maxsize=None)
def field_descriptions(cls: type) -> dict[str, str]:
    """Field name -> description of a dataclass's fields (its bases' first): the attribute docstring
    after the field, else the ``#`` comment on the field's line; "" when there is neither."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__[:-1]):
        try:
            source = textwrap.dedent(inspect.getsource(base))
        except (OSError, TypeError):
            continue
        comments = {tok.start[0]: tok.string.lstrip("# ").strip()
                    for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
        body = ast.parse(source).body[0].body
        for node, after in zip(body, [*body[1:], None]):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            text = ""
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                    isinstance(after.value.value, str):
                text = after.value.value
            elif node.end_lineno in comments:
                text = comments[node.end_lineno]
            out[node.target.id] = text
    return out


def _type_text(tp) -> str:
    from mhar_titan.config.parser import _type_name

    return _type_name(tp)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _value_text(value) -> str:
    if value is None:
        return "unset"
    from mhar_titan.config.parser import toml_value

    try:
        return toml_value(value)
    except TypeError:
        return repr(value)


def _key_lines(section: str, cls: type, skip: tuple[str, ...] = ()) -> list[str]:
    """``--section.key = default  (type)`` and the key's meaning below it, wrapped, for every field."""
    from mhar_titan.config.parser import _CHOICES, _field_types

    types_ = _field_types(cls)
    described = field_descriptions(cls)
    lines = []
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name.startswith("_"):
            continue
        choices = _CHOICES.get((section, f.name))
        kind = "one of " + ", ".join(map(repr, choices)) if choices else _type_text(types_.get(f.name, f.type))
        lines.append(f"  --{section}.{f.name} = {_value_text(_default(f))}  ({kind})")
        meaning = _first_sentence(described.get(f.name, ""))
        if meaning:
            lines += textwrap.wrap(meaning, WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def _section_class(section: str) -> type:
    return typing.get_type_hints(JobConfig)[section]


def _section_summary(section: str) -> str:
    doc = inspect.getdoc(_section_class(section)) or ""
    first = _first_sentence(doc)
    prefix = f"``[{section}]``:"
    prefix = prefix.replace("``", "")
    return first[len(prefix):].strip() if first.startswith(prefix) else first


def section_help(section: str) -> str:
    """One section's keys with their types, defaults and meanings.

    Raises:
        ConfigError: ``section`` is not a section of the job config (the message lists them).
    """
    if section not in SECTIONS:
        raise ConfigError(f"--help {section}: unknown section; sections: {', '.join(SECTIONS)}")
    cls = _section_class(section)
    lines = textwrap.wrap(f"[{section}]  {_section_summary(section)}", WIDTH, subsequent_indent="    ")
    if section == "model":
        from mhar_titan.models.args import FLAVORS, ModelArgs

        lines += _key_lines("model", cls, skip=("overrides",))
        lines += textwrap.wrap(f"Every field of ModelArgs is also a [model] key, overriding the flavor's value "
                               f"(flavors: {', '.join(FLAVORS)}; python -m mhar_titan.models lists them). The "
                               "defaults below are ModelArgs' own; a flavor sets the shape fields:", WIDTH,
                               initial_indent="  ", subsequent_indent="  ")
        lines += _key_lines("model", ModelArgs)
    elif section == "data":
        from mhar_titan.config.data import MixtureSource

        lines += _key_lines("data", cls)
        lines.append("  Each table of data.sources (a data mixture) holds these keys:")
        lines += _key_lines("data.sources[i]", MixtureSource)
    else:
        lines += _key_lines(section, cls)
    return "\n".join(lines)


def config_help(section: Optional[str] = None, *more: str) -> str:
    """The usage and every section's keys (``section`` None), or the keys of the sections named.

    Raises:
        ConfigError: an unknown section (every name is checked before any text is made).
    """
    if section is not None:
        return "\n\n".join([section_help(name) for name in (section, *more)])
    index = "\n".join(f"  {name:<22} " + textwrap.shorten(_section_summary(name), WIDTH - 25, placeholder=" ...")
                      for name in SECTIONS)
    return "\n\n".join([USAGE, "sections (python train.py --help SECTION for one):\n" + index,
                        *(section_help(name) for name in SECTIONS)])
