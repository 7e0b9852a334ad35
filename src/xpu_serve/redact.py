"""Redaction of secrets in everything a diagnostic bundle holds.

Two layers, applied to every file written into a bundle (see `xpu_serve.bundle`):

1. **Known values**: every secret value found at collection time (in the config, the
   supervisor's and the engine's environment, the engine's argv) is replaced wherever it appears,
   in any context (a token echoed inside a URL, a traceback, a core dump), provided it is at least
   `MIN_SECRET_LEN` characters long and not a plain word ("none", "true"): shorter values would
   wreck unrelated text.
2. **Shapes**: values after names that look secret (`is_secret_name`) become `***`. In free
   text (logs, stacks, dumps: `Redactor.text`, `Redactor.bytes`) only unambiguous shapes count:
   `NAME=value` / `export NAME="v"` where NAME is an environment variable name (upper case),
   command-line flags (`--api-key sk-1`, `--hf-token=x`), HTTP `Authorization:` /
   `Proxy-Authorization:` values and `X-API-Key:`-style headers (a hyphenated name), quoted keys of
   JSON and Python reprs (`"hf_token": "v"`, `'api_key': 'v'`, vllm/entrypoints/utils.py
   `log_non_default_args`), and Python keyword reprs with a quoted value (`Namespace(api_key='v')`).
   A bare `word_key: value` is not a secret in free text: oneCCL prints
   `kvs_remove_name_key: client: remove_key` (src/atl/util/pm/pmi_resizable_rt/... internal_kvs.cpp).
   Structured files (`structured=True`: env files, YAML) also mask `name: value` and `name=value`
   for any secret-looking name. A shape never reaches across a line end.

Written here rather than taken from a library: the names and shapes are the domain's own (vLLM's
flags and log lines, Level Zero/oneCCL variables), and they must work on bytes of any encoding
and on 64 MiB logs within a collector's time budget. Work is done on bytes: known values by
`bytes.replace`, shapes only on the lines that contain a trigger word (found with `bytes.find`),
decoded as latin-1 so that every other byte round-trips unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "***"
"""What a redacted value becomes."""

MIN_SECRET_LEN = 4
"""Known secret values shorter than this (characters) are not replaced by value, only by shape."""

# A name is secret when its LAST part (split at _ - . and camelCase) is or ends with one of the
# words: HF_TOKEN, VLLM_API_KEY, AWS_SECRET_ACCESS_KEY, --api-key, hfToken, DB_PASSWORD2. Not a
# plain *TOKEN* glob on purpose: vLLM's max_num_batched_tokens, prompt_token_ids, tokenizer and
# vllm:generation_tokens_total are evidence, not secrets.
_PART_RE = re.compile(r"[a-z0-9]*(?:token|keys?|secrets?|password|passwd|credentials?)\d*")
_SPLIT_RE = re.compile(r"[_.\-\s]+|(?<=[a-z0-9])(?=[A-Z])")

# Words whose presence makes a line worth a closer look, searched in the ASCII-lowercased bytes
# with C-level `bytes.find`; a line without any of them is not looked at again.
_BWORDS = (b"token", b"key", b"secret", b"passw", b"credential", b"authorization")
_BMASK = MASK.encode()
_WORD_RE = re.compile(rb"token|key|secret|passw|credential|authorization")
_NAME_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
# What may follow a secret name, matched right where the name ends:
_VAL = r"""(?P<val>"[^"\n]*"|'[^'\n]*'|[^\s,;&)}\]]+)"""
_AFTER_ASSIGN = re.compile(r"[ \t]*=[ \t]*" + _VAL)  # NAME=value, export NAME="v", name='v'
_AFTER_KEYVAL = re.compile(r"""["']?[ \t]*:[ \t]*""" + _VAL)  # "name": "v", 'name': 'v', name: v
_AFTER_FLAG = re.compile(r"""(?:=|[ \t]+)(?P<val>"[^"\n]*"|'[^'\n]*'|(?!-)[^\s,;]+)""")  # --api-key v
_AFTER_AUTH = re.compile(r"""["']?[ \t]*[:=][ \t]*(?P<val>[^\r\n"']+)""")  # Authorization: Bearer x
_NOT_VALUES = {"null", "none", "true", "false", "~"}
_PLAIN_VALUES = _NOT_VALUES | {"auto", "unset", "empty", "default", "disabled", "enabled"}


def _low(text: str) -> bytes:
    """ASCII-lowercased bytes with one byte per character (offsets match `text`, a latin-1 line)."""
    return text.encode("latin-1", "replace").lower()


_ENV_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]*[A-Z][A-Z0-9_]*")
_HEADER_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:-[A-Za-z0-9]+)+")
_AFTER_HEADER = re.compile(r"""[ \t]*:[ \t]*(?P<val>[^\s"'][^\r\n"']*)""")  # X-API-Key: v
_AFTER_KWARG = re.compile(r"""[ \t]*=[ \t]*(?P<val>"[^"\n]*"|'[^'\n]*')""")  # name='v' (Python repr)


def _match_free(line: str, a: int, b: int, name: str) -> re.Match[str] | None:
    """The value after a secret-looking `name` (line[a:b]) in free text, in the shapes a log can
    hold unambiguously; None for anything else (`kvs_remove_name_key: client`)."""
    q = line[a - 1] if a > 0 else ""
    if q in ("'", '"') and line[b : b + 1] == q:
        return _AFTER_KEYVAL.match(line, b)  # "name": v / 'name': v (JSON, Python dict repr)
    if _ENV_NAME_RE.fullmatch(name):
        return _AFTER_ASSIGN.match(line, b)  # HF_TOKEN=v, export HF_TOKEN="v"
    if "-" in name and _HEADER_NAME_RE.fullmatch(name):
        return _AFTER_HEADER.match(line, b)  # X-API-Key: v
    return _AFTER_KWARG.match(line, b)  # Namespace(api_key='v')


def _shapes(line: str, structured: bool = False) -> str:
    """Mask the values that follow secret-looking names in one line (free-text shapes, or with
    `structured` also `name: value` / `name=value` of any secret-looking name)."""
    low = _low(line)
    edits: list[tuple[int, int, str]] = []
    done = 0
    for w in _WORD_RE.finditer(low):
        a, b = w.start(), w.end()
        if a < done:
            continue
        while a > 0 and low[a - 1] in _NAME_CHARS:
            a -= 1
        while b < len(low) and low[b] in _NAME_CHARS:
            b += 1
        name = line[a:b]
        if w.group() == b"authorization":
            if not low[a:b].endswith(b"authorization"):
                continue
            m = _AFTER_AUTH.match(line, b)
        elif not is_secret_name(name):
            continue
        elif name.startswith("-"):
            m = _AFTER_FLAG.match(line, b)
        elif structured:
            m = _AFTER_ASSIGN.match(line, b) or _AFTER_KEYVAL.match(line, b)
        else:
            m = _match_free(line, a, b, name)
        if m is None:
            continue
        val = m.group("val")
        bare = val.strip().strip("\"'")
        if bare == MASK or (w.group() != b"authorization" and bare.lower() in _NOT_VALUES):
            done = m.end()
            continue
        if w.group() == b"authorization":
            rep = MASK
        else:
            quote = val[0] if val[:1] in ("'", '"') and len(val) >= 2 and val[-1] == val[0] else ""
            if not quote and a > 0 and line[a - 1] == '"' and line[b : b + 1] == '"':
                quote = '"'  # a JSON number under a secret key: keep the document valid JSON
            rep = f"{quote}{MASK}{quote}"
        edits.append((m.start("val"), m.end("val"), rep))
        done = m.end()
    if not edits:
        return line
    out = []
    pos = 0
    for s0, e0, rep in edits:
        out.append(line[pos:s0])
        out.append(rep)
        pos = e0
    out.append(line[pos:])
    return "".join(out)


def is_secret_name(name: str) -> bool:
    """True when a variable, key or flag name looks secret: its last part (split at `_`, `-`,
    `.` and camelCase) is or ends with TOKEN, KEY(S), SECRET(S), PASSWORD, PASSWD or
    CREDENTIAL(S), any case, digits allowed after. "HF_TOKEN", "api_key", "--api-key",
    "OPENAI_API_KEY" are secret; "max_tokens", "tokenizer", "token_ids" are not."""
    n = name.strip().lstrip("-").strip("\"'")
    parts = [p for p in _SPLIT_RE.split(n) if p]
    return bool(parts) and bool(_PART_RE.fullmatch(parts[-1].lower()))


class Redactor:
    """Redacts text, bytes, argv, environments and nested mappings.

    Args:
        secrets: known secret values (strings) to replace wherever they occur; values shorter
            than `MIN_SECRET_LEN` are ignored. More can be added with `add()`.

    Thread-safe for concurrent use once built (it is only read by the redact methods).
    """

    def __init__(self, secrets: Iterable[str] = ()):
        self._secrets: set[str] = set()
        self._forms: list[bytes] = []
        self.add(secrets)

    @property
    def secrets(self) -> frozenset[str]:
        """The known secret values."""
        return frozenset(self._secrets)

    def add(self, secrets: Iterable[str]) -> None:
        """Add known secret values (ignores non-strings, "***", values shorter than
        MIN_SECRET_LEN, plain words like "none"/"true" and numbers shorter than 6 digits)."""
        for s in secrets:
            if not isinstance(s, str) or len(s) < MIN_SECRET_LEN or s == MASK:
                continue
            if s.lower() in _PLAIN_VALUES or (s.isdigit() and len(s) < 6):
                continue  # `SOME_KEY=none`: replacing every "none" would wreck the logs, hide nothing
            self._secrets.add(s)
        # as bytes (UTF-8), longest first so that a secret containing another is replaced whole
        self._forms = sorted(
            {x.encode("utf-8", "surrogateescape") for x in self._secrets}, key=len, reverse=True
        )

    def text(self, text: str, structured: bool = False) -> str:
        """Redact one text (any number of lines). Returns the text with secrets as `***`.
        `structured`: the text is an env file or YAML (see `bytes`)."""
        return self.bytes(text.encode("utf-8", "surrogateescape"), structured).decode(
            "utf-8", "surrogateescape"
        )

    def bytes(self, data: bytes, structured: bool = False) -> bytes:
        """Redact bytes of any encoding: known values by bytes, shapes on the lines (decoded as
        latin-1, so every other byte comes back unchanged) that hold a trigger word.

        Free text by default (logs: only the unambiguous shapes of the module docstring);
        `structured=True` for env files and YAML, where `name: value` and `name=value` of any
        secret-looking name are masked too."""
        for f in self._forms:  # bytes find/replace: C speed, much faster than a regex alternation
            if f in data:
                data = data.replace(f, _BMASK)
        low = data.lower()  # ASCII only, same length: offsets match `data`
        spans: set[tuple[int, int]] = set()
        for w in _BWORDS:
            i = low.find(w)
            while i >= 0:
                ls = low.rfind(b"\n", 0, i) + 1
                le = low.find(b"\n", i)
                le = len(low) if le < 0 else le
                spans.add((ls, le))
                i = low.find(w, le)
        if not spans:
            return data
        out = []
        pos = 0
        for ls, le in sorted(spans):
            out.append(data[pos:ls])
            out.append(_shapes(data[ls:le].decode("latin-1"), structured).encode("latin-1"))
            pos = le
        out.append(data[pos:])
        return b"".join(out)

    def argv(self, argv: Iterable[str]) -> list[str]:
        """Redact an argument vector: the value after a secret-looking flag (`--api-key X`),
        the value part of `--flag=X`, and any known secret value, e.g.
        ["vllm", "serve", "--api-key", "sk-1"] -> ["vllm", "serve", "--api-key", "***"]."""
        out: list[str] = []
        mask_next = False
        for a in argv:
            if mask_next and not a.startswith("-"):
                out.append(MASK)
                mask_next = False
                continue
            mask_next = False
            if a.startswith("-") and "=" in a:
                name, _, _val = a.partition("=")
                if is_secret_name(name):
                    out.append(f"{name}={MASK}")
                    continue
            elif a.startswith("-") and is_secret_name(a):
                mask_next = True
            out.append(self.text(a))
        return out

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        """Redact an environment: values of secret-looking names become `***`; other values
        are redacted as text (a known secret inside a URL, for example)."""
        return {k: (MASK if is_secret_name(k) else self.text(v)) for k, v in env.items()}

    def mapping(self, obj: Any) -> Any:
        """Redact a nested structure of dicts/lists/scalars (e.g. `Config.model_dump()`):
        values under secret-looking keys become `***` (when not None), strings are redacted as text."""
        if isinstance(obj, Mapping):
            out: dict[Any, Any] = {}
            for k, v in obj.items():
                if (
                    isinstance(k, str)
                    and is_secret_name(k)
                    and v is not None
                    and not isinstance(v, (Mapping, list))
                ):
                    out[k] = MASK
                else:
                    out[k] = self.mapping(v)
            return out
        if isinstance(obj, (list, tuple)):
            return [self.mapping(v) for v in obj]
        if isinstance(obj, str):
            return self.text(obj)
        return obj


def secrets_in_env(env: Mapping[str, str]) -> list[str]:
    """Values of secret-looking variables in an environment, e.g. {"HF_TOKEN": "hf_x"} -> ["hf_x"]."""
    return [v for k, v in env.items() if is_secret_name(k) and v]


def secrets_in_argv(argv: Iterable[str]) -> list[str]:
    """Values of secret-looking flags in an argv (`--api-key X`, `--api-key=X`)."""
    found: list[str] = []
    take = False
    for a in argv:
        if take and not a.startswith("-"):
            found.append(a)
        take = False
        if a.startswith("-"):
            name, eq, val = a.partition("=")
            if is_secret_name(name):
                if eq:
                    found.append(val)
                else:
                    take = True
    return found


def secrets_in_mapping(obj: Any) -> list[str]:
    """String values under secret-looking keys anywhere in a nested mapping (a config dump),
    plus values of secret-looking `--flags` inside string lists (an engine command)."""
    found: list[str] = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if (
                isinstance(k, str)
                and is_secret_name(k)
                and isinstance(v, (str, int))
                and not isinstance(v, bool)
            ):
                found.append(str(v))
            else:
                found.extend(secrets_in_mapping(v))
    elif isinstance(obj, (list, tuple)):
        if all(isinstance(v, str) for v in obj):
            found.extend(secrets_in_argv(obj))
        for v in obj:
            found.extend(secrets_in_mapping(v))
    return found
