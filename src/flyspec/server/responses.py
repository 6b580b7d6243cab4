"""Response bodies and stream chunks in the OpenAI formats, plus flyspec's additions.

Additions (extra fields, which OpenAI clients keep and ignore): ``usage`` carries
``num_target_forwards``, ``mean_acceptance_length``, ``num_loose_accepts`` and the drafter's own
counters for this request (``drafter``) beside the standard token counts (with a ``prediction``, also
OpenAI's ``completion_tokens_details``), and a top-level
``flyspec`` object says which drafter and verifier ran, whether that verifier is lossless, and
(``ignored_fields``) which of the request's vLLM extras were accepted because they change nothing.
Nothing in a response describes other requests: a drafter's process-wide statistics (the n-gram
cache's ``cache`` totals, a layer-skip calibration made on an earlier request's prompt) are left
out; the cache totals are in ``/metrics``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from flyspec.decoding.result import GenerationResult

Kind = Literal["completion", "chat"]
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
DONE = "data: [DONE]\n\n"


def new_request_id(kind: Kind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(result: GenerationResult, prediction: bool = False) -> dict[str, Any]:
    """Standard token counts plus the speculative decoding statistics of this request; with a ``prediction``,
    OpenAI's ``completion_tokens_details``: the prediction's draft tokens the output kept (accepted) and those the
    target scored and did not keep (rejected)."""
    stats = result.stats
    prompt_tokens, completion_tokens = len(result.prompt_token_ids), result.num_new_tokens
    details = {
        "accepted_prediction_tokens": stats.num_accepted_prediction_tokens,
        "rejected_prediction_tokens": stats.num_rejected_prediction_tokens,
    }
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        **({"completion_tokens_details": details} if prediction else {}),
        "num_target_forwards": stats.num_target_forwards,
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "num_loose_accepts": stats.num_loose_accepts,
        "mean_requested_draft_length": round(stats.mean_requested_draft_length, 4),
        "drafter": this_request_only(stats.drafter),  # draft forwards, n-gram cache hits, skipped layers
        # set when the request's sampling is outside the profile's measured range: verified exactly (lossless)
        "exact_outside_sampling_range": stats.exact_outside_sampling_range,
        # set when the request's prediction is outside what the profile measured (no predicted work): verified exactly
        **({"exact_with_prediction": stats.exact_with_prediction} if prediction else {}),
    }


def this_request_only(report: dict[str, Any]) -> dict[str, Any]:
    """A drafter report without what describes other requests, at any depth of a stack.

    Dropped: ``cache`` (NgramCacheDrafter: the whole cache's statistics) and a reused
    ``calibration`` (LayerSkipDrafter: estimates measured on the prompt of the request that calibrated).
    """
    kept = {}
    for key, value in report.items():
        if key == "cache" or (key == "calibration" and isinstance(value, dict) and value.get("reused")):
            continue
        kept[key] = this_request_only(value) if isinstance(value, dict) else value
    return kept


# Characters that JSON leaves raw inside a string but that Python's str.splitlines() ends a line at: httpx's
# ``iter_lines`` (which OpenAI-style clients read streams with) splits there, cutting an event's JSON in two. Escaped,
# the event stays one line; a JSON parser reads the same text back.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object, on one line for any line splitter (:data:`_LINE_BREAKS`)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)  # NaN is not JSON
    return f"data: {text.translate(_LINE_BREAKS)}\n\n"


@dataclass
class ResponseBuilder:
    """Builds every body and chunk of one response, so they share its id, model and ``created`` time."""

    kind: Kind
    model: str
    flyspec: dict[str, Any]
    include_usage: bool = False
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    prediction: bool = False  # the request had a prediction: its usage has completion_tokens_details

    def __post_init__(self) -> None:
        self.request_id = self.request_id or new_request_id(self.kind)

    def body(self, result: GenerationResult) -> dict[str, Any]:
        """The non-streamed response."""
        finish_reason = FINISH_REASONS.get(result.finish_reason, "stop")
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason}
        return {
            **self._envelope("chat.completion" if self.kind == "chat" else "text_completion"),
            "choices": [choice],
            "usage": usage(result, self.prediction),
            "flyspec": self.flyspec,
        }

    def first_chunks(self) -> list[str]:
        """Chunks before any text: chat streams open with the assistant role."""
        if self.kind != "chat":
            return []
        return [self._chunk({"role": "assistant", "content": ""}, None, flyspec=True)]

    def piece_chunk(self, text: str) -> str:
        return self._chunk({"content": text} if self.kind == "chat" else text, None)

    def last_chunks(self, result: GenerationResult) -> list[str]:
        """The chunk with ``finish_reason``, the usage chunk when asked for, and ``[DONE]``."""
        finish_reason = FINISH_REASONS.get(result.finish_reason, "stop")
        chunks = [self._chunk({} if self.kind == "chat" else "", finish_reason, flyspec=True)]
        if self.include_usage:
            chunks.append(sse({**self._chunk_envelope(), "choices": [], "usage": usage(result, self.prediction)}))
        return [*chunks, DONE]

    def headers(self) -> dict[str, str]:
        headers = {
            "x-request-id": self.request_id,
            "x-flyspec-verifier": str(self.flyspec["verifier"]),
            "x-flyspec-lossless": "true" if self.flyspec["lossless"] else "false",
        }
        if self.flyspec.get("ignored_fields"):  # request fields accepted because their values change nothing
            headers["x-flyspec-ignored-fields"] = ", ".join(self.flyspec["ignored_fields"])
        return headers

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def _chunk_envelope(self) -> dict[str, Any]:
        envelope = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        if self.include_usage:
            envelope["usage"] = None  # as OpenAI: null on every chunk but the last
        return envelope

    def _chunk(self, content: Any, finish_reason: str | None, *, flyspec: bool = False) -> str:
        if self.kind == "chat":
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._chunk_envelope(), "choices": [choice]}
        if flyspec:
            chunk["flyspec"] = self.flyspec
        return sse(chunk)
