"""Typed configuration: dataclasses, YAML files and dotted command-line overrides.

Every config is a `kw_only` dataclass deriving from `Config`. A config tree is read from a plain
dict (a YAML file, a preset) by `Config.from_dict`, which rejects unknown keys and wrong types
with the dotted key in the message; `apply_overrides` applies `--a.b.c=value` strings to a tree;
`to_dict`/`to_yaml` write it back. Every numeric field declares its domain next to it
(`positive`, `non_negative`, `in_range`: a `Domain` in the field's metadata; a float field
without one must still be finite); `validate_tree` checks every field against its domain and
then calls each config's `validate()` (the cross-field rules), depth first.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import enum
import functools
import inspect
import math
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Self

import yaml

from moetrain.errors import ConfigError, file_kind


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints` of a config class, read once: `moetrain plan`'s search validates
    hundreds of layouts, and evaluating the annotations is most of what a validation costs."""
    return typing.get_type_hints(cls)


@dataclasses.dataclass(kw_only=True)
class Config:
    """Base class of every config dataclass."""

    renamed: ClassVar[dict[str, str]] = {}
    """Keys read under an earlier dotted name (old → new, both relative to this config): `from_dict`,
    `apply_overrides` and `load_yaml` read the old one as the new one (`rename_keys`)."""
    retired: ClassVar[dict[str, tuple[Any, str]]] = {}
    """Keys no longer read (dotted, relative to this config) → (the value that behaves as the code
    does now, `...` for any; why the key is gone and what to use): `from_dict` and
    `apply_overrides` drop that value with a note and refuse another (`retire`)."""

    def validate(self) -> None:
        """Cross-field checks; raise `ConfigError` naming the field. Default: nothing."""

    def check_domains(self, prefix: str = "") -> None:
        """Every leaf field of this config (not of its sub-configs) against its type and its
        declared `Domain`; raise `ConfigError` naming the dotted key, the value and the domain."""
        hints = _field_types(type(self))
        for f in dataclasses.fields(self):
            tp = hints[f.name]
            if isinstance(tp, type) and issubclass(tp, Config):
                if not isinstance(getattr(self, f.name), tp):
                    raise ConfigError(
                        f"{prefix}{f.name}={_short(getattr(self, f.name))} is no {tp.__name__}: "
                        f"set its fields (cfg.{prefix}{f.name}.KEY = …), not the section."
                    )
                continue
            _check_value(getattr(self, f.name), tp, f.metadata.get("domain"), f"{prefix}{f.name}")

    @classmethod
    def from_dict(cls, data: dict[str, Any], prefix: str = "") -> Self:
        if not isinstance(data, dict):
            raise ConfigError(
                f"'{prefix or '<root>'}' must be a mapping of keys to values, got {type(data).__name__} {_short(data)}."
            )
        data = drop_retired(rename_keys(data, cls.renamed, prefix), cls.retired, prefix)
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        kwargs = {}
        for key, value in data.items():
            dotted = f"{prefix}{key}"
            if key not in fields:
                raise ConfigError(_unknown_key_message(dotted, key, list(fields)))
            kwargs[key] = _coerce(value, hints[key], dotted)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


# ---- domains -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Domain:
    """The values a numeric field (or each item of a list of numbers) may take: finite, between
    `lo` and `hi` (each closed or open), checked by `validate_tree`. `None` passes when the
    field's type allows it."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    unit: str = ""
    """What the number counts, for the message: "seconds", "steps"…"""
    interval: bool = False
    """Describe the domain as an interval ("in [0, 1)") rather than a bound."""

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def describe(self, integer: bool) -> str:
        """The domain as the messages and the --help show it: "a positive integer, at most 10^9"."""
        kind = "integer" if integer else "number"
        kind += f" of {self.unit}" if self.unit else ""
        finite = "" if integer else "finite "
        if self.lo is not None and self.hi is not None and self.interval:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            text = f"{finite}{kind} in {left}{_num(self.lo)}, {_num(self.hi)}{right}"
        elif self.lo == 0 and self.lo_open:
            text = f"{finite}positive {kind}"
        elif self.lo is not None:
            text = f"{finite}{kind} {'>' if self.lo_open else '≥'} {_num(self.lo)}"
        else:
            text = f"{finite}{kind}"
        if self.hi is not None and not self.interval:
            text += f", {'below' if self.hi_open else 'at most'} {_num(self.hi)}"
        return ("an " if text[0] in "aeiou" else "a ") + text


def positive(default: Any = dataclasses.MISSING, *, at_most: float | None = None, unit: str = "", **field: Any) -> Any:
    """A dataclass field whose value must be > 0 (and ≤ `at_most`)."""
    return _domain_field(default, Domain(lo=0, lo_open=True, hi=at_most, unit=unit), field)


def non_negative(
    default: Any = dataclasses.MISSING, *, at_most: float | None = None, unit: str = "", **field: Any
) -> Any:
    """A dataclass field whose value must be ≥ 0 (and ≤ `at_most`)."""
    return _domain_field(default, Domain(lo=0, hi=at_most, unit=unit), field)


def in_range(
    default: Any = dataclasses.MISSING,
    *,
    lo: float,
    hi: float,
    lo_open: bool = False,
    hi_open: bool = False,
    **field: Any,
) -> Any:
    """A dataclass field whose value must lie between `lo` and `hi` (closed unless `*_open`)."""
    return _domain_field(default, Domain(lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, interval=True), field)


def _domain_field(default: Any, domain: Domain, field: dict[str, Any]) -> Any:
    return dataclasses.field(default=default, metadata={"domain": domain}, **field)


def _num(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer():
        x = int(x)
        if x >= 10**5 and str(x).rstrip("0") == "1":
            return f"10^{len(str(x)) - 1}"
        if x >= 2**16 and x & (x - 1) == 0:
            return f"2^{x.bit_length() - 1}"
        return str(x)
    return f"{x:g}"


def numeric_type(tp: Any) -> tuple[type | None, bool, bool]:
    """(int or float or None, whether None is allowed, whether it is a list of them) of an annotation."""
    args = typing.get_args(tp)
    nullable = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        nullable = type(None) in args
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            return None, nullable, False
        tp = rest[0]
        args = typing.get_args(tp)
    if typing.get_origin(tp) in (list, tuple) and len(args) == 1 and args[0] in (int, float):
        return args[0], nullable, True
    return (tp if tp in (int, float) else None), nullable, False


def _check_value(value: Any, tp: Any, domain: Domain | None, key: str) -> None:
    kind, nullable, is_list = numeric_type(tp)
    if kind is None:
        return _check_text(value, tp, key)
    if value is None and nullable:
        return
    items = list(value) if is_list and isinstance(value, (list, tuple)) else [value]
    if is_list and not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}={value!r} must be a list of numbers. Write it as [a, b].")
    domain = domain or Domain()
    for item in items:
        is_int = isinstance(item, int) and not isinstance(item, bool)
        ok_type = is_int if kind is int else (is_int or isinstance(item, float))
        if not (ok_type and domain.admits(item)):
            what = domain.describe(kind is int)
            if is_list:
                raise ConfigError(f"{key}={_shown(value)} must hold only values that are each {what}.")
            null = " (or null)" if nullable else ""
            raise ConfigError(f"{key}={_shown(value)} must be {what}{null}.")


def _check_text(value: Any, tp: Any, key: str) -> None:
    """A text field (str, or a list of str) set in Python holds text: not a Path (nothing else
    reads one), nor one string where a list goes (it would be read letter by letter); a switch
    holds a bool, not "false" (which is true)."""
    if tp in (bool, bool | None) and value is not None and not isinstance(value, bool):
        raise ConfigError(f"{key}={_short(value)} must be true or false (a bool).")
    if value is None or tp not in (str, str | None, list[str]):
        return
    if tp == list[str]:
        if not (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
            raise ConfigError(
                f"{key}={_short(value)} must be a list of strings: write it as ['a', 'b'] (a path as str(path))."
            )
    elif not isinstance(value, str):
        raise ConfigError(f"{key}={_short(value)} must be a string (a path as str(path)).")


def _short(value: Any, limit: int = 100) -> str:
    """repr(value), cut to `limit` characters (a message quotes what the user wrote, not megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"{float(value):g}" if value.bit_length() < 1024 else f"<an integer of {value.bit_length()} bits>"
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One leaf key of a config tree (`walk_fields`)."""

    dotted: str
    type: Any
    default: Any
    """The dataclass default (`dataclasses.MISSING` when there is none); presets may set others."""
    doc: str
    domain: Domain | None = None
    """The field's declared `Domain` (None: none; a float must still be finite)."""


def walk_fields(cls: type[Config], prefix: str = "") -> Iterator[FieldInfo]:
    """Every leaf key of the config class `cls`, dotted, depth first in declaration order, with
    its type, default and docstring (the string literal after the field in the class body)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        if isinstance(tp, type) and issubclass(tp, Config):
            yield from walk_fields(tp, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        yield FieldInfo(f"{prefix}{f.name}", tp, default, docs.get(f.name, ""), f.metadata.get("domain"))


def field_docs(cls: type) -> dict[str, str]:
    """Field name → its attribute docstring, read from the source of `cls` and its bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, SyntaxError):  # no source (e.g. a frozen install)
            continue
        for stmt, after in zip(body, body[1:]):
            match stmt, after:
                case ast.AnnAssign(target=ast.Name(id=name)), ast.Expr(value=ast.Constant(value=str(doc))):
                    out[name] = inspect.cleandoc(doc)
    return out


def type_name(tp: Any) -> str:
    """A field's type as the help shows it: `int`, `float or null`, `list[str]`, `one of a|b`."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + "|".join(str(m.value) for m in tp)
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if args:
        return f"{getattr(typing.get_origin(tp), '__name__', str(tp))}[{', '.join(type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def keys_reference(cls: type[Config], width: int = 100) -> str:
    """Every key of `cls` for a --help text: dotted name, type, default and domain, then the docstring."""
    lines = []
    for info in walk_fields(cls):
        default = ""
        if info.default is not dataclasses.MISSING:
            shown = yaml.safe_dump(_plain(info.default), default_flow_style=True).strip()
            default = f" = {shown.removesuffix('...').strip()}"
        kind, _, is_list = numeric_type(info.type)
        domain = ""
        if info.domain is not None and kind is not None:
            domain = f"; {'each ' if is_list else ''}{info.domain.describe(kind is int)}"
        lines.append(f"  {info.dotted}  ({type_name(info.type)}){default}{domain}")
        lines += [f"      {line}" for line in textwrap.wrap(" ".join(info.doc.split()) or "(undocumented)", width - 6)]
    return "\n".join(lines)


def validate_tree(cfg: Config, prefix: str = "") -> None:
    """Check every field of the tree against its type and domain (`Config.check_domains`), then
    run `validate()` on every config in it, children first. `prefix` is the tree's dotted key
    ("model." for the model section) that the messages name."""
    cfg.check_domains(prefix)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, Config):
            validate_tree(value, f"{prefix}{f.name}.")
    cfg.validate()


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `key.sub=value` strings (values parsed as YAML scalars/lists) and return a new tree."""
    if isinstance(overrides, str):  # else read letter by letter
        raise ConfigError(f"Overrides are a list of key=value strings: pass [{overrides!r}], not the string alone.")
    data, given = cfg.to_dict(), {}
    for item in overrides:
        item = item.removeprefix("--")
        if "=" not in item:
            raise ConfigError(
                f"Override '{item}' has no value: write it as --{item}=VALUE (for example --optim.lr=3e-4)."
            )
        written, raw = item.split("=", 1)
        dotted = renamed_key(type(cfg).renamed, written)
        value = _override_value(raw, _leaf_type(type(cfg), dotted))
        if retire(type(cfg).retired, dotted, value):
            continue
        earlier = given.setdefault(dotted, (written, value))
        if earlier[0] != written and earlier[1] != value:  # the old key's and the new one's values: old first
            _refuse_both(*sorted([earlier, (written, value)], key=lambda given_as: given_as[0] == dotted))
        given[dotted] = (written, value)
        _set_dotted(data, dotted, value, type(cfg))
    return type(cfg).from_dict(data)


_NOTED: set[str] = set()
"""The old and retired keys read so far in this process (each is noted once)."""


def renamed_key(renamed: dict[str, str], dotted: str, prefix: str = "") -> str:
    """The key `dotted` names now: its new name when `renamed` maps it (noted on stderr once a
    process), else itself. `prefix` is where `renamed` applies, for the note."""
    new = renamed.get(dotted)
    if new is None:
        return dotted
    _note_once(prefix + dotted, f"{prefix}{dotted} is now {prefix}{new}; read as that.")
    return new


def _note_once(key: str, text: str) -> None:
    """`text` as a note on stderr, the first time `key` is read in this process."""
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"note: {text}", file=sys.stderr)


def rename_keys(data: Any, renamed: dict[str, str], prefix: str = "") -> Any:
    """The mapping `data` with each old key of `renamed` (`section.key`) moved to its new one
    (`renamed_key`); an old key given beside its new one with another value is a `ConfigError`
    naming both. Anything else is returned as it is."""
    if not isinstance(data, dict) or not renamed:
        return data
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in data.items()}
    for old, new in renamed.items():
        (section, key), (new_section, new_key) = old.split("."), new.split(".")
        if not isinstance(out.get(section), dict) or key not in out[section]:
            continue
        value, target = out[section].pop(key), out.setdefault(new_section, {})
        renamed_key(renamed, old, prefix)
        if target is None:
            target = out[new_section] = {}
        if isinstance(target, dict):  # else from_dict says the section is a value
            if target.get(new_key, value) != value:
                _refuse_both((prefix + old, value), (prefix + new, target[new_key]))
            target[new_key] = value
    return out


def retire(retired: dict[str, tuple[Any, str]], dotted: str, value: Any, prefix: str = "") -> bool:
    """Whether `dotted` is a key of `retired` (`Config.retired`), given as `value`: its harmless
    value is noted on stderr once a process (the caller drops it); another is a `ConfigError`
    saying why the key is gone and what to do."""
    if dotted not in retired:
        return False
    harmless, why = retired[dotted]
    shown = str(value).lower() if isinstance(value, bool) else _shown(value)
    if harmless is not ... and value != harmless:
        raise ConfigError(f"{prefix}{dotted}={shown} is no longer a key: {why}")
    _note_once(prefix + dotted, f"{prefix}{dotted} is no longer a key; {shown} ignored: {why}")
    return True


def drop_retired(data: Any, retired: dict[str, tuple[Any, str]], prefix: str = "") -> Any:
    """The mapping `data` without its keys of `retired` (`section.key`), each through `retire`."""
    if not isinstance(data, dict) or not retired:
        return data
    sections = {dotted.split(".")[0] for dotted in retired}
    return data | {
        section: {key: v for key, v in data[section].items() if not retire(retired, f"{section}.{key}", v, prefix)}
        for section in sections
        if isinstance(data.get(section), dict)
    }


def _refuse_both(old: tuple[str, Any], new: tuple[str, Any]) -> None:
    """Refuse an old key (its name as given, its value) given beside its new one with another value."""
    (old, old_value), (new, new_value) = old, new
    old_value, new_value = (str(v).lower() if isinstance(v, bool) else _shown(v) for v in (old_value, new_value))
    raise ConfigError(
        f"Both {old}={old_value} and {new}={new_value} are given: {old} is the earlier name of "
        f"{new}, so they set one key twice. Keep {new} alone."
    )


def _override_value(raw: str, tp: Any) -> Any:
    """What a command-line value means for a key of annotation `tp`. A name or path (a `str`
    key) is the text as given, whatever YAML would make of it: 'run #1', '0123', a date, 'a: b'
    (null or ~ unset an optional one); a list of names reads its items as text. A number
    is read as Python reads one ('0123' is 123, where YAML 1.1 reads octal 83; '1e3' is 1000.0).
    Anything else is YAML: true, [1, 2], null."""
    text = _text_kind(tp)
    if text == "list" and raw.lstrip().startswith("["):
        try:
            return yaml.load(raw, Loader=yaml.BaseLoader)  # every scalar a string
        except yaml.YAMLError:
            return raw
    if text:
        return None if raw in ("null", "~") and type(None) in typing.get_args(tp) else raw
    if numeric_type(tp)[0] is not None and not numeric_type(tp)[2]:
        for parse in (int, float):
            with contextlib.suppress(ValueError):
                return parse(raw)
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except (yaml.YAMLError, ValueError):  # ValueError: an integer too long for int()
        return raw


def _leaf_type(cls: type, dotted: str) -> Any:
    """The annotation of the key `dotted` of config class `cls`; None when a part is not a key
    (`_set_dotted` says which)."""
    tp: Any = cls
    for part in dotted.split("."):
        node = _dataclass_of(tp)
        tp = _field_types(node).get(part) if node is not None else None
        if tp is None:
            return None
    return tp


def _text_kind(tp: Any) -> str | None:
    """ "str" for a `str` (or optional `str`) annotation, "list" for `list[str]`, else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if tp is str:
        return "str"
    return "list" if typing.get_origin(tp) is list and typing.get_args(tp) == (str,) else None


_STR_TAG = "tag:yaml.org,2002:str"
YAML_MAX_NODES = 100_000
"""The most values (mappings, lists, scalars) a config file may hold: a config has a few hundred."""


def load_yaml(path: str | Path, schema: type[Config] | None = None) -> dict[str, Any]:
    """Read a config file: a regular file of UTF-8 text holding one YAML mapping whose keys are
    names, at every level, each key once; anything else is a `ConfigError` naming the file, the
    line (or the dotted key) and the fix. With the config class `schema`, an unquoted value of a
    name or path key is its text as written (`run_dir: 0123` is '0123', not YAML's octal 83, and
    a date stays text), and its earlier key names are read as the new ones (`Config.renamed`)."""
    path = Path(path)
    if not path.exists():
        where = "" if path.is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
        raise ConfigError(f"Config file '{path}' does not exist{where}.")
    if not path.is_file():
        raise ConfigError(f"Config file '{path}' is {file_kind(path)}, not a regular file: pass a YAML file.")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"Config file '{path}' is not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}, offset {e.start}): "
            "a config is a YAML text file; save it as UTF-8."
        ) from None
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # reads the text's characters: a NUL is an error here
        node = loader.get_single_node()
        if node is None:
            raise ConfigError(
                f"Config file '{path}' is empty (or only comments): write the preset it starts from and the keys "
                "it changes (e.g. 'preset: tiny' and 'train:' with 'steps: 100' under it), or pass the preset's "
                "name instead of the file."
            )
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(
                f"Config file '{path}' must hold a mapping at its top level (keys like 'preset:' and "
                f"'train:'), not {_node_kind(node)}."
            )
        _check_nodes(node, path, loader, schema)
        data = rename_keys(loader.construct_document(node), schema.renamed if schema else {})
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            f"YAML syntax error in '{path}'{where}: {problem}. Fix the file (indentation, a "
            "missing ':' or an unclosed quote are the usual causes)."
        ) from None
    except RecursionError:
        raise ConfigError(
            f"Config file '{path}' nests its values too deeply to read: a config has a few levels (section, key, list)."
        ) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data


def _node_kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.SequenceNode):
        return f"a list (line {node.start_mark.line + 1})"
    if isinstance(node, yaml.MappingNode):
        return f"a mapping (line {node.start_mark.line + 1})"
    return f"the value {_shown(node.value)!r} (line {node.start_mark.line + 1})"


def _check_nodes(root: yaml.MappingNode, path: Path, loader: yaml.SafeLoader, schema: type[Config] | None) -> None:
    """Walk the composed YAML (no recursion; each node once, aliases included): every mapping
    key is a plain name and appears once, every scalar builds; at most `YAML_MAX_NODES` values.
    An unquoted scalar under a name or path key of `schema` (`_text_kind`) is retagged as text,
    unless it is null."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    seen: set[int] = set()
    count = 0
    while stack:
        node, dotted = stack.pop()
        count += 1
        if count > YAML_MAX_NODES:
            raise ConfigError(
                f"Config file '{path}' holds more than {YAML_MAX_NODES:,} values: a config has a few hundred."
            )
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            plain_text = node.style is None and node.tag not in (_STR_TAG, "tag:yaml.org,2002:null")
            at = dotted.split("[")[0]
            if plain_text and schema is not None and _text_kind(_leaf_type(schema, schema.renamed.get(at, at))):
                node.tag = _STR_TAG
            try:
                loader.construct_object(node)
            except (ValueError, OverflowError) as e:  # resolved by its look, cannot build: a 13th month
                raise ConfigError(
                    f"In '{path}' at line {node.start_mark.line + 1}: '{dotted}' is {_short(node.value)}, which "
                    f"YAML reads as a {node.tag.rsplit(':', 1)[-1]} but cannot build ({e}): quote it or fix it."
                ) from None
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{dotted}[{i}]") for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key_node, value_node in node.value:
                line = key_node.start_mark.line + 1
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` merges a mapping in
                    stack.append((value_node, dotted))
                    continue
                if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == _STR_TAG):
                    shown = _node_kind(key_node) if not isinstance(key_node, yaml.ScalarNode) else repr(key_node.value)
                    raise ConfigError(
                        f"In '{path}' at line {line}: the key {shown} under '{dotted or '<top level>'}' is not a "
                        "name; config keys are words like 'train' or 'steps' (quote it if it is one)."
                    )
                key = key_node.value
                if key in lines:
                    raise ConfigError(
                        f"In '{path}': the key '{dotted + '.' if dotted else ''}{key}' appears twice, at lines "
                        f"{lines[key]} and {line}: keep one (YAML would silently take the last)."
                    )
                lines[key] = line
                stack.append((value_node, f"{dotted}.{key}" if dotted else key))


# ---- internals ---------------------------------------------------------------------------


def _unknown_key_message(dotted: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"Unknown config key '{dotted}'.{hint} Valid keys here: {', '.join(sorted(valid))}."


def _set_dotted(data: dict, dotted: str, value: Any, cls: type) -> None:
    parts = dotted.split(".")
    node, node_cls = data, cls
    for i, part in enumerate(parts):
        prefix = ".".join(parts[: i + 1])
        valid = [f.name for f in dataclasses.fields(node_cls)] if node_cls is not None else list(node)
        if part not in valid:
            raise ConfigError(_unknown_key_message(prefix, part, valid))
        if i == len(parts) - 1:
            node[part] = value
            return
        child = node.get(part)
        if not isinstance(child, dict):
            raise ConfigError(f"Config key '{prefix}' is a value, not a section: '{dotted}' is invalid.")
        hint = typing.get_type_hints(node_cls).get(part) if node_cls is not None else None
        node, node_cls = child, _dataclass_of(hint)


def _dataclass_of(tp: Any) -> type | None:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`, converting where lossless (int -> float, str -> enum)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in [a for a in args if a is not type(None)]:
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"Config key '{key}' got {_short(value)}, expected {' or '.join(map(_type_name, args))}.")
    if origin in (list, tuple):
        if origin is list and args == (str,) and isinstance(value, str):  # --data.sources=/path: one source
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"Config key '{key}' must be a list, got {_short(value)}. Write it as [a, b].")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"Config key '{key}' must be a mapping, got {_short(value)}.")
        return dict(value)
    if tp is Any:
        return value
    if isinstance(tp, type) and issubclass(tp, Config):
        return tp.from_dict(value if value is not None else {}, prefix=f"{key}.")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        if isinstance(value, bool) and ("off" if not value else "on") in tp._value2member_map_:
            value = "on" if value else "off"  # YAML reads a bare off / on as a bool
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"Config key '{key}' got {_short(value)}, expected {_type_name(tp)}.") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"Config key '{key}' must be true or false, got {_short(value)}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"Config key '{key}' must be an integer, got {_short(value)}.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an int past 1.8e308
                raise ConfigError(
                    f"Config key '{key}' got an integer too large for a number: {_shown(value)}."
                ) from None
        if isinstance(value, str):  # YAML reads "1e-3" (no dot) as a string
            with contextlib.suppress(ValueError):
                return float(value)
        raise ConfigError(f"Config key '{key}' must be a number, got {_short(value)}.")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"Config key '{key}' must be a string, got {_short(value)}.")
    raise TypeError(f"unsupported config annotation {tp!r} for '{key}'")  # a bug, not user input


def _plain(value: Any) -> Any:
    if isinstance(value, Config):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
