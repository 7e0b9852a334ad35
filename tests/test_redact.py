"""Redaction of secrets (xpu_serve.redact): shapes, known values, argv, env, nested config."""

from __future__ import annotations

import json

import pytest

from xpu_serve.config import Config
from xpu_serve.redact import (
    MASK,
    Redactor,
    is_secret_name,
    secrets_in_argv,
    secrets_in_env,
    secrets_in_mapping,
)


@pytest.mark.parametrize(
    "name",
    ["HF_TOKEN", "api_key", "--api-key", "OPENAI_API_KEY", "hfToken", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD2",
     '"api_key"', "x-api-key", "apikey", "MY_TOKEN", "client_secret", "PGPASSWD", "GOOGLE_CREDENTIALS"],
)
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    ["max_tokens", "tokenizer", "prompt_token_ids", "token_count", "max_num_batched_tokens",
     "vllm:generation_tokens_total", "CCL_ZE_IPC_EXCHANGE", "PATH", "model", "KEY_CACHE_DTYPE_UNUSED"],
)
def test_not_secret_names(name: str) -> None:
    assert not is_secret_name(name)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("HF_TOKEN=abc def", "HF_TOKEN=*** def"),
        ('export API_KEY="x y" next', 'export API_KEY="***" next'),
        ('{"api_key": "zz", "a": 1}', '{"api_key": "***", "a": 1}'),
        ("non-default args: {'api_key': 'qq', 'max_num_batched_tokens': 8192}",
         "non-default args: {'api_key': '***', 'max_num_batched_tokens': 8192}"),
        ("vllm serve m --api-key foo --port 1", "vllm serve m --api-key *** --port 1"),
        ("--hf-token=bar", "--hf-token=***"),
        ("Authorization: Bearer abc.def", "Authorization: ***"),
        ('curl -H "Authorization: Bearer xyz" http://h', 'curl -H "Authorization: ***" http://h'),
        ("api_key: hello", "api_key: ***"),
        ("Namespace(api_key='s3', x=1)", "Namespace(api_key='***', x=1)"),
        ("Avg prompt throughput: 3.0 tokens/s, tokenizer: /models/x", "Avg prompt throughput: 3.0 tokens/s, tokenizer: /models/x"),
        ("--api-key\nnext line", "--api-key\nnext line"),  # never reaches across lines
    ],
)
def test_text_shapes(text: str, expected: str) -> None:
    assert Redactor().text(text) == expected


def test_known_values_anywhere_and_short_values_ignored() -> None:
    r = Redactor(["sk-planted-123", "ab", "hf_ÄÖÜ_tok"])
    assert r.text("GET http://x/?t=sk-planted-123&y=1 ab") == "GET http://x/?t=***&y=1 ab"
    assert "ab" not in r.secrets  # shorter than MIN_SECRET_LEN: only the shapes apply
    # plain words and short numbers under secret names are not hunted everywhere
    assert Redactor(["none", "true", "1234", "auto"]).secrets == frozenset()
    # a non-ASCII secret in UTF-8 bytes, next to bytes that are not UTF-8 at all
    data = b"\xff\xfe junk " + "hf_ÄÖÜ_tok".encode() + b" \x00\x80 end"
    out = r.bytes(data)
    assert out == b"\xff\xfe junk *** \x00\x80 end"


def test_argv_env_mapping() -> None:
    r = Redactor()
    assert r.argv(["vllm", "serve", "m", "--api-key", "sk-1", "--hf-token=abc", "--port", "8"]) == [
        "vllm", "serve", "m", "--api-key", MASK, "--hf-token=***", "--port", "8"]
    assert r.env({"HF_TOKEN": "x", "PATH": "/bin", "MAX_TOKENS": "5"}) == {
        "HF_TOKEN": MASK, "PATH": "/bin", "MAX_TOKENS": "5"}
    cfg = Config.model_validate({
        "engine": {"model": "m", "api_key": "sk-cfg", "args": {"hf-token": "t1", "max-num-seqs": 4}},
        "environment": {"vars": {"HF_TOKEN": "t2", "ZE_AFFINITY_MASK": "0,1"}},
    })
    dump = cfg.model_dump(mode="json")
    red = r.mapping(dump)
    assert red["engine"]["api_key"] == MASK
    assert red["engine"]["args"] == {"hf-token": MASK, "max-num-seqs": 4}
    assert red["environment"]["vars"] == {"HF_TOKEN": MASK, "ZE_AFFINITY_MASK": "0,1"}
    assert sorted(secrets_in_mapping(dump)) == ["sk-cfg", "t1", "t2"]
    assert secrets_in_env({"A_TOKEN": "v", "B": "w"}) == ["v"]
    assert secrets_in_argv(["x", "--api-key", "k1", "--token=k2", "--api-key", "--other"]) == ["k1", "k2"]


def test_json_stays_json() -> None:
    doc = {"api_key": None, "secret": 5, "hf_token": "x", "token_count": 3, "nested": {"password": True}}
    red = Redactor().text(json.dumps(doc, indent=2))
    back = json.loads(red)
    assert back == {"api_key": None, "secret": MASK, "hf_token": MASK, "token_count": 3, "nested": {"password": True}}
