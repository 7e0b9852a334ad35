"""Loading the packaged YAML data tables (signatures, rules, env presets, known-bad drivers, Xid
and other code tables) with libyaml when PyYAML was built with it.

libyaml's `yaml.CSafeLoader` parses the same YAML 1.1 subset as the pure-Python `SafeLoader` to
the same Python values, about 10x faster; the fallback keeps a PyYAML without libyaml working.
The config loader (config.py) keeps its own pure-Python loader: its node limits hook
`compose_node`, which libyaml's composer never calls.

`load_packaged(name)` keeps, like Python's own `.pyc`, the values of a packaged table in
`data/__pycache__/<name>.yaml.marshal` (a marshalled pair: BLAKE2b digest of the YAML bytes,
values; an edited table does not match its digest and is parsed again): building PyYAML's Python objects for the ~5,000 nodes of the tables
costs ~25 ms of a ~0.15 s `diagnose`, and importing PyYAML ~15 ms more; `marshal.loads` of the
same values takes ~1 ms. No cache is written when the directory is read-only, when
`sys.dont_write_bytecode` is set (PYTHONDONTWRITEBYTECODE), or for values marshal cannot hold;
only a regular file is read as a cache (a FIFO or device in its place is parsed around).
"""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
from pathlib import Path
from typing import IO, Any

from xpu_serve.fsread import read_regular

DATA_DIR = Path(__file__).resolve().parent / "data"
_MAX_CACHE_BYTES = 64 << 20  # the largest table's cache is ~100 KiB


def fast_safe_loader() -> Any:
    """The fastest safe loader this PyYAML offers (`yaml.CSafeLoader`, else `yaml.SafeLoader`)."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_data(stream: str | bytes | IO[str]) -> Any:
    """One YAML document -> Python values, as `yaml.safe_load` (same tags, same errors:
    yaml.YAMLError subclasses with marks)."""
    import yaml

    return yaml.load(stream, Loader=fast_safe_loader())  # noqa: S506 - a safe loader


class DataError(ValueError):
    """A packaged table is not valid YAML or not UTF-8 (message: `data/<name>.yaml: <why>`)."""


def load_packaged(name: str) -> Any:
    """The values of the packaged `data/<name>.yaml`, as `load_data` gives them, from the
    marshal cache when it holds this exact file. Raises OSError when the file cannot be read,
    DataError when it is not UTF-8 YAML."""
    raw = (DATA_DIR / f"{name}.yaml").read_bytes()
    digest = hashlib.blake2b(raw, digest_size=16).digest()
    cache = DATA_DIR / "__pycache__" / f"{name}.yaml.marshal"
    try:
        held = marshal.loads(read_regular(cache, _MAX_CACHE_BYTES) or b"")
        if isinstance(held, tuple) and len(held) == 2 and held[0] == digest:
            return held[1]
    except (OSError, ValueError, EOFError, TypeError):
        pass  # no cache yet, or a damaged one: parse
    import yaml

    try:
        data = load_data(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise DataError(f"data/{name}.yaml: {e}") from e
    if not sys.dont_write_bytecode:
        _write_cache(cache, (digest, data))
    return data


def _write_cache(cache: Path, data: tuple[bytes, Any]) -> None:
    """Write `data` to `cache` atomically (a temporary file renamed); nothing on any failure."""
    try:
        blob = marshal.dumps(data)
    except ValueError:  # a value marshal cannot hold (a YAML timestamp): no cache
        return
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(exist_ok=True)
        tmp.write_bytes(blob)
        os.replace(tmp, cache)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
