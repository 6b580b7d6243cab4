"""Request bodies of the OpenAI-compatible endpoints (pydantic; the only pydantic in flyspec).

Validation is strict (no string-to-number coercion) and unknown fields are rejected, as the
OpenAI API does. Standard fields that flyspec cannot honour are listed in
:data:`UNSUPPORTED_FIELDS`: sending them with a non-default value is a 400 naming the field,
never a silent ignore. Harmless bookkeeping fields (``user``, ``metadata``, ``store``,
``service_tier``, ``parallel_tool_calls``) are accepted and ignored. vLLM's sampling extras
(:data:`VLLM_EXTRAS`, which clients such as lm-eval's ``local-completions`` send) are accepted
when their value changes nothing (``min_p: 0``, ``repetition_penalty: 1``) and listed in the
response's ``flyspec.ignored_fields`` and ``x-flyspec-ignored-fields`` header; any other value is a
400 naming the field. ``top_k: -1`` is vLLM's "off", as 0. Numbers must be finite
(NaN and Infinity are refused everywhere; :func:`flyspec.server.errors.parse_json_object` refuses
them before validation too). A temperature below :data:`GREEDY_BELOW` is greedy, as in vLLM.
OpenAI's ``prediction`` (Predicted Outputs, :class:`Prediction`) is honoured on both endpoints; what OpenAI refuses
beside it is refused in :mod:`flyspec.server.prediction`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from flyspec.config import PROTECT_CLASSES
from flyspec.config.names import DRAFT_LENGTH_POLICIES
from flyspec.config.rules import CASCADE_RULES, FLY_TEMPERATURE_RULES, FSD_DIVERGENCES
from flyspec.drafters.registry import DRAFTERS
from flyspec.server.errors import shorten
from flyspec.verifiers.registry import VERIFIERS

MAX_DRAFT_TOKENS = 64
# OpenAI allows 4; vLLM any number, and lm-eval's tasks send more (their stop words plus EOS). Each
# committed step checks every stop string, so a cap keeps a request from making that step slow.
MAX_STOP_STRINGS = 64
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts
# vLLM's _SAMPLING_EPS: below it, logits / temperature overflows float32 (inf - inf = NaN) long
# before the distribution differs from the greedy one, so such a temperature means greedy.
GREEDY_BELOW = 1e-5
# top_p below the smallest top-token probability (>= 1/vocab) keeps only the top token, as this
# floor does for any vocabulary up to a million tokens; a smaller top_p underflows in float32.
TOP_P_FLOOR = 1e-6

# field → the values that mean "not used" (accepted and dropped); anything else is a 400.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# vLLM's sampling parameters beyond OpenAI's → the values that change nothing (vLLM's defaults, or
# what flyspec does anyway: special tokens are skipped, a stop string is left out of the text).
VLLM_EXTRAS: dict[str, tuple[Any, ...]] = {
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "length_penalty": (None, 1),
    "use_beam_search": (None, False),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "return_tokens_as_token_ids": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
}


def is_unused(value: Any, unused_values: tuple[Any, ...]) -> bool:
    """``value`` equals one of the values that mean "not used" (``True`` is not ``1`` here)."""
    return any(isinstance(value, bool) == isinstance(unused, bool) and value == unused for unused in unused_values)


PositiveTokens = Annotated[int, Field(ge=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SpeculativeOptions(_Strict):
    """Per-request speculative settings (extra body field ``speculative``); omitted = server default."""

    verifier: Literal[VERIFIERS] | None = None  # type: ignore[valid-type]
    drafter: Literal[DRAFTERS] | None = None  # type: ignore[valid-type]
    num_draft_tokens: Annotated[int, Field(ge=1, le=MAX_DRAFT_TOKENS)] | None = None
    window_size: Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | None = None
    entropy_threshold: Annotated[float, Field(ge=0)] | None = None
    fly_temperature_rule: Literal[FLY_TEMPERATURE_RULES] | None = None  # type: ignore[valid-type]
    margin_ratio: Annotated[float, Field(gt=0, lt=1)] | None = None
    typical_epsilon: Annotated[float, Field(gt=0, le=1)] | None = None
    typical_delta: Annotated[float, Field(gt=0, le=1)] | None = None
    bild_rollback: Annotated[float, Field(gt=0)] | None = None
    lenience: Annotated[float, Field(gt=0, le=1)] | None = None
    fsd_divergence: Literal[FSD_DIVERGENCES] | None = None  # type: ignore[valid-type]
    fsd_threshold: Annotated[float, Field(ge=0)] | None = None
    cascade_rule: Literal[tuple(CASCADE_RULES)] | None = None  # type: ignore[valid-type]
    cascade_lenience: float | None = None
    adasd_min_samples: Annotated[int, Field(ge=1)] | None = None
    adasd_scale: float | None = None
    exact_first: Annotated[int, Field(ge=0)] | None = None
    protect: list[Literal[PROTECT_CLASSES]] | None = None  # type: ignore[valid-type]
    bare_rule: bool | None = None  # the paper's rule without flyspec's trust guards (true), or with them (false)
    draft_length: Literal[DRAFT_LENGTH_POLICIES] | None = None  # type: ignore[valid-type]
    adaptive_draft: bool | None = None  # older spelling: true = draft_length "heuristic", false = "fixed"


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Prediction(_Strict):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": text or text parts}``, what the output is
    expected to be mostly (the file before an edit). Its tokens are drafted where they line up with the output
    (``drafters/prediction.py``); the usage counts the accepted and rejected ones."""

    type: Literal["content"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f'a prediction\'s content parts must be text parts ({{"type": "text", "text": ...}}), '
                        f"got type {shorten(kind)}"
                    )
        return content

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class _GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # omitted = the served model
    max_tokens: PositiveTokens | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0  # the OpenAI default
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # extension (as vLLM): 0 or -1 = off
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    prediction: Prediction | None = None  # OpenAI's Predicted Outputs
    _ignored_fields: list[str] = PrivateAttr(default_factory=list)  # VLLM_EXTRAS sent with values that change nothing

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, temperature: float) -> float:
        return 0.0 if temperature < GREEDY_BELOW else temperature

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, top_k: int) -> int:
        return max(top_k, 0)  # vLLM's -1 and flyspec's 0 both mean no top-k filter

    @field_validator("top_p")
    @classmethod
    def _floor_top_p(cls, top_p: float) -> float:
        return max(top_p, TOP_P_FLOOR)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(strings)})")
        if not all(strings):
            raise ValueError("stop strings must be non-empty")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def ignored_fields(self) -> list[str]:
        return list(self._ignored_fields)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: raw text (no chat template), or one prompt as token ids.

    As in the OpenAI API a prompt may be a list of prompts (strings, or token-id lists as lm-eval's
    ``local-completions`` sends); flyspec answers one per request, so such a list must hold one.
    """

    prompt: str | TokenIds | list[str] | list[TokenIds]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request is supported (got {len(prompt)}); send them separately")
            prompt = prompt[0]
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            raise ValueError("the prompt is empty; give some text to continue")
        return prompt  # type: ignore[return-value]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def as_template_message(self) -> dict[str, str]:
        """``{role, content}`` for the chat template; ``developer`` is the newer name of ``system``."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveTokens | None = None  # the newer name of max_tokens

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
