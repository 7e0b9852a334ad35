"""Loading the packaged YAML data tables (signatures, env presets, known-bad drivers, Xid and
other code tables) with libyaml when PyYAML was built with it.

libyaml's `yaml.CSafeLoader` parses the same YAML 1.1 subset as the pure-Python `SafeLoader` to
the same Python values, about 10x faster; the fallback keeps a PyYAML without libyaml working.
The config loader (config.py) keeps its own pure-Python loader: its node limits hook
`compose_node`, which libyaml's composer never calls.
"""

from __future__ import annotations

from typing import IO, Any

import yaml

#: The fastest safe loader this PyYAML offers.
FAST_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_data(stream: str | bytes | IO[str]) -> Any:
    """One YAML document -> Python values, as `yaml.safe_load` (same tags, same errors:
    yaml.YAMLError subclasses with marks)."""
    return yaml.load(stream, Loader=FAST_SAFE_LOADER)  # noqa: S506 - a safe loader
