"""Keyed page keys: with a fleet secret, page keys are HMAC-SHA256 over what they hash
unkeyed; schedulers with different secrets never share a key, the same secret gives the
same keys, and no secret gives exactly today's keys."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.hicache_config import AUTH_TOKEN_ENV, KEY_SECRET_ENV, HiCacheConfig
from services.common.page_hash import KeyNamespace, PageHasher, kv_layout
from services.scheduler.page_keys import PageKeys
from tests.unit.test_hicache_scheduler import make, run

NS = KeyNamespace(model="toy:abc", weights_version="3", adapter="lora-a", page_size=4,
                  kv_layout=kv_layout("bfloat16", 2, 2, 16))
# Keys of NS over range(12) as the unkeyed chain computed them before keyed keys existed.
UNKEYED_ROOT = "5baaa2fcd92b4665d3b9bd82f89d66f6ac9a5aa060d6582c29265083e428f9a7"
UNKEYED = ["d14945ea10ed066a123046d9e6e8d44b614f37c49bccbd292319bc7497d56124",
           "137b5ba9fc566a9e4ac3c4ef0ccfa21c8667614651d0de8afe3bda52e1a1ef59",
           "9074a79de9518198cc1c8598c40e12b7d105695477dfeb3c245d94e804d10f03"]
SECRET_A, SECRET_B = b"a" * 32, b"b" * 32


def test_no_secret_gives_todays_keys() -> None:
    h = PageHasher(NS)
    assert h.root.hex() == UNKEYED_ROOT
    assert [k.hex() for k in h.keys(list(range(12)))] == UNKEYED
    assert PageKeys(4, NS.model, NS.weights_version, NS.kv_layout).hasher("lora-a").keys(range(12)) == h.keys(range(12))


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 2**31 - 1), min_size=4, max_size=40))
def test_different_secrets_share_no_key_and_the_same_secret_agrees(ids: list[int]) -> None:
    a1, a2, b = PageHasher(NS, SECRET_A), PageHasher(NS, SECRET_A), PageHasher(NS, SECRET_B)
    plain = PageHasher(NS)
    assert a1.keys(ids) == a2.keys(ids)
    keysets = [set(h.keys(ids)) | {h.root} for h in (a1, b, plain)]
    assert all(len(k) == 32 for k in keysets[0])
    assert not keysets[0] & keysets[1] and not keysets[0] & keysets[2] and not keysets[1] & keysets[2]


def test_keyed_chains_extend_incrementally() -> None:
    h = PageHasher(NS, SECRET_A)
    ids = list(range(20))
    first = h.keys(ids[:8])
    assert first + h.keys(ids[8:], parent=first[-1]) == h.keys(ids)


def test_empty_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="the page-key secret must not be empty"):
        PageHasher(NS, b"")


def _secret_file(tmp_path: Path, name: str, value: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(value + b"\n")  # as `openssl rand -hex 32 > file` writes it
    return str(path)


def test_two_schedulers_sharing_a_store_hit_only_with_the_same_secret(tmp_path: Path) -> None:
    store: dict = {}
    a, b = _secret_file(tmp_path, "a", SECRET_A), _secret_file(tmp_path, "b", SECRET_B)
    prompt = list(range(1, 13))
    s1, w1 = make(store=store, kv_key_secret_file=a)
    run(s1, w1, [("x", prompt)])
    written = len(store)
    assert written >= 11
    s_plain, w_plain = make(store=store)
    assert run(s_plain, w_plain, [("p", prompt + [5])])["p"][2] == 0  # unkeyed: no hit
    assert len(store) >= 2 * written  # its pages of the same prefix came under keys of their own
    s_other, w_other = make(store=store, kv_key_secret_file=b)
    assert run(s_other, w_other, [("o", prompt + [5])])["o"][2] == 0  # another secret: no hit
    assert len(store) >= 3 * written
    s_same, w_same = make(store=store, kv_key_secret_file=a)
    assert run(s_same, w_same, [("s", prompt + [5])])["s"][2] >= 11  # the same secret: a hit


def test_secret_and_token_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _secret_file(tmp_path, "k", SECRET_A)
    assert HiCacheConfig(kv_key_secret_file=path).key_secret() == SECRET_A  # the newline is stripped
    assert HiCacheConfig().key_secret() is None and HiCacheConfig().kvstore_auth_token() is None
    monkeypatch.setenv(KEY_SECRET_ENV, SECRET_B.decode())
    monkeypatch.setenv(AUTH_TOKEN_ENV, "t" * 20)
    assert HiCacheConfig().key_secret() == SECRET_B and HiCacheConfig(kv_key_secret_file=path).key_secret() == SECRET_A
    assert HiCacheConfig().kvstore_auth_token() == "t" * 20
    with pytest.raises(ValueError, match="--kv-key-secret-file"):
        HiCacheConfig(kv_key_secret_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        HiCacheConfig(kv_key_secret_file=_secret_file(tmp_path, "short", b"abc"))
    with pytest.raises(ValueError, match="printable ASCII"):
        HiCacheConfig(kvstore_auth_token_file=_secret_file(tmp_path, "bin", b"\x01" * 20))
