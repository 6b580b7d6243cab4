"""``flyspec export --hf DIR``: the complete Hugging Face directory of a model, for engines started by hand.

vLLM loads a Hugging Face directory, not a GGUF file; flyspec converts a packaged model or a ``.gguf`` file once
into its cache (``runtime/loading.py``). This copies that conversion to a directory the user names, so that a
deployment points at a path it owns instead of a hashed cache entry (DEPLOYMENT.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flyspec.cli.options import add_target_option
from flyspec.config.names import DEFAULT_MODEL


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export",
        help="write a model's complete Hugging Face directory (for vLLM started by hand)",
        description="Write the complete Hugging Face model directory (config with its architecture, safetensors "
        "weights in float32, tokenizer, generation config) of a packaged model, a .gguf file or a local directory "
        "to DIR: what vLLM's --model and transformers' from_pretrained load as it is.",
    )
    add_target_option(parser, f"packaged name, .gguf file or local HF directory (default {DEFAULT_MODEL})")
    parser.add_argument("--hf", required=True, metavar="DIR", help="where to write it: a new or empty directory")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from flyspec.cli.options import quiet_transformers

    quiet_transformers()
    from flyspec.runtime.loading import export_hf_dir  # torch and transformers: only when it runs

    out = export_hf_dir(args.target, Path(args.hf))
    size = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    print(f"{args.target}: Hugging Face directory written to {out} ({size / 2**20:.0f} MiB)", file=sys.stderr)
    print(out)
    return 0
