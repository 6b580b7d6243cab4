"""Command-line options for speculation, shared by ``generate``, ``bench``, ``eval`` and ``serve``: the
``speculation`` and ``drafting`` groups, and the :class:`SpeculationConfig` they give (``--speculative-config``,
then the flags). The other shared groups (model, engine) are in ``options.py``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flyspec.config import NGRAM_MATCHES, PROTECT_CLASSES, ConfigError, SpeculationConfig
from flyspec.config.names import DRAFT_LENGTH_POLICIES, DRAFTERS, VERIFIER_SUMMARIES, VERIFIERS
from flyspec.config.rules import CASCADE_RULES, FLY_TEMPERATURE_RULES, FSD_DIVERGENCES

# Defaults are SpeculationConfig's (config/speculation.py); a flag left out keeps the --speculative-config value.
_DEFAULT = SpeculationConfig()


def add_speculation_options(parser: argparse.ArgumentParser, *, components: bool = True) -> None:
    """``--speculative-config`` and a flag per common setting (when ``components``, drafter and verifier too)."""
    spec = parser.add_argument_group("speculation")
    spec.add_argument(
        "--speculative-config",
        metavar="JSON",
        help="the whole speculation config as JSON: flyspec's field names (nested per component, e.g. "
        '{"fly": {"window_size": 4}}) or vLLM\'s speculative_config keys (method, model, num_speculative_tokens, '
        "prompt_lookup_max/min, rejection_sample_method, fly_window_size, fly_entropy_threshold, fly_entropy_top_k); "
        "the flags below override it",
    )
    spec.add_argument(
        "--profile",
        metavar="FILE",
        help="a calibration profile (profile.json from flyspec calibrate): the lossy settings come from its chosen "
        "point (with --verifier NAME, that rule's best point), and settings looser than it are refused; the "
        "model, tokenizer, dtype and drafter must be the profile's. auto (default): a lossy verifier left at its "
        "default settings runs at the profile flyspec ships for this packaged model, drafter and dtype, if any; "
        "none: the papers' default settings",
    )
    if components:
        spec.add_argument("--drafter", choices=DRAFTERS, help=f"draft source (default {_DEFAULT.drafter})")
        spec.add_argument(
            "--verifier",
            choices=VERIFIERS,
            help="acceptance rule (default "
            f"{_DEFAULT.verifier}): {'; '.join(f'{name} = {summary}' for name, summary in VERIFIER_SUMMARIES.items())}",
        )
    spec.add_argument(
        "-k",
        "--num-draft-tokens",
        type=int,
        help=f"draft tokens per target forward (default {_DEFAULT.num_draft_tokens})",
    )
    spec.add_argument(
        "--window-size", type=int, help=f"FLy deferred window; 0 disables it (default {_DEFAULT.fly.window_size})"
    )
    spec.add_argument(
        "--entropy-threshold",
        type=float,
        help="FLy entropy gate on the target's top-3 entropy; 0 disables it "
        f"(default {_DEFAULT.fly.entropy_threshold})",
    )
    spec.add_argument(
        "--fly-temperature-rule",
        choices=FLY_TEMPERATURE_RULES,
        help=f"FLy base rule at T>0 (default {_DEFAULT.fly.temperature_rule})",
    )
    spec.add_argument(
        "--margin-ratio",
        type=float,
        help=f"MARS: accept the runner-up when z2/z1 > this (default {_DEFAULT.margin.logit_ratio})",
    )
    spec.add_argument(
        "--protect",
        action="append",
        choices=(*PROTECT_CLASSES, "none"),
        help="lossy verifiers: token classes never loosely accepted (repeatable; replaces the default "
        f"{'+'.join(_DEFAULT.guard.protect)}): digits; names = identifiers inside code and names/identifiers of the "
        "prompt; identifiers = every word; none",
    )
    spec.add_argument(
        "--bare-rule",
        action="store_true",
        default=None,
        help="lossy verifiers: the paper's bare rule without flyspec's trust guards (top-3, protected tokens, "
        "loop and copy checks), for ablations; EOS and n-gram-cache tokens stay protected",
    )
    spec.add_argument(
        "--typical-epsilon", type=float, help=f"typical acceptance epsilon (default {_DEFAULT.typical.epsilon})"
    )
    spec.add_argument(
        "--typical-delta", type=float, help=f"typical acceptance delta (default {_DEFAULT.typical.delta})"
    )
    spec.add_argument(
        "--bild-rollback",
        type=float,
        help="BiLD: keep a mismatch while -log p_target(token) <= this, in nats "
        f"(default {_DEFAULT.bild.rollback_threshold})",
    )
    spec.add_argument(
        "--lenience",
        type=float,
        help="lenience: keep a draft token with probability min(1, p/(l*q)); greedy, one with p >= l * max p "
        f"(default {_DEFAULT.lenience.lenience}; 1 is lossless)",
    )
    spec.add_argument(
        "--fsd-divergence",
        choices=FSD_DIVERGENCES,
        help=f"FSD: js, kl (draft || target) or tv (default {_DEFAULT.fsd.divergence})",
    )
    spec.add_argument(
        "--fsd-threshold",
        type=float,
        help=f"FSD: keep a mismatch while the divergence is at most this (default {_DEFAULT.fsd.threshold})",
    )
    spec.add_argument(
        "--cascade-rule",
        choices=tuple(CASCADE_RULES),
        help="speculative cascades: the deferral rule, chow (max q < 1 - a), diff (max q < max p - a) or opt "
        f"(max q < max p - a * TV) (default {_DEFAULT.cascade.rule})",
    )
    spec.add_argument(
        "--cascade-lenience",
        type=float,
        help=f"speculative cascades: the rule's a; larger defers less (default {_DEFAULT.cascade.lenience})",
    )
    spec.add_argument(
        "--adasd-min-samples",
        type=int,
        metavar="N",
        help="AdaSD: exact until this generation has N accepted and N rejected positions to learn the threshold "
        f"from (default {_DEFAULT.adasd.min_samples})",
    )
    spec.add_argument(
        "--adasd-scale",
        type=float,
        help="AdaSD: the threshold's place between the mean JS distances of accepted (0) and rejected (2) tokens; "
        f"1 is the paper's midpoint, larger keeps more (default {_DEFAULT.adasd.scale})",
    )
    spec.add_argument(
        "--exact-first",
        type=int,
        metavar="N",
        help="lossy verifiers: verify the first N output tokens exactly, so a loose accept never decides how an "
        f"answer starts (a refusal, a first fact); 0: off (default {_DEFAULT.guard.exact_first})",
    )
    spec.add_argument("--max-ngram", type=int, help=f"longest n-gram to look up (default {_DEFAULT.ngram.max_ngram})")
    spec.add_argument("--min-ngram", type=int, help=f"shortest n-gram to look up (default {_DEFAULT.ngram.min_ngram})")
    spec.add_argument(
        "--ngram-match",
        choices=NGRAM_MATCHES,
        help="which earlier occurrence of the matched n-gram to copy from: the most recent, the earliest (vLLM's, "
        f"transformers' and the FLy reference's), or the continuation most share (default {_DEFAULT.ngram.match})",
    )
    spec.add_argument(
        "--num-proposal-tokens",
        "--num-ngram-tokens",
        dest="num_proposal_tokens",
        type=int,
        help=f"multilevel/stack: tokens a level checks per forward (default {_DEFAULT.num_proposal_tokens})",
    )
    add_drafter_options(parser)


def add_drafter_options(parser: argparse.ArgumentParser) -> None:
    """Options of the newer drafters: stacks, layer skipping, the n-gram cache, the draft-length policy."""
    drafting = parser.add_argument_group("drafters")
    drafting.add_argument(
        "--stack",
        help="--drafter stack: comma-separated levels, bottom first; each is ngram, ngram-cache (bottom only), "
        "layer-skip or a draft model (e.g. ngram,smollm2-135m-instruct)",
    )
    drafting.add_argument(
        "--skip-layers",
        help="layer-skip: comma-separated 0-based target layers to skip, or auto (default: calibrate on the "
        "first prompt)",
    )
    drafting.add_argument(
        "--ngram-cache-entries",
        type=int,
        help="ngram-cache: n-grams kept across generations, the least recently used evicted "
        f"(default {_DEFAULT.ngram_cache.max_entries})",
    )
    drafting.add_argument(
        "--draft-length",
        choices=DRAFT_LENGTH_POLICIES,
        help="how many tokens to draft each step, -k at most: cost (the length with the most expected tokens per "
        "second, from the target's forward cost t(n), measured once per machine and cached, and the acceptance so "
        "far), fixed (always -k), heuristic (+2 after a fully kept draft, -1 after a rejection), or auto (default: "
        "cost under a lossless verifier, for every drafter when greedy and for the n-gram drafters when sampling; "
        "else fixed, since a lossy output or a seeded model-drafter sample would depend on the machine's timings)",
    )
    drafting.add_argument(
        "--adaptive-draft",
        action="store_const",
        const="heuristic",
        dest="draft_length",
        help="same as --draft-length heuristic",
    )
    drafting.add_argument(
        "--min-draft-tokens",
        type=int,
        help=f"--draft-length heuristic/cost: shortest draft (default {_DEFAULT.draft_length.min_tokens}; FLy never "
        "goes below its window)",
    )
    drafting.add_argument(
        "--draft-confidence",
        type=float,
        help="model drafters: stop drafting once the draft model's top probability falls below this (default 0: off)",
    )


def speculation_config(args: argparse.Namespace) -> SpeculationConfig:
    """The :class:`SpeculationConfig` of the command line: ``--speculative-config``, then the flags given.

    Raises :class:`flyspec.config.ConfigError` for invalid values.
    """
    base = SpeculationConfig.from_dict(_json_object(args.speculative_config)) if args.speculative_config else _DEFAULT
    options = {name: getattr(args, name, None) for name in FLAG_NAMES}
    if options["stack"] is not None:
        options["stack"] = tuple(level.strip() for level in options["stack"].split(",") if level.strip())
    if options["skip_layers"] is not None:
        options["skip_layers"] = parse_skip_layers(options["skip_layers"])
    protect = getattr(args, "protect", None)
    if protect and "none" in protect:
        if len(set(protect)) > 1:
            raise ConfigError("--protect none cannot be combined with other classes")
        protect = []
    return base.with_options({**options, "protect": protect, "bare_rule": getattr(args, "bare_rule", None)})


# the flags that map one-to-one onto a SpeculationConfig field (config_mapping.FLAT_OPTIONS)
FLAG_NAMES = (
    "drafter",
    "verifier",
    "num_draft_tokens",
    "draft_model",
    "stack",
    "num_proposal_tokens",
    "window_size",
    "entropy_threshold",
    "fly_temperature_rule",
    "margin_ratio",
    "typical_epsilon",
    "typical_delta",
    "bild_rollback",
    "lenience",
    "fsd_divergence",
    "fsd_threshold",
    "cascade_rule",
    "cascade_lenience",
    "adasd_min_samples",
    "adasd_scale",
    "exact_first",
    "max_ngram",
    "min_ngram",
    "ngram_match",
    "ngram_cache_entries",
    "skip_layers",
    "draft_length",
    "min_draft_tokens",
    "draft_confidence",
    "profile",
)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"--speculative-config is not valid JSON ({error}); give an object like "
            '\'{"method": "ngram", "num_speculative_tokens": 8}\''
        ) from error
    if not isinstance(value, dict):
        raise ConfigError(f"--speculative-config must be a JSON object (got {type(value).__name__})")
    return value


def parse_skip_layers(text: str) -> tuple[int, ...] | None:
    """``auto`` → None (calibrate); ``"3,5,7"`` → (3, 5, 7)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise ConfigError(
            f"--skip-layers must be 'auto' or comma-separated layer indices like 4,6,8 (got {text!r})"
        ) from error
