"""Settings declared once: each field of a ``*Config`` dataclass carries its help text, and the
command-line flags and ``PDSERVE_*`` environment variables are generated from the fields.

    @dataclass(frozen=True)
    class SchedulerConfig:
        max_num_seqs: int = setting(64, "sequences in the running batch, at most")

    add_settings(parser, SchedulerConfig, os.environ)  # --max-num-seqs, PDSERVE_MAX_NUM_SEQS
    config = build(SchedulerConfig, parser.parse_args())

A flag on the command line wins over its environment variable, which wins over the field's
default. Nested config fields (``EngineConfig.cache``) contribute their own settings. Secrets
(the cluster token, the Redis password) never become flags: they come from an environment
variable, or from a file named by a ``--...-file`` flag. The environment is read only by the
entry point that calls ``add_settings``, which passes it in.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "PDSERVE_"
T = TypeVar("T")
Parse = Callable[[str], Any]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Setting:
    """What the command line and the environment need to know about one config field."""

    help: str
    flag: str | None = None  # default: --field-name
    choices: tuple[Any, ...] | None = None
    parse: Parse | None = None  # default: from the field's type
    metavar: str | None = None
    secret_file_flag: str | None = None  # secrets: no flag of their own, a file flag instead
    const: Any = None  # not None: the flag may be given without a value, meaning this


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    choices: tuple[Any, ...] | None = None,
    parse: Parse | None = None,
    metavar: str | None = None,
    const: Any = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that is also a flag and an environment variable."""
    meta = {"setting": Setting(help, flag, choices, parse, metavar, const=const)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def secret(help: str, file_flag: str) -> Any:
    """A secret field (default None): from ``PDSERVE_<NAME>`` or the file ``file_flag`` names."""
    meta = {"setting": Setting(help, secret_file_flag=file_flag)}
    return dataclasses.field(default=None, repr=False, metadata=meta)


def parse_size(text: str) -> int:
    """Bytes from ``1073741824``, ``512M``, ``1G``, ``1.5GiB`` (K, M, G, T: powers of 1024)."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes or a number with K, M, G or T (e.g. 512M, 1G)"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def format_size(num_bytes: int) -> str:
    """The shortest exact unit form of a byte count: 1073741824 -> '1G'."""
    for unit in "TGMK":
        scale = 1024 ** " KMGT".index(unit)
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


def flag_of(name: str, spec: Setting) -> str:
    return spec.flag or "--" + name.replace("_", "-")


def env_name(flag: str) -> str:
    """``--max-num-seqs`` -> ``PDSERVE_MAX_NUM_SEQS``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def settings_of(
    cls: type, nested: bool = True
) -> Iterator[tuple[str, dataclasses.Field[Any], Setting, type]]:
    """(dotted path, field, setting, field type) of every setting of ``cls``, with those of its
    nested config fields unless ``nested`` is False."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        spec = f.metadata.get("setting")
        if spec is not None:
            yield f.name, f, spec, kind
        elif nested and dataclasses.is_dataclass(kind):
            for path, sub, sub_spec, sub_kind in settings_of(kind):  # type: ignore[arg-type]
                yield f"{f.name}.{path}", sub, sub_spec, sub_kind


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default: settings say it themselves, other flags get it appended."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def add_settings(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    env: Mapping[str, str],
    prefix: str = "",
    skip: tuple[str, ...] = (),
    defaults: Mapping[str, Any] | None = None,
    nested: bool = True,
) -> None:
    """Add a flag for every setting of ``cls`` (nested configs' too, unless ``nested`` is
    False), but the dotted paths in ``skip``; its default is the environment's value, else
    ``defaults[path]``, else the field's default. ``prefix`` goes before every dotted path (the
    destination in the parsed namespace): a nested config's fields added on their own."""
    for path, f, spec, kind in settings_of(cls, nested):
        if path in skip:
            continue
        path = prefix + path
        if spec.secret_file_flag is not None:
            _add_secret(parser, path, f, spec, env)
            continue
        flag = flag_of(f.name, spec)
        default = (defaults or {}).get(path, _field_default(f))
        name = env_name(flag)
        if name in env:
            default = _from_env(name, env[name], kind, spec, flag)
        shown = _shown(default, spec)
        help_text = f"{spec.help} (default: {shown}; env {name})"
        if _base_type(kind) is bool:
            _add_bool(parser, path, flag, bool(default), help_text)
            continue
        optional_value = {"nargs": "?", "const": spec.const} if spec.const is not None else {}
        parser.add_argument(
            flag,
            dest=path,
            default=default,
            type=spec.parse or _base_type(kind),
            choices=spec.choices,
            metavar=spec.metavar or flag.lstrip("-").replace("-", "_").upper(),
            help=help_text,
            **optional_value,
        )


def build(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """An instance of ``cls`` from parsed ``args`` (see ``add_settings``); ``overrides`` set
    fields that are not settings (or replace those that are), by field name."""
    return _build(cls, args, "", overrides)


def from_fields(cls: type[T], **values: Any) -> T:
    """An instance of ``cls`` from field values given by field name, nested configs' fields
    included (``from_fields(EngineConfig, max_num_seqs=8)`` sets ``scheduler.max_num_seqs``).
    Raises TypeError naming fields ``cls`` does not have."""
    instance = _from_fields(cls, values)
    if values:
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(sorted(values))}")
    return instance


def _from_fields(cls: type[T], values: dict[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in values:
            kwargs[f.name] = values.pop(f.name)
        elif dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _from_fields(hints[f.name], values)
    return cls(**kwargs)


def to_flags(config: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The command-line flags that recreate ``config``'s settings where they differ from the
    defaults (``pdserve up`` hands its workers their flags this way). Secrets are not flags."""
    flags: list[str] = []
    for path, f, spec, kind in settings_of(type(config)):
        if path in skip or spec.secret_file_flag is not None:
            continue
        value = _get(config, path)
        if value == _field_default(f):
            continue
        flag = flag_of(f.name, spec)
        if _base_type(kind) is bool:
            if flag.startswith("--no-"):
                flags.append(flag)  # the default is True: only False differs
            else:
                flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            shown = format_size(value) if spec.parse is parse_size else str(value)
            flags += [flag, shown]
    return flags


def _build(cls: type[T], args: argparse.Namespace, prefix: str, overrides: dict[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        path = prefix + f.name
        if not prefix and f.name in overrides:
            values[f.name] = overrides[f.name]
        elif "setting" in f.metadata and hasattr(args, path):
            values[f.name] = getattr(args, path)
            if f.metadata["setting"].secret_file_flag is not None:
                values[f.name] = _read_secret(args, path)
        elif dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = _build(hints[f.name], args, path + ".", {})
    return cls(**values)


def _add_secret(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    path: str,
    f: dataclasses.Field[Any],
    spec: Setting,
    env: Mapping[str, str],
) -> None:
    assert spec.secret_file_flag is not None
    file_flag, value_env = spec.secret_file_flag, env_name("--" + f.name)
    file_env = env_name(file_flag)
    parser.add_argument(
        file_flag,
        dest=path + ":file",
        default=env.get(file_env),
        metavar="PATH",
        help=f"{spec.help}: read it from this file (or set {value_env}; env {file_env})",
    )
    parser.set_defaults(**{path: env.get(value_env) or None})


def _read_secret(args: argparse.Namespace, path: str) -> str | None:
    value = getattr(args, path)
    file = getattr(args, path + ":file", None)
    if value or not file:
        return value or None
    try:
        text = Path(file).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the secret file {file}: {exc.strerror}") from exc
    if not text:
        raise ValueError(f"the secret file {file} is empty")
    return text


def _add_bool(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    path: str,
    flag: str,
    default: bool,
    help_text: str,
) -> None:
    if flag.startswith("--no-"):  # a negative switch of a setting that is on by default
        parser.add_argument(
            flag, dest=path, action="store_const", const=False, default=default, help=help_text
        )
    else:
        parser.add_argument(
            flag,
            dest=path,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=help_text,
        )


def _from_env(name: str, text: str, kind: Any, spec: Setting, flag: str) -> Any:
    """An environment variable's value, parsed as the flag would be (errors name the variable)."""
    base = _base_type(kind)
    if base is bool:
        on = text.strip().lower() in ("1", "true", "yes", "on")
        return not on if flag.startswith("--no-") else on
    if text == "" and _is_optional(kind):
        return None
    try:
        value = (spec.parse or base)(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{name}={text!r}: {exc}") from exc
    if spec.choices is not None and value not in spec.choices:
        raise ValueError(f"{name}={text!r}: choose one of {', '.join(map(str, spec.choices))}")
    return value


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _get(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _shown(default: Any, spec: Setting) -> str:
    if default is None:
        return "none"
    if spec.parse is parse_size and isinstance(default, int):
        return format_size(default)
    return str(default)


def _is_optional(kind: Any) -> bool:
    return type(None) in typing.get_args(kind)


def _base_type(kind: Any) -> Any:
    """``int | None`` -> ``int``; plain types as they are."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return kind
