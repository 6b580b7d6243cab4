"""One pinned package file, found through the index pip is configured with: no registry file address in the repo.

``python scripts/index_download.py PROJECT FILENAME SHA256 DIR`` writes ``DIR/FILENAME``. It reads pip's own
configuration (``python -m pip config list``: the config files, ``PIP_CONFIG_FILE`` and the ``PIP_*`` variables, in
pip's order of precedence) for the indexes a ``pip download`` would ask: ``index-url`` (PyPI's simple index where none
is set) then each ``extra-index-url``, none under ``no-index``. It asks each for PROJECT through the Simple Repository
API (PEP 691's JSON, PEP 503's HTML where the index answers HTML; a ``file://`` index is read from its directories),
downloads the first file named FILENAME whose hash in the listing, if the listing gives one, is SHA256, and keeps it
only when its own sha256 is SHA256. A file already in DIR with that hash is kept: downloaded once.

``make vllm-own-tests`` fetches vLLM's release sdists with it: ``pip download`` of an sdist builds its metadata first,
which fails for vLLM's, so the file is asked of the index itself. User and password in an index's URL are sent to its
host; pip's ``cert`` and ``timeout`` are followed. Not followed: netrc, keyring, ``trusted-host``, client
certificates, ``find-links`` (a folder of files, not an index).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_source import sha256 as file_sha256  # noqa: E402 - the pinned-hash check of the wheel's extraction

PYPI_SIMPLE = "https://pypi.org/simple"
# PEP 691: the JSON form first, PEP 503's HTML where an index serves only that
ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
JSON_TYPE = "application/vnd.pypi.simple.v1+json"
# a setting's other names, as pip's options accept them in a config file or a PIP_* variable
ALIASES = {"pypi-url": "index-url", "default-timeout": "timeout"}
TRUE, FALSE = ("1", "true", "yes", "on", "y", "t"), ("0", "false", "no", "off", "n", "f")


@dataclass(frozen=True)
class IndexFile:
    """A file as an index lists it: its name, its absolute address, its sha256 where the listing gives one."""

    filename: str
    url: str
    sha256: str | None


def pip_config(python: str = sys.executable) -> dict[str, str]:
    """pip's configuration as ``pip config list`` shows it: ``section.key`` → value, the files and ``PIP_*`` merged."""
    listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    config = {}
    for line in listing.splitlines():
        key, equals, value = line.partition("=")
        if equals:
            config[key] = ast.literal_eval(value)  # pip writes each value as a Python literal (`%r`)
    return config


def settings(config: dict[str, str], command: str = "download") -> dict[str, str]:
    """The values a ``pip COMMAND`` runs with: ``[global]``, then ``[COMMAND]``, then the ``PIP_*`` variables
    (``:env:``), each overriding the one before; an empty value is ignored, as pip ignores it."""
    chosen: dict[str, str] = {}
    for section in ("global", command, ":env:"):
        for section_key, value in config.items():
            where, _, key = section_key.partition(".")
            if where == section and value:
                chosen[ALIASES.get(key, key)] = value
    return chosen


def index_urls(chosen: dict[str, str]) -> list[str]:
    """The indexes pip asks, in order: ``index-url`` (PyPI's where unset), then each ``extra-index-url``."""
    no_index = chosen.get("no-index", "false").lower()
    if no_index not in TRUE + FALSE:
        raise ValueError(f"pip's no-index is {no_index!r}: set it to true or false")
    if no_index in TRUE:
        return []
    return [chosen.get("index-url", PYPI_SIMPLE), *chosen.get("extra-index-url", "").split()]


def opener(chosen: dict[str, str], indexes: list[str]) -> urllib.request.OpenerDirector:
    """A URL opener with pip's ``cert`` and each index's user and password (sent to that index's host only)."""
    passwords = urllib.request.HTTPPasswordMgrWithPriorAuth()
    for index in indexes:
        parts = urllib.parse.urlsplit(index)
        if parts.username is not None:
            host = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}/"
            user, password = (urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or ""))
            passwords.add_password(None, host, user, password, is_authenticated=True)
    context = ssl.create_default_context(cafile=chosen.get("cert"))
    return urllib.request.build_opener(
        urllib.request.HTTPSHandler(context=context), urllib.request.HTTPBasicAuthHandler(passwords)
    )


def plain(url: str) -> str:
    """``url`` without its user and password: what is opened (the opener sends them) and what is shown."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def project_url(index: str, project: str) -> str:
    """The index's page of ``project`` (PEP 503: its name normalized, a trailing slash)."""
    normalized = re.sub(r"[-_.]+", "-", project).lower()
    return f"{plain(index).rstrip('/')}/{urllib.parse.quote(normalized)}/"


class _Anchors(HTMLParser):
    """The ``<a href>`` of a PEP 503 page with each anchor's text, and the page's ``<base href>``."""

    def __init__(self) -> None:
        super().__init__()
        self.base: str | None = None
        self.anchors: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "base" and self.base is None and values.get("href"):
            self.base = values["href"]
        elif tag == "a" and values.get("href"):
            self._href, self._text = values["href"], []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.anchors.append((self._href, "".join(self._text).strip()))
            self._href = None


def listed_file(page_url: str, href: str, filename: str | None, hashes: dict[str, str]) -> IndexFile:
    """One listed file: its address made absolute, its name (the address's last part where none is given)."""
    url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
    if fragment.startswith("sha256="):  # PEP 503 puts the hash in the fragment
        hashes = {"sha256": fragment.removeprefix("sha256="), **hashes}
    name = filename or urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    return IndexFile(name, url, hashes.get("sha256"))


def parse_listing(page_url: str, content_type: str, body: bytes) -> list[IndexFile]:
    """The files of a project page, from PEP 691's JSON or PEP 503's HTML (chosen by the answer's content type)."""
    if content_type.split(";")[0].strip() == JSON_TYPE:
        page = json.loads(body)
        return [listed_file(page_url, item["url"], item["filename"], item.get("hashes", {})) for item in page["files"]]
    anchors = _Anchors()
    anchors.feed(body.decode("utf-8", errors="replace"))
    base = urllib.parse.urljoin(page_url, anchors.base) if anchors.base else page_url
    return [listed_file(base, href, text or None, {}) for href, text in anchors.anchors]


def open_url(url: str, urls: urllib.request.OpenerDirector, timeout: float, accept: str = "*/*") -> IO[bytes]:
    """``url`` opened for reading; a ``file://`` folder is read as its ``index.html``, as pip reads a local index."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file" and os.path.isdir(urllib.request.url2pathname(parts.path)):
        url = urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/index.html"))
    return urls.open(urllib.request.Request(url, headers={"Accept": accept}), timeout=timeout)


def listing(index: str, project: str, urls: urllib.request.OpenerDirector, timeout: float) -> list[IndexFile]:
    """The files the index lists for ``project``."""
    page_url = project_url(index, project)
    with open_url(page_url, urls, timeout, ACCEPT) as answer:
        content_type = answer.headers.get("Content-Type", "") if answer.headers else ""
        return parse_listing(answer.geturl() or page_url, content_type, answer.read())


def download(url: str, dest: Path, sha256: str, urls: urllib.request.OpenerDirector, timeout: float) -> str:
    """``url`` into ``dest`` (through ``dest.part``) when its sha256 is ``sha256``; the sha256 found."""
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    with open_url(url, urls, timeout) as answer, part.open("wb") as stream:
        for block in iter(lambda: answer.read(1 << 20), b""):
            digest.update(block)
            stream.write(block)
    if digest.hexdigest() == sha256:
        part.replace(dest)
    else:
        part.unlink()
    return digest.hexdigest()


def fetch(project: str, filename: str, sha256: str, directory: Path, chosen: dict[str, str]) -> Path:
    """``directory/filename`` with the pinned ``sha256``: kept if there, else from the first index that has it.
    Raises ``LookupError`` naming each index asked and what it answered."""
    dest = directory / filename
    if dest.is_file() and file_sha256(dest) == sha256:
        return dest
    indexes = index_urls(chosen)
    urls, timeout = opener(chosen, indexes), float(chosen.get("timeout", 60))
    directory.mkdir(parents=True, exist_ok=True)
    answers = []
    for index in indexes:
        try:
            files = [item for item in listing(index, project, urls, timeout) if item.filename == filename]
            if not files:
                answers.append(f"{plain(index)}: no {filename} among {project}'s files")
            for item in files:
                if item.sha256 is not None and item.sha256.lower() != sha256:
                    answers.append(f"{plain(item.url)}: listed with sha256 {item.sha256}")
                    continue
                print(f"{filename}: from {plain(item.url)}", file=sys.stderr)
                found = download(item.url, dest, sha256, urls, timeout)
                if found == sha256:
                    return dest
                answers.append(f"{plain(item.url)}: sha256 {found}")
        except (OSError, ValueError) as error:  # urllib's errors are OSErrors: no such project, no answer
            answers.append(f"{plain(index)}: {error}")
    asked = "\n  ".join(answers) or "none: pip is configured with no-index"
    raise LookupError(f"no {filename} with sha256 {sha256} in pip's indexes; asked:\n  {asked}")


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: index_download.py PROJECT FILENAME SHA256 DIR", file=sys.stderr)
        return 2
    project, filename, sha256, directory = argv
    try:
        fetch(project, filename, sha256, Path(directory), settings(pip_config()))
    except (LookupError, ValueError) as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
