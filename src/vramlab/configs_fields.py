"""How `vramlab.configs` reads a training config's fields: the formats it knows, the one-line
`ConfigError`, a mapping whose every key must be taken or known (`Block`), the counts and truth values
as configs write them (`as_int`, `as_bool`), the settings found so far with their sources (`Draft`), and
a file's text parsed as TOML, JSON or (with the caller's parser) YAML (`read_text`, `parse`).
Pure: the standard library only.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from . import checks

FORMATS: tuple[str, ...] = ("deepspeed", "trainer", "accelerate", "axolotl", "torchtune", "torchtitan")
FORMAT_NAMES = {"deepspeed": "DeepSpeed JSON", "trainer": "TrainingArguments JSON", "accelerate": "accelerate config",
                "axolotl": "Axolotl YAML", "torchtune": "torchtune recipe", "torchtitan": "torchtitan TOML"}
MAX_FILE_BYTES = 1 << 20  # a training config is a few KB
TRAINER_BATCH = 8  # TrainingArguments.per_device_train_batch_size's default (transformers 5.23)


class ConfigError(ValueError):
    """A configuration this module cannot price: the message is one line naming the field."""


def fail(msg: str) -> None:
    raise ConfigError(" ".join(msg.split()))


class Block:
    """One mapping of a config. Each key is taken (it sets something), passed (known, no effect on
    memory) or refused when `finish()` finds it neither."""

    def __init__(self, data, path: str, fmt: str):
        if not isinstance(data, dict):
            fail(f"{path or 'the file'} must be a mapping of fields, got {checks.show(data)}")
        self.data, self.path, self.fmt, self.seen = data, path, fmt, set()

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, default=None):
        self.seen.add(key)
        v = self.data.get(key)
        return default if v is None else v

    def given(self, key: str) -> bool:
        return self.data.get(key) is not None

    def block(self, key: str) -> "Block | None":
        self.seen.add(key)
        v = self.data.get(key)
        if v is None or v == {}:
            return None
        return Block(v, self.name(key), self.fmt)

    def known(self, *keys: str) -> None:
        self.seen.update(keys)

    def only(self, key: str, allowed: tuple, why: str):
        """A field that changes memory in a way not modelled: accepted only at a value in `allowed`
        (None, absent, is always allowed)."""
        v = self.get(key)
        if v is not None and not any(v == a and type(v) is type(a) for a in allowed):
            fail(f"{self.name(key)} = {checks.show(v)} is not modelled: {why}")
        return v

    def finish(self) -> None:
        extra = [k for k in self.data if k not in self.seen]
        if extra:
            k = extra[0]
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            fail(f"unknown field {self.name(k)!r}{more} in this {FORMAT_NAMES[self.fmt]}: vramlab does not know what it "
                 "does to memory, so it refuses it rather than ignore it; remove it, or ask for it to be modelled")


def as_int(name: str, v, *, lo: int = 1) -> int:
    """A count as configs write it: 8, 2e8 (JSON float), "2e8" (YAML 1.1 reads 1e9 as a string)."""
    x = v
    if isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            fail(f"{name} must be a whole number, got {checks.show(v)}")
    if isinstance(x, float):
        if not math.isfinite(x) or x != int(x):
            fail(f"{name} must be a whole number, got {checks.show(v)}")
        x = int(x)
    try:
        return checks.whole(name, x, lo=lo)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def as_bool(name: str, v) -> bool:
    """A truth value; YAML and accelerate also write 'true' / 'false' as strings."""
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    if not checks.is_bool(v):
        fail(f"{name} must be true or false, got {checks.show(v)}")
    return bool(v)


@dataclass
class Draft:
    """Settings as they are found: value and source."""

    values: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    deferred: dict = field(default_factory=dict)  # setting -> (function of the spec, source): DeepSpeed's "auto"

    def put(self, setting: str, value, source: str) -> None:
        self.values[setting] = value
        self.sources[setting] = source

    def has(self, setting: str) -> bool:
        return setting in self.values

    def default(self, setting: str, value, why: str) -> None:
        if setting not in self.values:
            self.put(setting, value, f"assumed: {why}")


# ----------------------------------------------------------------------------- parsing the file

def read_text(path: str) -> str:
    """A config file's text: a regular file (a FIFO would hang) of at most MAX_FILE_BYTES, UTF-8."""
    if not os.path.isfile(path):
        fail(f"cannot read {path!r}: not a regular file")
    if os.path.getsize(path) > MAX_FILE_BYTES:
        fail(f"cannot read {path!r}: too large for a training config (at most {MAX_FILE_BYTES:,} bytes)")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read {path!r}: {getattr(e, 'strerror', None) or e}")


def _toml():
    """The standard library's TOML reader (Python 3.11+), else one line: the rest of vramlab, the command line
    included, runs on Python 3.10, which has none (this layer imports nothing outside the standard library)."""
    try:
        import tomllib
    except ModuleNotFoundError:
        fail("reading a TOML config needs Python 3.11 or later (this is Python 3.10)")
    return tomllib


def parse(text: str, path: str | None, fmt: str | None, yaml_loader: Callable[[str], Any] | None = None):
    """The document a config's text holds: TOML (by its extension, the torchtitan format or a [table] header),
    JSON, or YAML read by `yaml_loader`; a ConfigError in one line when it is none of them."""
    where = repr(path) if path else "the text"
    ext = os.path.splitext(path or "")[1].lower()
    section = re.compile(r"^\[[A-Za-z_][\w.]*\]\s*(#.*)?$", re.M)  # a TOML table header: [training]
    if ext == ".toml" or fmt == "torchtitan" or (ext not in (".json", ".yaml", ".yml") and section.search(text)):
        toml = _toml()
        try:
            return toml.loads(text)
        except toml.TOMLDecodeError as e:
            fail(f"{where} is not valid TOML: {e}")
    if ext == ".json" or text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            fail(f"{where} is not valid JSON: {e.msg} (line {e.lineno})")
        except RecursionError:
            fail(f"{where} is nested too deeply to be a training config")
    if yaml_loader is None:  # this layer is the standard library only: the caller brings the YAML parser
        fail(f"{where} is YAML: pass a parser (yaml_loader=yaml.safe_load), or read it with "
             "vramlab.present.from_config.read_setup, which does")
    try:
        return yaml_loader(text)
    except ValueError as e:
        fail(f"{where}: {e}")
    except Exception as e:  # the parser's own error type (yaml.YAMLError): a malformed file, one line
        fail(f"{where} is not valid YAML: {e}")
