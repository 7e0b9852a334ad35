"""Copies of one line in several files of one incident (a bundle's vllm.log and its per-process
copies) counted once: the occurrences of a line count as the most any single file holds."""

from __future__ import annotations

from xpu_serve.events import Event


class Dedup:
    """(text, pid, own time) of classified lines -> {file: times seen}; `duplicates` counts the
    copies dropped. Bounded: 200,000 keys (then nothing more is dropped), 4096 unstamped lines."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int | None, str | None], dict[str, int]] = {}
        self._seen_untimed: dict[tuple[str, int | None, str | None], Event] = {}
        self.duplicates = 0

    def reset(self) -> None:
        """Forget the lines seen (a restart of vLLM in the input); the count stays."""
        self._seen.clear()
        self._seen_untimed.clear()

    def duplicate(self, ev: Event, file: str) -> bool:
        """True when this line (same text after wrappers, same pid, same own time stamp) was
        already read from another file as often as it has now been seen in this one: the
        occurrences of a line count as the most any single file holds (repeats within one file
        are real repeats; copies in other files are not)."""
        key = (ev.text.strip(), ev.pid, ev.time_text)
        per_file = self._seen.get(key)
        if per_file is None:
            if len(self._seen) < 200_000:
                self._seen[key] = {file: 1}
                if ev.time_text is None and len(self._seen_untimed) < 4096:
                    self._seen_untimed[key] = ev
            return False
        n = per_file.get(file, 0) + 1
        per_file[file] = n
        if n <= max((c for f, c in per_file.items() if f != file), default=0):
            self.duplicates += 1
            # an unstamped line (a crash dump) is placed in time by the lines around it: keep the
            # placement of the copy that has one (the full log) when the first copy had none
            first = self._seen_untimed.get(key)
            if first is not None and "_tkey" not in first.extra and "_tkey" in ev.extra:
                first.extra["_tkey"] = ev.extra["_tkey"]
            return True
        return False
