"""``flyspec.generate(prompt, "model-name")`` keeps its models, and only its models, between calls.

A library call given no ``Resources`` loads names through the one process-wide ``DEFAULT_MODELS``
(bounded, least recently used dropped); everything a generation learns (n-gram caches, calibrations)
stays in that call's own resources. The server never goes near it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import flyspec
import flyspec.api
import flyspec.resources
from flyspec.config import ConfigError, SpeculationConfig
from flyspec.resources import DEFAULT_MODELS, Resources
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.server.app import create_app
from server_helpers import RunningServer

PROMPT = "The capital of France is Paris. The capital of"
OPTIONS = {"max_new_tokens": 12, "use_chat": False}


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch, tiny_target: LoadedModel) -> Iterator[list[str]]:
    """Every model load by name (each gives the tiny target); DEFAULT_MODELS starts and ends empty, at its size."""
    calls: list[str] = []

    def load(name: str, **options: object) -> LoadedModel:
        calls.append(name)
        return tiny_target

    monkeypatch.setattr(flyspec.resources, "load_model", load)
    size = DEFAULT_MODELS.max_models
    DEFAULT_MODELS.resize(0)
    DEFAULT_MODELS.resize(size)
    yield calls
    DEFAULT_MODELS.resize(0)
    DEFAULT_MODELS.resize(size)


def test_generate_by_name_loads_the_model_once(loads: list[str]) -> None:
    first = flyspec.generate(PROMPT, "tiny", **OPTIONS)
    second = flyspec.generate(PROMPT, "tiny", **OPTIONS)
    plain = flyspec.generate_plain(PROMPT, "tiny", **OPTIONS)
    assert loads == ["tiny"]
    assert first.token_ids == second.token_ids == plain.token_ids  # exact verifier: the plain greedy output
    assert DEFAULT_MODELS.names() == ["tiny"]
    # other load options are another model
    flyspec.generate_plain(PROMPT, "tiny", dtype="bfloat16", **OPTIONS)
    assert loads == ["tiny", "tiny"]


def test_the_default_keeps_the_most_recently_used_models_only(loads: list[str]) -> None:
    def use(*names: str) -> None:
        for name in names:
            flyspec.generate_plain(PROMPT, name, max_new_tokens=1, use_chat=False)

    assert DEFAULT_MODELS.max_models == 2  # the default bound
    use("a", "b", "a", "c")  # c drops b, the least recently used
    assert loads == ["a", "b", "c"] and DEFAULT_MODELS.names() == ["a", "c"]
    use("a", "b")
    assert loads == ["a", "b", "c", "b"] and DEFAULT_MODELS.names() == ["a", "b"]
    flyspec.set_max_cached_models(1)
    assert DEFAULT_MODELS.names() == ["b"]
    flyspec.set_max_cached_models(0)  # none kept: every call loads
    use("b", "b")
    assert loads == ["a", "b", "c", "b", "b", "b"] and DEFAULT_MODELS.names() == []
    with pytest.raises(ConfigError, match="max_models must be an integer >= 0"):
        flyspec.set_max_cached_models(-1)


def test_no_ngram_cache_passes_between_calls_through_the_default(loads: list[str], tiny_target: LoadedModel) -> None:
    """The n-gram cache learns each output (``Drafter.finish``): shared, it drafts the second call from the first."""
    spec = SpeculationConfig(drafter="ngram-cache")
    first, second = (flyspec.generate(PROMPT, "tiny", spec, **OPTIONS) for _ in range(2))
    assert first.token_ids == second.token_ids
    assert first.stats.drafter == second.stats.drafter  # the second call's cache started as empty as the first's
    # what sharing would look like: a Resources the caller passes twice keeps the cache, and it shows
    shared = Resources(models=(tiny_target,))
    learned = [flyspec.generate(PROMPT, tiny_target, spec, resources=shared, **OPTIONS) for _ in range(2)]
    assert learned[0].stats.drafter == first.stats.drafter
    assert learned[1].stats.drafter != first.stats.drafter
    assert loads == ["tiny"]


def test_the_server_never_uses_the_default(monkeypatch: pytest.MonkeyPatch, tiny_target: LoadedModel) -> None:
    """Statically: nothing under flyspec/server names the default, and every decoder it builds is given
    its resources. Live: a request is served with the library's default resources made unusable."""
    server = Path(flyspec.__file__).parent / "server"
    for path in server.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        assert not names & {"DEFAULT_MODELS", "default_resources", "set_max_cached_models", "ModelCache"}, path
        for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
            function = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
            if function in ("build_decoder", "generate", "generate_plain"):
                assert "resources" in {keyword.arg for keyword in call.keywords}, f"{path}:{call.lineno}"

    def refuse(*args: object, **kwargs: object) -> Resources:
        raise AssertionError("the server used the library's default resources")

    monkeypatch.setattr(flyspec.api, "default_resources", refuse)
    app = create_app(tiny_target, SpeculationConfig(drafter="ngram-cache"), served_model_name="tiny")
    with RunningServer(app) as running:
        response = httpx.post(
            f"{running.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4}, timeout=60
        )
    assert response.status_code == 200, response.text
    assert DEFAULT_MODELS.names() == []
