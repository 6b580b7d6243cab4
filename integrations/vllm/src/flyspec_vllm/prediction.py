"""OpenAI's ``prediction`` (Predicted Outputs) inside vLLM's batch: a request's prediction as its drafts.

A request whose sampling parameters carry ``extra_args["flyspec_prediction"]`` (the prediction's token ids, put there
by the API server, ``prediction_api.py``, or by an offline caller of ``LLM.generate``) is drafted by the plugin's
proposer (``proposer.py``) from its prediction alone: the prediction's next tokens where the output follows it, and
none where it does not. The alignment is flyspec's own (``flyspec.drafters.prediction.follow``): the committed
output compared with the prediction from its cursor on, re-anchored after a divergence (the output's last tokens
found again in the prediction), so an insertion or a deletion costs a step, not the rest of the prediction. Rows
without a prediction keep the n-gram proposer exactly as before. Whatever the prediction drafts vLLM verifies as any
draft (its lossless rule: the text is the one the request gets without a prediction, token for token at T = 0).

Because such a request drafts from its prediction only, vLLM's per-request speculative counts are its prediction
counts: accepted prediction tokens = the draft tokens vLLM kept, rejected = those it scored and did not keep
(OpenAI's ``usage.completion_tokens_details``, filled in by ``prediction_api.py``). vLLM keeps those counts per
request only when asked (``--per-request-spec-decode-metrics``); :func:`wrap_add_request` asks for them for the
requests with a prediction alone, so every other request is served as without the plugin.

Per-request state (the prediction's ids, the prompt length, the alignment) lives in :data:`PREDICTIONS`, keyed by
request id and dropped when the request leaves the batch. The V1 step hook (``patch._before_v1_step``) publishes,
for the proposer that runs right after it, which batch rows carry a prediction (:meth:`Predictions.gather`); a
fault there leaves the step without drafts (plain decoding, lossless), one error line and a count.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flyspec_vllm import failsafe
from flyspec_vllm._flyspec import Alignment, aligned_tokens, follow

logger = logging.getLogger(__name__)
PREDICTION_KEY = "flyspec_prediction"  # extra_args: the prediction's token ids


def prediction_of(params: Any) -> list[int] | None:
    """The prediction's token ids a request's sampling parameters carry, or None."""
    extra_args = getattr(params, "extra_args", None)
    if not extra_args or extra_args.get(PREDICTION_KEY) is None:
        return None
    return list(extra_args[PREDICTION_KEY])


def check_prediction_ids(value: Any) -> str | None:
    """Why ``extra_args["flyspec_prediction"]`` is refused (a message), or None: a list of token ids (ints >= 0)."""
    if not isinstance(value, list | tuple) or not all(
        isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in value
    ):
        return "must be a list of token ids (integers >= 0): the prediction, tokenized by the served model's tokenizer"
    return None


@dataclass
class RequestPrediction:
    """One request's prediction and where its output stands in it."""

    ids: np.ndarray  # [prediction length] int64
    prompt_length: int
    alignment: Alignment

    def draft(self, row: np.ndarray, num_tokens: int, limit: int) -> list[int]:
        """Up to ``limit`` draft tokens from the prediction, after following the output committed so far
        (``row[prompt_length:num_tokens]``: vLLM's token table row of this request)."""
        self.alignment, _ = follow(self.ids, row[self.prompt_length : num_tokens], self.alignment)
        return [int(token) for token in aligned_tokens(self.ids, self.alignment, limit)]


class Predictions:
    """The requests with a prediction, by request id, and this step's batch rows that carry one."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestPrediction] = {}
        self.rows: dict[int, RequestPrediction] | None = {}  # None: unknown this step (a fault): no drafts at all

    def gather(self, runner: Any) -> None:
        """This step's rows with a prediction (V1: ``runner.input_batch`` order, which the proposer's follows);
        the state of requests no longer in the batch is dropped. Never raises: a fault sets :attr:`rows` to None."""
        try:
            batch = runner.input_batch
            rows: dict[int, RequestPrediction] = {}
            live = list(batch.req_ids)
            for index, req_id in enumerate(live):
                state = self.requests.get(req_id)
                if state is None:
                    ids = prediction_of(runner.requests[req_id].sampling_params)
                    if ids is None:
                        continue
                    prompt_length = int(batch.num_prompt_tokens[index])
                    state = RequestPrediction(np.asarray(ids, dtype=np.int64), prompt_length, Alignment.start(len(ids)))
                    self.requests[req_id] = state
                rows[index] = state
            self.forget(live)
            self.rows = rows
        except Exception as error:  # noqa: BLE001 - fail closed: no drafts this step (plain decoding)
            failsafe.fault(
                "the prediction rows", error, lambda: runner.input_batch.req_ids, "dropped (plain decoding, lossless)"
            )
            self.rows = None

    def take(self) -> dict[int, RequestPrediction] | None:
        """This step's rows (for the proposer, once: a fault costs only its own step)."""
        rows, self.rows = self.rows, {}
        return rows

    def forget(self, live: Sequence[str]) -> None:
        alive = set(live)
        for stale in [req_id for req_id in self.requests if req_id not in alive]:
            del self.requests[stale]


PREDICTIONS = Predictions()  # this process's requests with a prediction (one engine per worker process)


def wrap_add_request(original: Callable[..., Any], metrics_class: Any) -> Callable[..., Any]:
    """``Scheduler.add_request``: a new request with a prediction gets vLLM's per-request speculative counts
    (``RequestSpecDecodeMetrics``, what ``--per-request-spec-decode-metrics summary`` gives every request), which
    vLLM's OpenAI server then returns with its response; the others are left as vLLM made them."""

    @functools.wraps(original)
    def add_request(self: Any, request: Any) -> Any:
        result = original(self, request)
        try:
            if (
                getattr(request, "spec_decode_metrics", "absent") is None
                and self.requests.get(request.request_id) is request
                and prediction_of(request.sampling_params) is not None
            ):
                request.spec_decode_metrics = metrics_class.new(int(self.num_spec_tokens))
        except Exception as error:  # noqa: BLE001 - only the usage counts are lost; the request is served
            failsafe.warning("request %s: no per-request speculative counts (%s)", request.request_id, error)
        return result

    return add_request
