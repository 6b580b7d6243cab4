"""``scripts/index_download.py`` (``make vllm-own-tests``): a pinned file found through the index pip is configured
with. On indexes made in the test (a ``file://`` one laid out as pip reads it, and one over HTTP on localhost): no
network, seconds."""

from __future__ import annotations

import base64
import hashlib
import http.server
import importlib.util
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("index_download", ROOT / "scripts" / "index_download.py")
assert spec is not None and spec.loader is not None
index_download = importlib.util.module_from_spec(spec)
sys.modules["index_download"] = index_download  # its dataclass looks its module up
spec.loader.exec_module(index_download)

CONTENT = b"an sdist's bytes"
SHA256 = hashlib.sha256(CONTENT).hexdigest()
OTHER = hashlib.sha256(b"another file").hexdigest()


def file_index(root: Path, listed_hash: str | None = SHA256, content: bytes = CONTENT) -> str:
    """A PEP 503 index in ``root`` as a folder (``simple/demo/index.html``, the file in ``files/``); its URL."""
    (root / "files").mkdir(parents=True)
    (root / "files" / "demo-1.0.tar.gz").write_bytes(content)
    (root / "simple" / "demo").mkdir(parents=True)
    fragment = f"#sha256={listed_hash}" if listed_hash else ""
    (root / "simple" / "demo" / "index.html").write_text(
        f'<html><body><a href="../../files/demo-1.0.tar.gz{fragment}">demo-1.0.tar.gz</a></body></html>'
    )
    return (root / "simple").as_uri()


def test_pip_settings_override_in_pips_order_and_an_empty_one_is_ignored() -> None:
    config = {
        "global.index-url": "https://global.example/simple",
        "download.index-url": "https://download.example/simple",
        "install.index-url": "https://install.example/simple",  # not a `pip download` setting
        "global.extra-index-url": "file:///a/simple file:///b/simple",
        ":env:.extra-index-url": "",
        "global.default-timeout": "30",
    }
    chosen = index_download.settings(config)
    assert index_download.index_urls(chosen) == [
        "https://download.example/simple",
        "file:///a/simple",
        "file:///b/simple",
    ]
    assert chosen["timeout"] == "30"
    env = {**config, ":env:.index-url": "https://env.example/simple", ":env:.extra-index-url": "file:///c/simple"}
    assert index_download.index_urls(index_download.settings(env)) == ["https://env.example/simple", "file:///c/simple"]


def test_pypi_is_the_index_where_none_is_set_and_no_index_asks_none() -> None:
    assert index_download.index_urls({}) == ["https://pypi.org/simple"]
    assert index_download.index_urls({"no-index": "yes", "extra-index-url": "file:///a"}) == []
    with pytest.raises(ValueError, match="no-index"):
        index_download.index_urls({"no-index": "maybe"})


def test_pips_own_configuration_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # pip then reads no config file: only these variables
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "file:///first/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://user:secret@second.example/simple file:///third/simple")
    chosen = index_download.settings(index_download.pip_config())
    assert index_download.index_urls(chosen) == [
        "file:///first/simple",
        "https://user:secret@second.example/simple",
        "file:///third/simple",
    ]


def test_html_and_json_listings_give_absolute_addresses_and_hashes() -> None:
    page = "https://index.example/simple/demo/"
    sdist, wheel = "demo-1.0.tar.gz", "demo-0.9-py3-none-any.whl"  # joined to hosts below: no file address written out
    html = (
        b'<html><head><base href="https://files.example/x/"></head><body>'
        b'<a href="demo-1.0.tar.gz#sha256=ab12">demo-1.0.tar.gz</a> <a href="../demo-0.9-py3-none-any.whl"></a>'
    )
    assert index_download.parse_listing(page, "text/html", html) == [
        index_download.IndexFile(sdist, f"https://files.example/x/{sdist}", "ab12"),
        index_download.IndexFile(wheel, f"https://files.example/{wheel}", None),
    ]
    listing = {"files": [{"filename": "demo-1.0.tar.gz", "url": "../../f/demo-1.0.tar.gz", "hashes": {"sha256": "cd"}}]}
    found = index_download.parse_listing(page, "application/vnd.pypi.simple.v1+json", json.dumps(listing).encode())
    assert found == [index_download.IndexFile(sdist, f"https://index.example/f/{sdist}", "cd")]


def test_the_file_comes_from_a_file_index_once(tmp_path: Path) -> None:
    index = file_index(tmp_path / "index")
    chosen = {"index-url": (tmp_path / "missing").as_uri(), "extra-index-url": index}  # the first has no demo
    dest = index_download.fetch("Demo", "demo-1.0.tar.gz", SHA256, tmp_path / "cache", chosen)
    assert dest.read_bytes() == CONTENT and sorted(p.name for p in dest.parent.iterdir()) == ["demo-1.0.tar.gz"]
    # downloaded once: with no index left, the file in the cache is kept
    assert index_download.fetch("demo", "demo-1.0.tar.gz", SHA256, tmp_path / "cache", {"no-index": "1"}) == dest


def test_a_file_of_another_hash_is_refused_listed_or_downloaded(tmp_path: Path) -> None:
    listed_other = file_index(tmp_path / "listed", listed_hash=OTHER)
    unlisted_other = file_index(tmp_path / "unlisted", listed_hash=None, content=b"tampered")
    chosen = {"index-url": listed_other, "extra-index-url": unlisted_other}
    with pytest.raises(LookupError) as error:
        index_download.fetch("demo", "demo-1.0.tar.gz", SHA256, tmp_path / "cache", chosen)
    assert f"listed with sha256 {OTHER}" in str(error.value)
    assert f"sha256 {hashlib.sha256(b'tampered').hexdigest()}" in str(error.value)
    assert list((tmp_path / "cache").iterdir()) == []  # neither the file nor its .part is left


def test_a_cached_file_of_another_hash_is_downloaded_again(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "demo-1.0.tar.gz").write_bytes(b"truncated")
    chosen = {"index-url": file_index(tmp_path / "index")}
    assert index_download.fetch("demo", "demo-1.0.tar.gz", SHA256, tmp_path / "cache", chosen).read_bytes() == CONTENT


class _Index(http.server.BaseHTTPRequestHandler):
    """An index answering PEP 691's JSON to a client that asks for it, and each request's headers, recorded."""

    seen: list[tuple[str, str | None, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append((self.path, self.headers.get("Accept"), self.headers.get("Authorization")))
        if self.path == "/simple/demo/" and "application/vnd.pypi.simple.v1+json" in self.headers.get("Accept", ""):
            listing = {"files": [{"filename": "demo-1.0.tar.gz", "url": "/f/demo-1.0.tar.gz", "hashes": {}}]}
            body, kind = json.dumps(listing).encode(), "application/vnd.pypi.simple.v1+json"
        elif self.path == "/f/demo-1.0.tar.gz":
            body, kind = CONTENT, "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_index() -> Iterator[str]:
    _Index.seen = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://user:p%40ss@127.0.0.1:{server.server_port}/simple"
    server.shutdown()
    server.server_close()


def test_a_json_index_over_http_gets_the_user_and_password_of_its_url(http_index: str, tmp_path: Path) -> None:
    dest = index_download.fetch("demo", "demo-1.0.tar.gz", SHA256, tmp_path, {"index-url": http_index})
    assert dest.read_bytes() == CONTENT
    credentials = "Basic " + base64.b64encode(b"user:p@ss").decode()
    assert [(path, auth) for path, _, auth in _Index.seen] == [
        ("/simple/demo/", credentials),
        ("/f/demo-1.0.tar.gz", credentials),
    ]
    assert _Index.seen[0][1] == index_download.ACCEPT  # the listing is asked for as JSON first


def test_main_downloads_through_pips_configured_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", file_index(tmp_path / "index"))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    assert index_download.main(["demo", "demo-1.0.tar.gz", SHA256, str(tmp_path / "cache")]) == 0
    assert (tmp_path / "cache" / "demo-1.0.tar.gz").read_bytes() == CONTENT
    assert index_download.main(["demo", "demo-2.0.tar.gz", SHA256, str(tmp_path / "cache")]) == 1
    assert index_download.main(["demo"]) == 2
