"""node-problem-detector (NPD) configs generated from the signature table, and the plugin check.

Formats (kubernetes/node-problem-detector):

- kernel monitor, `config/kernel-monitor.json` (pkg/systemlogmonitor/config.go): plugin "kmsg",
  logPath "/dev/kmsg", lookback, bufferSize, source, conditions [{type, reason, message}] (the
  healthy defaults), rules [{type: temporary|permanent, condition (permanent only), reason,
  pattern}]. A temporary rule emits an event; a permanent one sets its condition True.
- how a pattern matches (pkg/systemlogmonitor/log_buffer.go, CompilePattern and Match): NPD keeps
  the last bufferSize messages (the kmsg text after `;`, TrimSpace'd: kmsgparser parseMessage and
  the kmsg log watcher), joins them with "\\n" and runs Go `regexp` `pattern + "\\z"` over the
  whole buffer with FindStringIndex: anchored at the END of the newest message only, not at a line
  start. So a generated pattern is `(?:P).*`: the group keeps a top-level alternation from binding
  `\\z` to its last branch alone (the first branches would match again while the line sits in the
  buffer), and `.*` runs to the end of the message. `single_line` keeps P from matching a newline,
  so P lies inside the newest message, as the table's Python `search` of one message does.
- custom plugin monitor, `config/custom-plugin-monitor.json` (pkg/custompluginmonitor/types/config.go):
  plugin "custom", pluginConfig {invoke_interval, timeout, max_output_length (default 80),
  concurrency}, rules [{type, condition, reason, path, args, timeout}]. The plugin's exit status is
  0 OK, 1 NonOK, anything else Unknown; its stdout, trimmed and cut to max_output_length bytes, is
  the message (pkg/custompluginmonitor/plugin/plugin.go, run).

Which rows become rules and which set a condition is data: `data/npd.yaml`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from xpu_serve.signatures import Signature, SignatureTable, load_table
from xpu_serve.yamldata import load_data

MAX_MESSAGE_BYTES = 80  # NPD's default max_output_length; the plugin never prints more
OK, PROBLEM, UNKNOWN = 0, 1, 2  # custom plugin exit statuses (cpmtypes.OK, NonOK, Unknown)

# Outside a character class these match "\n" (Python and Go alike): confined to one line.
_ONE_LINE = {r"\s": r"[^\S\n]", r"\W": r"[^\w\n]", r"\D": r"[^\d\n]"}


class NPDError(ValueError):
    """data/npd.yaml or a row cannot be turned into an NPD rule (message names the row)."""


@dataclass(frozen=True)
class Rule:
    """One NPD rule made from one signature row.

    Attributes:
        row: the signature row.
        type: "temporary" (an event) or "permanent" (sets `condition`).
        condition: the condition type for a permanent rule, else None.
        reason: NPD's CamelCase reason (the row id, `reason_words` applied).
        pattern: the RE2 / Go regexp pattern (see the module docstring).
    """

    row: Signature
    type: str
    condition: str | None
    reason: str
    pattern: str


@lru_cache(maxsize=1)
def npd_data() -> dict[str, Any]:
    """The packaged `data/npd.yaml` as a mapping; NPDError when malformed."""
    text = resources.files("xpu_serve").joinpath("data/npd.yaml").read_text(encoding="utf-8")
    data = load_data(text)
    if not isinstance(data, dict) or not all(
        k in data for k in ("causes", "conditions", "kernel_monitor", "custom_plugin")
    ):
        raise NPDError("data/npd.yaml: needs causes, conditions, kernel_monitor and custom_plugin")
    return data


def single_line(pattern: str) -> str:
    """`pattern` with every construct that can match a newline confined to one line: a negated
    class `[^...]` gets `\\n` added, `\\s`, `\\W`, `\\D` outside a class become classes without
    `\\n`; `^` outside a class becomes `(?m:^)` (a line's start in NPD's buffer of several
    lines). NPDError for what cannot be confined (`(?s)`, those escapes inside a positive class)."""
    if "(?s" in pattern:
        raise NPDError("the pattern uses (?s): `.` would match a newline")
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = negated = False
    while i < n:
        ch = pattern[i]
        if ch == "\\" and i + 1 < n:
            esc = pattern[i : i + 2]
            i += 2
            if esc in _ONE_LINE and not in_class:
                out.append(_ONE_LINE[esc])
            elif (esc in _ONE_LINE or esc == r"\n") and in_class and not negated:
                raise NPDError(f"{esc} inside a class matches a newline")
            else:
                out.append(esc)
            continue
        i += 1
        if in_class:
            in_class = ch != "]"
            out.append(ch)
            continue
        if ch == "^":  # a line's start: NPD's buffer holds several lines
            out.append("(?m:^)")
            continue
        if ch != "[":
            out.append(ch)
            continue
        in_class, negated = True, pattern.startswith("^", i)
        out.append("[^\\n" if negated else "[")
        i += 1 if negated else 0
        if pattern.startswith("]", i):  # a `]` first in a class is a literal
            out.append("\\]")
            i += 1
    return "".join(out)


def reason_of(row_id: str, words: dict[str, str]) -> str:
    """A row id as an NPD reason: "xe-guc-init-failure" -> "XeGuCInitFailure"."""
    return "".join(words.get(part, part[:1].upper() + part[1:]) for part in row_id.split("-") if part)


def rules(table: SignatureTable | None = None, data: dict[str, Any] | None = None) -> list[Rule]:
    """The NPD rules, in table order: one per root row of the kernel log alone whose cause is in
    `data["causes"]`. NPDError when a condition lists a row that is not selected."""
    table = table or load_table()
    data = data or npd_data()
    causes = set(data["causes"])
    words = {str(k): str(v) for k, v in (data.get("reason_words") or {}).items()}
    overrides = data.get("re2_patterns") or {}
    condition_of = {rid: c["type"] for c in data["conditions"] for rid in c["rows"]}
    out: list[Rule] = []
    for row in table.rows:
        if row.sources != ("kernel",) or row.role != "root" or row.cause not in causes:
            continue
        python_pattern = overrides[row.id]["pattern"] if row.id in overrides else row.pattern.pattern
        try:
            pattern = f"(?:{single_line(python_pattern)}).*"
        except NPDError as e:
            raise NPDError(f"signatures.yaml: {row.id}: {e}") from None
        cond = condition_of.get(row.id)
        out.append(Rule(row, "permanent" if cond else "temporary", cond, reason_of(row.id, words), pattern))
    missing = set(condition_of) - {r.row.id for r in out}
    if missing:
        raise NPDError(f"data/npd.yaml: conditions list rows that are not kernel GPU roots: {sorted(missing)}")
    return out


def kernel_monitor(table: SignatureTable | None = None) -> dict[str, Any]:
    """The kernel monitor config (NPD's `--config.system-log-monitor` file) as a JSON-ready dict."""
    data = npd_data()
    km = data["kernel_monitor"]
    out_rules: list[dict[str, Any]] = []
    for r in rules(table, data):
        rule: dict[str, Any] = {"type": r.type}
        if r.condition:
            rule["condition"] = r.condition
        rule.update(reason=r.reason, pattern=r.pattern)
        out_rules.append(rule)
    return {
        "plugin": "kmsg",
        "logPath": "/dev/kmsg",
        "lookback": km["lookback"],
        "bufferSize": int(km["bufferSize"]),
        "source": km["source"],
        "metricsReporting": True,
        "conditions": [
            {"type": c["type"], "reason": c["ok_reason"], "message": c["ok_message"]} for c in data["conditions"]
        ],
        "rules": out_rules,
    }


def custom_plugin_config(exec_path: str, check_args: list[str], interval: str | None = None) -> dict[str, Any]:
    """The custom plugin monitor config (NPD's `--config.custom-plugin-monitor` file) that runs
    `<exec_path> npd check <check_args>` every `interval` (Go duration text, default from data)."""
    cp = npd_data()["custom_plugin"]
    return {
        "plugin": "custom",
        "pluginConfig": {
            "invoke_interval": interval or cp["invoke_interval"],
            "timeout": cp["timeout"],
            "max_output_length": MAX_MESSAGE_BYTES,
            "concurrency": 1,
            "enable_message_change_based_condition_update": True,
        },
        "source": cp["source"],
        "metricsReporting": True,
        "conditions": [{"type": cp["condition"], "reason": cp["ok_reason"], "message": cp["ok_message"]}],
        "rules": [
            {
                "type": "permanent",
                "condition": cp["condition"],
                "reason": cp["reason"],
                "path": exec_path,
                "args": ["npd", "check", *check_args],
                "timeout": cp["timeout"],
            }
        ],
    }


def clip(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """One ASCII line of at most `limit` bytes (NPD cuts stdout at max_output_length bytes)."""
    line = " ".join(message.split()).encode("ascii", "replace").decode("ascii")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def verdict(records: list[Any], window_s: float | None = None, now: float | None = None) -> tuple[int, str]:
    """(exit status, message) of `npd check` over framed kernel records (`sources.kernel.KernelRecord`).

    Records are classified as `up` classifies them (`sources.kernel.to_event`). A record of a
    permanent rule counts whatever its age; one of a temporary rule only when it is at most
    `window_s` seconds old (None: since boot; a record without a time counts). The message names
    the first condition of data/npd.yaml hit, else the earliest temporary reason (the first fault),
    with its PCI device (or process) and the count.
    """
    from xpu_serve.sources.kernel import to_event

    by_id = {r.row.id: r for r in rules()}
    now = time.time() if now is None else now
    hits: list[tuple[Rule, Any, Any]] = []
    for rec in records:
        ev = to_event(rec)
        rule = by_id.get(ev.signature or "") if ev is not None else None
        if rule is None:
            continue
        if rule.type == "temporary" and window_s is not None and rec.wall is not None and rec.wall < now - window_s:
            continue
        hits.append((rule, rec, ev))
    scope = "since boot" if window_s is None else f"since boot, events {window_s:g} s"
    if not hits:
        return OK, clip(f"no GPU fault in {len(records)} kernel records {scope}")
    order = [c["type"] for c in npd_data()["conditions"]]
    permanent = [h for h in hits if h[0].condition]
    rule, _rec, ev = min(permanent, key=lambda h: order.index(h[0].condition)) if permanent else hits[0]
    where = ev.extra.get("device") or ev.process or ""
    head = f"{rule.condition or rule.reason}" + (f" {where}" if where else "")
    return PROBLEM, clip(f"{head} ({len(hits)} GPU records {scope}): {rule.row.label}")
