"""``python -m xpu_serve.sim serve MODEL [vllm serve flags]``: run the vLLM stand-in."""

import sys

if __name__ == "__main__":
    from xpu_serve.sim.cli import main

    sys.exit(main())
