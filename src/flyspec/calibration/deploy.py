"""What a calibration writes into its profile about running the chosen point: how to deploy it (``deploy``:
flyspec's engine, the vLLM plugin, vLLM 0.33's native FLy) and the circuit breaker that guards it."""

from __future__ import annotations

from typing import Any

from flyspec.config import BreakerConfig, SpeculationConfig
from flyspec.harness.vllm_worker import schedule_environment, speculative_config


def deployment(record: dict[str, Any]) -> dict[str, Any]:
    """How to deploy a profile's chosen point (``profile.json``'s ``deploy``): on flyspec's engine, with the vLLM
    plugin, and, where the point is FLy's bare rule (no trust guards, no draft-probability floor), as the native
    ``speculative_config`` of vLLM 0.33+ (pull request #53987)."""
    chosen = record.get("chosen")
    spec = SpeculationConfig.from_dict(chosen["speculation"]) if chosen else None
    engine = str((record.get("engine") or {}).get("name", "flyspec"))
    schedule = (record.get("schedule") or {}).get("num_speculative_tokens_per_batch_size")  # config/schedule.py
    num_draft_tokens = spec.num_draft_tokens if spec else SpeculationConfig().num_draft_tokens
    plugin_config = speculative_config("vllm-ngram+fly", num_draft_tokens, schedule)  # the plugin's proposer
    out: dict[str, Any] = {
        "measured_on": engine,
        "flyspec": "flyspec serve --profile PROFILE (or --profile PROFILE for generate, bench, eval)",
        "vllm_plugin": {
            # the schedule travels in the environment: vLLM 0.33 drops num_speculative_tokens_per_batch_size for
            # custom_class (the plugin's proposer), 0.32 and 0.33 both keep the environment
            "environment": {
                "FLYSPEC_VLLM_PROFILE": "PROFILE",
                "FLYSPEC_VLLM_FLY": "all",
                **schedule_environment("vllm-ngram+fly", schedule),
            },
            "speculative_config": plugin_config,
            "note": "the plugin applies the profile's FLy point (the chosen point where that is FLy) with its trust "
            "guards to every greedy request (V1 model runner: vLLM runs custom_class proposers there); another "
            "chosen rule runs per request (flyspec_rule); flyspec serve --engine vllm --profile PROFILE sets this up",
        },
        "vllm_native": None,
    }
    if spec is None:
        out["vllm_plugin"]["note"] = "no lossy point was chosen: serve without loose acceptance (lossless)"
        return out
    native = spec.guard.is_bare and spec.guard.exact_first == 0  # vLLM's own rule has neither guards nor exact-first
    if spec.verifier == "fly" and native and spec.fly.min_draft_prob == 0 and spec.drafter == "ngram":
        same = spec.fly.variant == "vllm"
        out["vllm_native"] = {
            "label": "no trust guards",
            "same_rule": same,
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": spec.num_draft_tokens,
                "prompt_lookup_max": spec.ngram.max_ngram,
                "prompt_lookup_min": spec.ngram.min_ngram,
                "rejection_sample_method": "fly",
                "fly_window_size": spec.fly.window_size,
                "fly_entropy_threshold": spec.fly.entropy_threshold,
                "fly_entropy_top_k": spec.fly.entropy_top_k,
                **({"num_speculative_tokens_per_batch_size": schedule} if schedule else {}),
            },
            "note": (
                "the calibrated rule itself (vLLM 0.33's native FLy)"
                if same
                else "vLLM's window checks one more draft token than flyspec's at the same fly_window_size: it keeps "
                "no more than the calibrated point"
            )
            + "; vLLM's n-gram proposer drafts from its own lookup, not flyspec's (the drafts may differ); with the "
            "flyspec-vllm plugin installed its trust guards veto on either model runner, without it nothing does",
        }
    return out


def breaker_for(summary: dict[str, Any], factor: float = 3.0) -> BreakerConfig:
    """The breaker of a chosen point: trip above ``factor`` × its calibrated loose accepts per 100 tokens,
    or the 99th percentile of its prompts' own rates, whichever is higher (off for a lossless point)."""
    if summary["lossless"] or not summary["loose_per_100_tokens"]:
        return BreakerConfig()
    limit = max(factor * summary["loose_per_100_tokens"], summary.get("loose_per_100_p99") or 0.0)
    return BreakerConfig(max_loose_per_100=round(limit, 2))
