"""Turn Hydra/OmegaConf composition errors into messages that name the key and the fix.

What this module decides: how a misspelled key or a wrongly typed value is reported.
Hydra's own errors say "Key 'lrr' not in 'TrainerSection'" or suggest `+key=` (which
the schema then rejects); users need the full key, the closest real key and the
expected type. `unknown_keys` also catches keys Hydra let through (`+trainer.x=1`).
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing


def _schema(cls) -> dict:
    """{field: (type, default)} of a config dataclass."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out[f.name] = (hints[f.name], default)
    return out


def _walk(root, key: str):
    """(owning dataclass, its schema) of the section holding dotted `key`, or (None, {}) when a section is unknown."""
    cls = root
    for part in key.split(".")[:-1]:
        sch = _schema(cls)
        if part not in sch or not dataclasses.is_dataclass(sch[part][0]):
            return None, {}
        cls = sch[part][0]
    return cls, _schema(cls)


def _unknown(key: str, root) -> str:
    parts = key.split(".")
    cls = root
    for i, part in enumerate(parts):
        sch = _schema(cls)
        if part not in sch:
            prefix = ".".join(parts[:i])
            near = difflib.get_close_matches(part, list(sch), n=1, cutoff=0.5)
            where = f"section {prefix!r}" if prefix else "the top level"
            hint = f"did you mean {'.'.join(parts[:i] + near)!r}?" if near else f"known keys of {where}: {', '.join(sch)}"
            return f"{key}: unknown key ({'.'.join(parts[:i + 1])!r} is not in {where}). Fix: {hint}"
        cls = sch[part][0]
        if not dataclasses.is_dataclass(cls):
            break
    return f"{key}: unknown key"


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return f"{_type_name(args[0])} or null"
    return getattr(tp, "__name__", str(tp))


def explain(err: Exception, root):
    """A ConfigError for a Hydra/OmegaConf composition error (the original when it cannot be read)."""
    from .config import ConfigError

    text = "\n".join(str(e) for e in (err, err.__cause__, err.__context__) if e is not None)
    m = re.search(r"full_key: (\S+)", text)
    key = getattr(err.__cause__, "full_key", None) or (m.group(1) if m else None)
    if not key:
        return ConfigError(f"the recipe or an override does not compose: {text.strip()}")
    if re.search(r"Key '[^']*' (is )?not in|not in struct", text):
        return ConfigError(_unknown(key, root))
    if "converted to" in text or "Invalid type assigned" in text or "Value '" in text:
        _, sch = _walk(root, key)
        want, default = sch.get(key.split(".")[-1], (None, None))
        value = re.search(r"Value '([^']*)'", text)
        got = f", got {value.group(1)!r}" if value else ""
        if want is not None and dataclasses.is_dataclass(want):
            first = dataclasses.fields(want)[0].name
            return ConfigError(f"{key}: is a section, not a value{got}. Fix: set its keys, e.g. {key}.{first}=...")
        name = _type_name(want) if want is not None else "valid value"
        return ConfigError(f"{key}: expected {name}{got}. Fix: set {key} to a value of type {name} (default: {default!r})")
    return ConfigError(f"{key}: {text.strip()}")


def unknown_keys(plain: dict, root, prefix: str = "", top=None) -> None:
    """Raise a ConfigError naming the first key in the composed config that the schema does not have."""
    from .config import ConfigError

    sch, top = _schema(root), top or root
    for k, v in plain.items():
        if k not in sch:
            raise ConfigError(_unknown(f"{prefix}{k}", top))
        if isinstance(v, dict) and dataclasses.is_dataclass(sch[k][0]):
            unknown_keys(v, sch[k][0], f"{prefix}{k}.", top)
