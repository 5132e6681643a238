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

A setting without a default is a required flag (unless its variable is set). A ``tuple[T, ...]``
setting takes one or more values (``--batch-sizes 1 2 4``; with ``repeat``: one value, the flag
given again for more), and its variable holds them separated by commas.

A setting several configs share is declared once, on one dataclass, and the others take it with
``same_setting``: the same flag, variable, help and default (``common.shared_settings``).
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
    repeat: bool = False  # tuple settings: one value per flag, the flag repeated for more
    fallback_env: str | None = None  # a variable read when PDSERVE_<NAME> is not set


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    choices: tuple[Any, ...] | None = None,
    parse: Parse | None = None,
    metavar: str | None = None,
    const: Any = None,
    repeat: bool = False,
    fallback_env: str | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that is also a flag and an environment variable (no default: a
    required flag)."""
    spec = Setting(
        help,
        flag,
        choices,
        parse,
        metavar,
        const=const,
        repeat=repeat,
        fallback_env=fallback_env,
    )
    meta = {"setting": spec}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def secret(help: str, file_flag: str) -> Any:
    """A secret field (default None): from ``PDSERVE_<NAME>`` or the file ``file_flag`` names."""
    meta = {"setting": Setting(help, secret_file_flag=file_flag)}
    return dataclasses.field(default=None, repr=False, metadata=meta)


def same_setting(
    cls: type, name: str, *, default: Any = dataclasses.MISSING, note: str = ""
) -> Any:
    """A field that is ``cls``'s setting ``name`` again, for a config that shares it: the same
    flag, variable, help and default, declared once on ``cls``. The field must be called
    ``name`` too. ``default`` replaces the default; ``note`` is added to the help (what this
    component does with the setting)."""
    origin = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if origin is None or "setting" not in origin.metadata:
        raise TypeError(f"{cls.__name__} has no setting {name!r}")
    spec: Setting = origin.metadata["setting"]
    if note:
        spec = dataclasses.replace(spec, help=f"{spec.help}; {note}")
    meta = {"setting": spec, "same_as": (cls, name)}
    kwargs: dict[str, Any] = {"repr": origin.repr, "metadata": meta}
    if default is not dataclasses.MISSING:
        kwargs["default"] = default
    elif origin.default_factory is not dataclasses.MISSING:
        kwargs["default_factory"] = origin.default_factory
    else:
        kwargs["default"] = origin.default
    return dataclasses.field(**kwargs)


def shared_with(cls: type, origin: type) -> tuple[str, ...]:
    """The names of ``cls``'s settings that are ``origin``'s (``same_setting``)."""
    return tuple(
        f.name for f in dataclasses.fields(cls) if f.metadata.get("same_as", (None,))[0] is origin
    )


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
        same_as = f.metadata.get("same_as")
        if same_as is not None and same_as[1] != f.name:
            raise TypeError(f"{cls.__name__}.{f.name} is {same_as[0].__name__}.{same_as[1]}")
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
    only: tuple[str, ...] | None = None,
) -> None:
    """Add a flag for every setting of ``cls`` (nested configs' too, unless ``nested`` is
    False), but the dotted paths in ``skip`` (and, given ``only``, but those in ``only`` or
    under them); its default is the environment's value, else ``defaults[path]``, else the
    field's default. ``prefix`` goes before every dotted path (the destination in the parsed
    namespace): a nested config's fields added on their own."""
    for path, f, spec, kind in settings_of(cls, nested):
        if path in skip or (only is not None and not _under(path, only)):
            continue
        path = prefix + path
        if spec.secret_file_flag is not None:
            _add_secret(parser, path, f, spec, env)
            continue
        flag = flag_of(f.name, spec)
        default = (defaults or {}).get(path, _field_default(f))
        name = env_name(flag)
        names = name + (f" or {spec.fallback_env}" if spec.fallback_env else "")
        required = _is_required(f) and path not in (defaults or {})
        for var in (name, spec.fallback_env):
            if var is not None and var in env:
                default, required = _from_env(var, env[var], kind, spec, flag), False
                break
        if _base_type(kind) is bool:
            _add_bool(parser, path, flag, bool(default), spec.help, names)
            continue
        text, shown = _help_and_default(spec, default, required)
        help_text = f"{text} ({shown}; env {names})"
        item = _item_type(kind)
        metavar = spec.metavar or flag.lstrip("-").replace("-", "_").upper()
        if spec.choices is not None and spec.metavar is None:
            metavar = "{" + ",".join(map(str, spec.choices)) + "}"
        if item is not None:  # one or more values; the flag given again adds more
            parser.add_argument(
                flag,
                dest=path,
                default=default,
                type=spec.parse or item,
                choices=spec.choices,
                nargs=None if spec.repeat else "+",
                action=_Items,
                required=required,
                metavar=metavar,
                help=help_text,
            )
            continue
        optional_value = {"nargs": "?", "const": spec.const} if spec.const is not None else {}
        parser.add_argument(
            flag,
            dest=path,
            default=default,
            type=spec.parse or _base_type(kind),
            choices=spec.choices,
            required=required,
            metavar=metavar,
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
        elif _item_type(kind) is not None:  # an empty tuple is no flag: the default stands
            items = [str(item) for item in value]
            if spec.repeat:
                for item in items:
                    flags += [flag, item]
            elif items:
                flags += [flag, *items]
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


class _Items(argparse.Action):
    """A tuple setting's flag: its values replace the default, and the flag given again adds
    more (``--stop a --stop b``, ``--batch-sizes 1 2 --batch-sizes 4``)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        before = () if current is self.default or current is None else tuple(current)
        setattr(
            namespace, self.dest, (*before, *(values if isinstance(values, list) else [values]))
        )


def _add_bool(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    path: str,
    flag: str,
    default: bool,
    text: str,
    names: str,
) -> None:
    """``--x`` and ``--no-x``, whichever the setting declares (``flag="--no-x"``: a setting on
    by default, whose variable is PDSERVE_NO_X); the help says what on means."""
    positive = "--" + flag.removeprefix("--").removeprefix("no-")
    env = f"{names}=1 turns it off" if flag.startswith("--no-") else names
    parser.add_argument(
        positive,
        "--no-" + positive[2:],
        dest=path,
        action=_Switch,
        default=default,
        help=f"{text} (default: {'on' if default else 'off'}; env {env})",
    )


class _Switch(argparse.Action):
    """A boolean flag and its ``--no-`` form (as argparse's BooleanOptionalAction, whose help
    would add a second default)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, not (option_string or "").startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _help_and_default(spec: Setting, default: Any, required: bool) -> tuple[str, str]:
    """The help text and its "default: ..." part, one default per flag: a help that says what
    no value means ("(none: X)") or what the default is ("(default: X)", a computed one) gives
    its words to the default."""
    if required:
        return spec.help, "required"
    shown = _shown(default, spec)
    said = re.search(r"\s*\((none|default): ([^()]*)\)", spec.help)
    if said is None or (said.group(1) == "none" and default is not None):
        return spec.help, f"default: {shown}"
    text = spec.help[: said.start()] + spec.help[said.end() :]
    if said.group(1) == "none":
        return text, f"default: {said.group(2)}"
    return text, f"default: {said.group(2)} ({shown} here)"


def _from_env(name: str, text: str, kind: Any, spec: Setting, flag: str) -> Any:
    """An environment variable's value, parsed as the flag would be (errors name the variable)."""
    base = _base_type(kind)
    if base is bool:
        on = text.strip().lower() in ("1", "true", "yes", "on")
        return not on if flag.startswith("--no-") else on
    if text == "" and _is_optional(kind):
        return None
    item = _item_type(kind)
    texts = [t.strip() for t in text.split(",") if t.strip()] if item is not None else [text]
    try:
        values = [(spec.parse or item or base)(t) for t in texts]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{name}={text!r}: {exc}") from exc
    if spec.choices is not None and any(v not in spec.choices for v in values):
        raise ValueError(f"{name}={text!r}: choose one of {', '.join(map(str, spec.choices))}")
    return tuple(values) if item is not None else values[0]


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _is_required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _under(path: str, paths: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in paths)


def _get(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _shown(default: Any, spec: Setting) -> str:
    if default is None or default == ():
        return "none"
    if isinstance(default, tuple):
        return " ".join(map(str, default))
    if spec.parse is parse_size and isinstance(default, int):
        return format_size(default)
    return str(default)


def _is_optional(kind: Any) -> bool:
    return type(None) in typing.get_args(kind)


def _item_type(kind: Any) -> Any:
    """``tuple[int, ...]`` -> ``int``; None for other types."""
    if typing.get_origin(kind) is tuple:
        return typing.get_args(kind)[0]
    return None


def _base_type(kind: Any) -> Any:
    """``int | None`` -> ``int``; plain types as they are."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return kind
