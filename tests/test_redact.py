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
        ("api_key: hello", "api_key: hello"),  # bare `name: value` in free text: not a shape (see below)
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


ONECCL = "2026:11:30-10:01:10: 9136:[1] |CCL_ERROR| internal_kvs.cpp:94 kvs_remove_name_key: client: remove_key"


@pytest.mark.parametrize(
    "line",
    [
        ONECCL,
        "vllm-service  | 2026:09:04-19:19:08:(  192) |CCL_ERROR| internal_kvs.cpp:94 kvs_remove_name_key: client: remove_key",
        "cache_key: 0x7f12 evicted",
        "routing_key=abc123 mode=x",
        "sort_key: lambda",
        "authorization failed: token expired",
        "max_num_batched_tokens=8192 tokenizer: /models/x",
    ],
)
def test_free_text_keeps_non_secrets(line: str) -> None:
    """Words ending in _key followed by ': value' (oneCCL's KVS) are evidence, not secrets."""
    assert Redactor().text(line) == line
    assert Redactor().bytes(line.encode()) == line.encode()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # environment variable assignments (upper-case names)
        ("docker run -e HF_TOKEN=hf_realAbc123 img", "docker run -e HF_TOKEN=*** img"),
        ("export VLLM_API_KEY='sk-live-998877'", "export VLLM_API_KEY='***'"),
        ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG x", "AWS_SECRET_ACCESS_KEY=*** x"),
        # flags
        ("args: vllm serve m --api-key sk-live-998877 --port 8000", "args: vllm serve m --api-key *** --port 8000"),
        ("--hf-token=hf_realAbc123 --tp 4", "--hf-token=*** --tp 4"),
        # headers
        ("Authorization: Bearer sk-live-998877", "Authorization: ***"),
        ("Proxy-Authorization: Basic dXNlcjpwYXNz", "Proxy-Authorization: ***"),
        ("X-API-Key: sk-live-998877", "X-API-Key: ***"),
        ('curl -H "x-api-key: sk-live-998877" http://127.0.0.1:8000', 'curl -H "x-api-key: ***" http://127.0.0.1:8000'),
        # quoted keys: JSON and Python dict reprs
        ('{"hf_token": "hf_realAbc123", "model": "m"}', '{"hf_token": "***", "model": "m"}'),
        ('{"api_key": 12345678}', '{"api_key": "***"}'),
        ("non-default args: {'api_key': 'sk-live-998877', 'tensor_parallel_size': 4}",
         "non-default args: {'api_key': '***', 'tensor_parallel_size': 4}"),
        # Python keyword repr with a quoted value (vLLM v0's `args: Namespace(...)`)
        ("args: Namespace(api_key='sk-live-998877', port=8000)", "args: Namespace(api_key='***', port=8000)"),
    ],
)
def test_free_text_masks_real_secrets_in_each_shape(text: str, expected: str) -> None:
    assert Redactor().text(text) == expected


def test_known_values_anywhere_in_free_text() -> None:
    """A secret from the config/env/argv is masked in any context, even after a bare `word_key:`."""
    known = secrets_in_argv(["vllm", "serve", "--api-key", "sk-ARGV-0b9d3e"]) + secrets_in_env(
        {"HF_TOKEN": "hf_ENV_77c2d1"}
    )
    r = Redactor(known)
    log = (
        f"{ONECCL}\n"
        "retry_key: sk-ARGV-0b9d3e\n"
        "GET /v1/models?token=hf_ENV_77c2d1 HTTP/1.1\n"
    )
    assert r.text(log) == f"{ONECCL}\nretry_key: ***\nGET /v1/models?token=*** HTTP/1.1\n"


def test_structured_text_keeps_key_rules() -> None:
    """env files and YAML (structured=True) mask `name: value` / `name=value` of any secret name."""
    r = Redactor()
    yaml_text = "engine:\n  api_key: sk-cfg-1234\n  max_num_batched_tokens: 8192\nhf_token=abc123\n"
    assert r.text(yaml_text, structured=True) == (
        "engine:\n  api_key: ***\n  max_num_batched_tokens: 8192\nhf_token=***\n"
    )
    assert r.bytes(b"HF_TOKEN: x1y2z3\n", structured=True) == b"HF_TOKEN: ***\n"
    # the same text as a log: only the unambiguous shapes
    assert r.text(yaml_text) == yaml_text
