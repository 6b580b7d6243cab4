"""The n-gram cache file is durable (fsync, atomic, ENOSPC-safe), private (0600, HMAC tenant ids) and bounded.

Issue 31, item 4. Unit tests on :class:`~flyspec.server.cache_file.CacheFile`, and the app around it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from flyspec.config import SpeculationConfig
from flyspec.drafters import ngram_cache
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.server.app import create_app
from flyspec.server.cache_file import (
    FILE_FORMAT,
    FILE_VERSION,
    SECRET_ENV,
    CacheFile,
    SavedTenant,
    bounded,
    legacy_tenant_of,
    read_secret,
)
from flyspec.server.security import tenant_of
from flyspec.server.settings import ServerSecurity

KEYS = ("key-of-alice", "key-of-bob")
PROMPT = "Speculative decoding drafts tokens cheaply and"


def make_app(target: LoadedModel, path: Path, keys: tuple[str, ...] = KEYS, **options: Any) -> Any:
    spec = SpeculationConfig(drafter="ngram-cache", num_draft_tokens=4)
    security = ServerSecurity(api_keys=keys)
    return create_app(target, spec, security=security, served_model_name="tiny", ngram_cache_file=path, **options)


def ask(client: TestClient, key: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


def serve_once(target: LoadedModel, path: Path, keys: tuple[str, ...] = KEYS, **options: Any) -> None:
    """Start, let each key generate once, shut down (which saves)."""
    with TestClient(make_app(target, path, keys, **options), base_url="http://127.0.0.1") as client:
        for key in keys:
            ask(client, key)


def tenant(path: Path, key: str) -> str:
    return tenant_of(key, read_secret(Path(f"{path}.key")))


def test_the_file_and_its_secret_are_private_and_name_no_key(tiny_target: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "caches.json"
    serve_once(tiny_target, path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert Path(f"{path}.key").stat().st_mode & 0o777 == 0o600
    text = path.read_text()
    document = json.loads(text)
    assert document["format"] == FILE_FORMAT and document["version"] == FILE_VERSION
    for key in KEYS:
        bare = hashlib.sha256(key.encode()).hexdigest()
        assert key not in text and bare[:16] not in text and bare not in text  # neither the key nor its bare hash
        assert tenant(path, key) in document["tenants"]  # an HMAC under the secret
    other_secret = tenant_of(KEYS[0], b"another secret")
    assert other_secret not in document["tenants"]


def test_tenants_whose_keys_are_gone_are_dropped(tiny_target: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "caches.json"
    serve_once(tiny_target, path)
    alice, bob = tenant(path, KEYS[0]), tenant(path, KEYS[1])
    assert set(json.loads(path.read_text())["tenants"]) == {alice, bob}
    app = make_app(tiny_target, path, keys=(KEYS[0],))  # bob's key removed
    assert set(app.state.planner.caches._tenants) == {alice}
    with TestClient(app, base_url="http://127.0.0.1"):
        pass  # shutdown saves
    assert set(json.loads(path.read_text())["tenants"]) == {alice}  # never written again
    without_keys = make_app(tiny_target, path, keys=())  # no keys at all: every key tenant goes
    assert not without_keys.state.planner.caches._tenants


def test_a_save_fsyncs_the_file_before_the_rename_and_the_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, Any]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def replace(source: Any, target: Any) -> None:
        calls.append(("replace", str(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "caches.json"
    CacheFile(path, b"secret").save({"default": SavedTenant(1.0, {"tiny": [((1, 2), 3)]})})
    kinds = [kind for kind, _ in calls]
    assert kinds == ["fsync", "replace", "fsync"], calls
    assert Path(calls[0][1]).name.startswith(".caches.json.") and calls[0][1].endswith(".tmp")  # the data first
    assert calls[2][1] == str(tmp_path)  # then the directory that holds the new name


def test_a_full_disk_keeps_the_old_file_and_the_server_serving(
    tiny_target: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "caches.json"
    serve_once(tiny_target, path)
    before = path.read_bytes()
    failures = []
    real_dump = json.dump

    def full_disk(document: Any, file: Any, **options: Any) -> None:
        file.write('{"format": "flyspec-server-ngram-caches", "tenants": {')  # a part, as a full disk leaves it
        failures.append(time.monotonic())
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ngram_cache.json, "dump", full_disk)
    app = make_app(tiny_target, path, ngram_cache_save_interval_s=0.05)
    with caplog.at_level(logging.ERROR, "flyspec.server.app"), TestClient(app, base_url="http://127.0.0.1") as client:
        deadline = time.monotonic() + 10
        while len(failures) < 2 and time.monotonic() < deadline:
            ask(client, KEYS[1])  # served between and during failed saves
        assert len(failures) >= 2
        assert path.read_bytes() == before  # the old file, intact
        assert not list(tmp_path.glob(".caches.json.*.tmp"))  # no partial file left behind
        monkeypatch.setattr(ngram_cache.json, "dump", real_dump)  # space again: the next save works
    assert "No space left on device" in caplog.text and "previous file is kept" in caplog.text
    assert path.read_bytes() != before and json.loads(path.read_text())["version"] == FILE_VERSION


def test_the_file_is_bounded_least_recently_used_first(tmp_path: Path) -> None:
    tenants = {
        "old": SavedTenant(100.0, {"tiny": [((1,), 2), ((2,), 3), ((3,), 4)]}),
        "new": SavedTenant(200.0, {"tiny": [((5,), 6), ((6,), 7)]}),
    }
    kept, evicted = bounded(tenants, 3)
    assert evicted == 2
    assert kept["old"].caches == {"tiny": [((3,), 4)]}  # its least recently used n-grams went first
    assert kept["new"].caches == tenants["new"].caches  # the tenant used last kept everything
    assert set(bounded(tenants, 2)[0]) == {"new"}  # a tenant with nothing left is not written
    path = tmp_path / "caches.json"
    CacheFile(path, b"secret", max_entries=3).save(tenants)
    saved = json.loads(path.read_text())["tenants"]
    assert sum(len(cache) for tenant in saved.values() for cache in tenant["caches"].values()) == 3


def test_the_bound_applies_to_a_serving_app(tiny_target: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "caches.json"
    serve_once(tiny_target, path, ngram_cache_file_max_entries=10)
    saved = json.loads(path.read_text())["tenants"]
    assert sum(len(cache) for tenant in saved.values() for cache in tenant["caches"].values()) == 10
    assert set(saved) == {tenant(path, KEYS[1])}  # bob asked last: alice's n-grams were the least recently used


def test_a_version_1_file_is_migrated(
    tiny_target: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "caches.json"
    legacy = {
        legacy_tenant_of(KEYS[0]): {"tiny-target": [[[7], 8], [[7, 8], 9]]},
        legacy_tenant_of("a key no longer configured"): {"tiny-target": [[[1], 2]]},
        "default": {"tiny-target": [[[3], 4]]},
    }
    path.write_text(json.dumps({"format": FILE_FORMAT, "version": 1, "tenants": legacy}))
    with caplog.at_level(logging.WARNING, "flyspec.server.cache_file"):
        app = make_app(tiny_target, path)
    assert "version 1" in caplog.text and "1 tenant(s) migrated" in caplog.text
    alice = tenant(path, KEYS[0])
    assert set(app.state.planner.caches._tenants) == {alice}
    cache = app.state.planner.caches.resources_for(alice).ngram_caches_by_vocabulary()["tiny-target"]
    assert cache.entries() == [[[7], 8], [[7, 8], 9]]
    with TestClient(app, base_url="http://127.0.0.1"):
        pass
    document = json.loads(path.read_text())
    assert document["version"] == FILE_VERSION and set(document["tenants"]) == {alice}
    assert legacy_tenant_of(KEYS[0]) not in path.read_text()


def test_another_secret_matches_no_tenant(
    tiny_target: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "caches.json"
    serve_once(tiny_target, path)
    monkeypatch.setenv(SECRET_ENV, "the operator's own secret")
    with caplog.at_level(logging.WARNING, "flyspec.server.cache_file"):
        app = make_app(tiny_target, path)
    assert "another secret" in caplog.text
    assert not app.state.planner.caches._tenants
    assert app.state.cache_file.secret == b"the operator's own secret"


def test_a_temporary_file_left_by_a_kill_is_removed_at_start(tiny_target: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "caches.json"
    serve_once(tiny_target, path)
    stale = tmp_path / ".caches.json.abc123.tmp"
    stale.write_text('{"format": "flyspec-server-ngram-caches", "ten')  # a save cut short by kill -9
    app = make_app(tiny_target, path)
    assert not stale.exists()
    assert app.state.planner.caches._tenants  # the file itself was whole and is restored
