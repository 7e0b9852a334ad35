"""Import path of the log pump used by `xpu_serve.supervisor`: see `xpu_serve.sources.log_pump`."""

from xpu_serve.sources.log_pump import LogPump, PumpStats

__all__ = ["LogPump", "PumpStats"]
