"""OpenAI's ``prediction`` (Predicted Outputs) on ``flyspec serve``: what may come beside it, and its tokens.

A request with a prediction is served as one without, with the prediction drafted beside the server's drafter
for that request (``drafters/prediction.py``): the text is the same under a lossless verifier, and the usage
adds OpenAI's ``completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens``.
What OpenAI's Predicted Outputs refuse beside a prediction (:data:`REFUSED_BESIDE_PREDICTION`) is a 400 naming
the field here too, so a client written for OpenAI meets the same rules; most of it flyspec refuses anyway.
A prediction longer than the context window leaves after the prompt is a 400 naming ``prediction``: no output
can reach its end.
"""

from __future__ import annotations

from typing import Any

from flyspec.server.errors import APIError, bad_request, shorten
from flyspec.server.schemas import Prediction, is_unused

# field → the values OpenAI's Predicted Outputs still take beside a prediction (penalties: any value up to 0)
REFUSED_BESIDE_PREDICTION: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "max_completion_tokens": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}
PENALTIES = ("presence_penalty", "frequency_penalty")  # refused beside a prediction when above 0


def check_beside_prediction(data: dict[str, Any]) -> None:
    """A 400 naming the first field of the request body ``data`` that may not come with its prediction."""
    if data.get("prediction") is None:
        return
    for name, value in data.items():
        if name in PENALTIES:
            refused = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        else:
            refused = name in REFUSED_BESIDE_PREDICTION and not is_unused(value, REFUSED_BESIDE_PREDICTION[name])
        if refused:
            instead = "; send max_tokens instead" if name == "max_completion_tokens" else ""
            raise bad_request(
                f"{name}={shorten(value)} cannot be used with prediction (OpenAI's Predicted Outputs refuse it "
                f"too); leave it out{instead}, or leave out the prediction",
                param=name,
                code="unsupported_parameter",
            )


def too_long(size: str, room: int, after_prompt: bool = True) -> APIError:
    """The 400 of a prediction of ``size`` that cannot fit in ``room`` tokens."""
    where = "the model's context window leaves after the prompt" if after_prompt else "fit in the context window"
    return bad_request(
        f"the prediction is {size} than {where} ({room} tokens): no output can reach its end; shorten it",
        param="prediction",
        code="context_length_exceeded",
    )


def prediction_ids(tokenizer: Any, prediction: Prediction, room: int) -> list[int]:
    """The prediction's token ids (the target's tokenizer, no special tokens added), at most ``room`` of them."""
    ids = list(tokenizer.encode(prediction.text, add_special_tokens=False))
    if len(ids) > room:
        raise too_long(f"{len(ids)} tokens, more", room)
    return ids
