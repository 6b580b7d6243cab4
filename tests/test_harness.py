"""What bench and eval share: one method grammar, data files with file:line errors, run metadata."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from flyspec.config import ConfigError, GuardConfig, SpeculationConfig
from flyspec.harness.data import DataError, JsonlWriter, read_jsonl, read_records, spec_bench_path, vendored_path
from flyspec.harness.meta import run_metadata
from flyspec.harness.methods import PEERS, PLAIN, Method, parse_method, parse_methods
from flyspec.runtime.loaded_model import LoadedModel

# --- methods ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "drafter", "verifier", "modifier"),
    [
        ("ngram+exact", "ngram", "exact", None),
        ("fly", None, "fly", None),  # no drafter: the run's speculation config decides
        ("fly+bare", None, "fly", "bare"),
        ("draft+fly+bare", "draft-model", "fly", "bare"),  # bench's short form of draft-model
        ("draft-model+margin+identifiers", "draft-model", "margin", "identifiers"),
        ("layer-skip+typical+guard", "layer-skip", "typical", "guard"),
    ],
)
def test_one_grammar_for_both_harnesses(name: str, drafter: str | None, verifier: str, modifier: str | None) -> None:
    method = parse_method(f" {name} ")
    assert (method.name, method.drafter, method.verifier, method.modifier) == (name, drafter, verifier, modifier)
    assert method.engine == "flyspec" and not method.peer
    assert method.lossless == (verifier == "exact")


def test_modifiers_choose_the_guards() -> None:
    assert parse_method("fly+bare").guard_config() == GuardConfig.bare()
    assert parse_method("fly").guard_config() == GuardConfig()
    guard = parse_method("ngram+fly+guard")
    assert guard.protect("code") == ("digits", "identifiers") and guard.protect("text") == ("digits",)
    assert parse_method("margin+names").protect() == ("names",)
    assert parse_method("ngram+exact").protect("code") == ()  # lossless: nothing to protect


def test_a_draft_length_suffix_sets_the_policy_of_that_method_only() -> None:
    cost, fly = parse_method("ngram+fly+bare@cost"), parse_method("fly@heuristic")
    assert (cost.name, cost.drafter, cost.verifier, cost.modifier, cost.draft_length) == (
        "ngram+fly+bare@cost",
        "ngram",
        "fly",
        "bare",
        "cost",
    )
    base = SpeculationConfig(num_draft_tokens=9)
    assert cost.with_draft_length(base).draft_length.policy == "cost"
    assert fly.with_draft_length(base).draft_length.policy == "heuristic"
    assert parse_method("ngram+exact").with_draft_length(base) is base
    bad_names = (
        ("plain@cost", "plain decoding drafts nothing"),
        ("ngram+exact@fast", "unknown draft length @fast"),
        ("@cost", "unknown draft length"),
    )
    for bad, message in bad_names:
        with pytest.raises(ConfigError, match=message):
            parse_method(bad)


def test_plain_and_peers() -> None:
    plain = parse_method("plain")
    assert plain.is_plain and plain.verifier is None and plain.lossless and not plain.peer
    lookup, assisted, fly = (parse_method(name) for name in ("hf-lookup", "hf-assisted", "vllm-ngram+fly+bare"))
    assert (lookup.engine, lookup.lossless, lookup.needs_draft_model) == ("hf", True, False)
    assert assisted.needs_draft_model and parse_method("multilevel+fly").needs_draft_model
    assert (fly.engine, fly.verifier, fly.bare, fly.lossless) == ("vllm", "fly", True, False)


def test_old_spellings_are_accepted_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        names = [method.name for method in parse_methods("baseline,vllm-fly,vllm-fly+bare")]
    assert names == [PLAIN, "vllm-ngram+fly", "vllm-ngram+fly+bare"]
    assert "'baseline' is deprecated; use 'plain'" in caplog.text


def test_methods_keep_their_order_and_run_once() -> None:
    assert [m.name for m in parse_methods("fly, ngram+exact,fly,plain")] == ["fly", "ngram+exact", PLAIN]


@pytest.mark.parametrize(
    ("name", "peers", "message"),
    [
        ("medusa", PEERS, "unknown method 'medusa'; use plain, \\[<ngram\\|"),
        ("ngram+nope", PEERS, "unknown method 'ngram\\+nope'"),
        ("ngram+fly+bare+guard", PEERS, "unknown method"),
        ("fly+loud", PEERS, "unknown modifier \\+loud"),
        ("exact+bare", PEERS, "exact is lossless"),
        ("hf-lookup", ("vllm-ngram+fly",), "unknown method 'hf-lookup'.*a peer: vllm-ngram\\+fly$"),
    ],
)
def test_bad_method_names_say_what_to_write(name: str, peers: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_method(name, peers)


def test_no_methods_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no methods given"):
        parse_methods(" , ")


def test_method_defaults_to_flyspec_engine() -> None:
    assert Method("x", verifier="exact").engine == "flyspec"


# --- data ---------------------------------------------------------------------------------------


def test_vendored_paths() -> None:
    assert spec_bench_path().is_file() and spec_bench_path().name == "question.jsonl"
    assert vendored_path("flyspec.eval", "gsm8k", "test.jsonl").is_file()


def test_read_jsonl_names_file_and_line_or_skips(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n{broken\n[1]\n{"a": 2}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:3: invalid JSON.*--skip-bad-lines"):
        list(read_jsonl(path, skip_bad_lines=False))
    skipped: list[str] = []
    rows = list(read_jsonl(path, skip_bad_lines=True, on_skip=skipped.append))
    assert rows == [(1, {"a": 1}), (5, {"a": 2})]
    assert len(skipped) == 2 and "d.jsonl:4: expected a JSON object, got list" in skipped[1]
    with pytest.raises(DataError, match="data file not found"):
        list(read_jsonl(tmp_path / "none.jsonl", skip_bad_lines=True))


def test_read_jsonl_decompresses_gz(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write('{"k": "v"}\n')
    assert list(read_jsonl(path, skip_bad_lines=False)) == [(1, {"k": "v"})]


def test_unreadable_data_files_are_data_errors(tmp_path: Path) -> None:
    """Not UTF-8, or a corrupt .gz: a DataError naming the file (the CLI's one-line exit 2), never a traceback."""
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"a": 1}\n{"prompt": "caf\xe9"}\n{"a": 3}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not UTF-8 text"):
        list(read_jsonl(latin1, skip_bad_lines=False))
    assert list(read_jsonl(latin1, skip_bad_lines=True)) == [(1, {"a": 1}), (3, {"a": 3})]
    not_gzip = tmp_path / "d.jsonl.gz"
    not_gzip.write_bytes(b"plain text, not gzip")
    with pytest.raises(DataError, match=r"cannot read .*d\.jsonl\.gz"):
        list(read_jsonl(not_gzip, skip_bad_lines=True))
    truncated = tmp_path / "t.jsonl.gz"
    truncated.write_bytes(gzip.compress(b'{"a": 1}\n' * 100)[:-12])
    with pytest.raises(DataError, match=r"cannot read .*t\.jsonl\.gz"):
        list(read_jsonl(truncated, skip_bad_lines=True))


def test_a_record_torn_inside_a_character_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    with JsonlWriter(path, append=False) as writer:
        writer.write({"n": 1})
    with path.open("ab") as handle:
        handle.write('{"n": 2, "text": "é'.encode()[:-1])  # killed halfway through a two-byte character
    assert read_records(path) == [{"n": 1}]


def test_records_written_line_by_line_survive_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "out" / "records.jsonl"
    with JsonlWriter(path, append=False) as writer:
        writer.write({"n": 1, "text": "é"})
    with JsonlWriter(path, append=True) as writer:
        writer.write({"n": 2})
    with path.open("a", encoding="utf-8") as handle:
        handle.write('{"n": 3, "tor')
    assert read_records(path) == [{"n": 1, "text": "é"}, {"n": 2}]
    assert read_records(tmp_path / "none.jsonl") == []


# --- metadata -----------------------------------------------------------------------------------


def test_run_metadata_names_the_command_model_and_versions(tiny_target: LoadedModel) -> None:
    meta = run_metadata(tiny_target, "flyspec bench --quick")
    assert meta["command"] == "flyspec bench --quick"
    assert meta["target"] == tiny_target.name and meta["dtype"] == "float32"
    assert "torch threads" in meta["machine"] and meta["versions"].startswith("flyspec ")
    assert meta["date"].endswith("UTC")
    json.dumps(meta)  # a JSON file holds it
