"""``flyspec serve --ngram-cache-file``: the tenants' n-gram caches survive a restart, each tenant's its own."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from flyspec.cli.app import main
from flyspec.config import ConfigError, SpeculationConfig
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.server.app import create_app
from flyspec.server.cache_file import FILE_FORMAT, CacheFile, read_secret
from flyspec.server.caches import SHARED_TENANT
from flyspec.server.security import tenant_of
from flyspec.server.settings import ServerSecurity

KEYS = ("key-of-alice", "key-of-bob")
PROMPT = "Speculative decoding drafts tokens cheaply and"


def make_app(target: LoadedModel, path: Path, *, shared: bool = False) -> Any:
    security = ServerSecurity(api_keys=KEYS, share_ngram_cache=shared)
    spec = SpeculationConfig(drafter="ngram-cache", num_draft_tokens=4)
    return create_app(target, spec, security=security, served_model_name="tiny", ngram_cache_file=path)


def ask(client: TestClient, key: str, prompt: str = PROMPT) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
    response = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


def tenant(path: Path, key: str) -> str:
    """The key's tenant id in the cache file at ``path`` (keyed with the secret made beside it)."""
    return tenant_of(key, read_secret(Path(f"{path}.key")))


def cache_entries(app: Any, key: str) -> dict[str, list]:
    view = app.state.planner.caches.resources_for(tenant(app.state.cache_file.path, key))
    return {name: cache.entries() for name, cache in view.ngram_caches_by_vocabulary().items()}


def test_caches_round_trip_and_stay_with_their_tenant(tiny_target: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "caches.json"
    first = make_app(tiny_target, path)
    with TestClient(first, base_url="http://127.0.0.1") as client:
        before = ask(client, KEYS[0])
        assert before["usage"]["drafter"]["cache_hits"] == 0  # nothing cached yet
    saved = json.loads(path.read_text())
    assert saved["format"] == FILE_FORMAT and list(saved["tenants"]) == [tenant(path, KEYS[0])]
    assert KEYS[0] not in path.read_text()  # tenants are named by a hash, never by the key
    alice_entries = cache_entries(first, KEYS[0])
    assert sum(len(entries) for entries in alice_entries.values()) > 0

    second = make_app(tiny_target, path)  # a restart
    assert cache_entries(second, KEYS[0]) == alice_entries  # the same n-grams, in the same recency order
    with TestClient(second, base_url="http://127.0.0.1") as client:
        bob = ask(client, KEYS[1])
        alice = ask(client, KEYS[0])
    assert bob["usage"]["drafter"]["cache_hits"] == 0  # alice's text is never drafted for bob
    assert alice["usage"]["drafter"]["cache_hits"] > 0  # alice drafts from what she generated before
    assert alice["choices"][0]["text"] == before["choices"][0]["text"]  # exact verifier: same output
    assert set(json.loads(path.read_text())["tenants"]) == {tenant(path, KEYS[0]), tenant(path, KEYS[1])}


def test_a_shared_cache_never_takes_a_tenants_entries(tiny_target: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "caches.json"
    with TestClient(make_app(tiny_target, path), base_url="http://127.0.0.1") as client:
        ask(client, KEYS[0])
    per_tenant = json.loads(path.read_text())["tenants"]
    shared_app = make_app(tiny_target, path, shared=True)
    with TestClient(shared_app, base_url="http://127.0.0.1") as client:
        assert ask(client, KEYS[1])["usage"]["drafter"]["cache_hits"] == 0
    tenants = json.loads(path.read_text())["tenants"]
    assert tenants[tenant(path, KEYS[0])] == per_tenant[tenant(path, KEYS[0])]  # kept in the file, not restored
    assert SHARED_TENANT in tenants
    per_tenant_again = make_app(tiny_target, path)  # and the shared cache is not given to a tenant either
    caches = per_tenant_again.state.planner.caches
    assert SHARED_TENANT not in caches._tenants and caches._dormant.keys() == {SHARED_TENANT}


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"format": "flyspec-ngram-cache", "version": 1, "entries": []}),  # a single cache's file
        json.dumps({"format": FILE_FORMAT, "version": 1, "tenants": {"default": {"tiny": [[[1], -1]]}}}),
        json.dumps({"format": FILE_FORMAT, "version": 1, "tenants": {"default": [1, 2]}}),
    ],
)
def test_a_corrupt_file_is_a_clear_start_up_error(
    tiny_target: LoadedModel, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    path = tmp_path / "caches.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="ngram-cache-file"):
        make_app(tiny_target, path)
    # the command line says so in one line (exit 2) before loading any model
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--target", str(tmp_path / "no-such-model"), "--ngram-cache-file", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--ngram-cache-file" in err
    assert "not found" not in err and "Traceback" not in err
    assert path.read_text() == content  # left as it was


def test_a_missing_directory_is_a_start_up_error(tiny_target: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        make_app(tiny_target, tmp_path / "missing" / "caches.json")


def test_caches_are_also_saved_while_serving(tiny_target: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "caches.json"
    security = ServerSecurity(api_keys=KEYS)
    spec = SpeculationConfig(drafter="ngram-cache", num_draft_tokens=4)
    app = create_app(tiny_target, spec, security=security, ngram_cache_file=path, ngram_cache_save_interval_s=0.1)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        ask(client, KEYS[0])
        deadline = time.monotonic() + 10

        def saved_tenants() -> dict[str, Any]:
            return json.loads(path.read_text())["tenants"] if path.exists() else {}

        while tenant(path, KEYS[0]) not in saved_tenants() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tenant(path, KEYS[0]) in saved_tenants()  # before shutdown


def test_a_save_in_flight_never_overwrites_a_newer_one(tiny_target: LoadedModel, tmp_path: Path) -> None:
    """The periodic save (a thread) may still run when shutdown saves: the file must end with the newer n-grams."""
    import threading

    from flyspec.config import NgramCacheConfig, NgramConfig
    from flyspec.server.caches import TenantCaches

    caches = TenantCaches(Resources(models=(tiny_target,)), shared=False)
    cache = caches.resources_for("default").ngram_cache("tiny", NgramCacheConfig(), NgramConfig())
    cache.add_entries([((1, 2), 3)])
    path = tmp_path / "caches.json"
    in_snapshot, release = threading.Event(), threading.Event()
    entries = cache.entries

    def slow_entries() -> list:
        taken = entries()
        if threading.current_thread().name == "periodic":
            in_snapshot.set()
            release.wait(5)
        return taken

    cache.entries = slow_entries  # type: ignore[method-assign]
    file = CacheFile(path, b"secret")
    periodic = threading.Thread(target=caches.save, args=(file,), name="periodic")
    periodic.start()
    assert in_snapshot.wait(5)
    cache.add_entries([((4, 5), 6)])  # generated after the periodic snapshot
    final = threading.Thread(target=caches.save, args=(file,), name="shutdown")
    final.start()
    final.join(0.5)
    release.set()
    periodic.join(5)
    final.join(5)
    saved = json.loads(path.read_text())["tenants"]["default"]["caches"]["tiny"]
    assert [[4, 5], 6] in saved
