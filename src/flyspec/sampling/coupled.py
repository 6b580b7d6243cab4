"""Coupled sampling: a sampled token's noise is a function of (seed, position) alone, so a seed names a text.

Gumbel-max (Gumbel 1954; Maddison et al. 2014): with ``G_v`` i.i.d. Gumbel(0, 1), ``argmax_v (z_v / T + G_v)`` over
the tokens top-k / top-p keep is an exact sample of ``softmax(z / T)`` restricted to them. flyspec draws the
``G`` of absolute position ``j`` (the token's index in prompt + output) from a generator seeded by a hash of
(the generation's key, ``j``), and nothing else. So:

- plain sampling and speculative decoding that checks each draft token against the target's own sample there
  (``exact``, and every rule's strict base at T > 0) commit the same token at every position — the target's
  logits there are the same in float32 whatever the batch shape of the forward that computed them — whatever
  the drafter, the draft length or the step boundaries: **the same seed gives the same text with or without
  drafts**;
- a draft model of the target's tokenizer that draws its drafts with the same noise (its own logits, the same
  ``G``) proposes the target's sample wherever the two distributions are close, which keeps acceptance high
  (the Gumbel coupling: ``P(same) ≥ (1 − TV) / (1 + TV)``);
- every other draw a rule makes (rejection sampling's uniform and residual token, lenience's extra chance, the
  reference FLy's second sample) comes from a *stream* of its own keyed by the same position: independent of
  the token noise, and again a function of (key, position), so a replay of the same path draws the same numbers
  (``calibration/replay.py`` replays sampled generations as it does greedy ones).

Rejection sampling with a draft model's sampled drafts (``draft_probs``) accepts more than exact match against
the coupled sample (``1 − TV`` against the coupling's), so ``rejection`` keeps it there: its text is a function of
the seed and the drafter, not plain sampling's text. Block verification decides on later positions' uniforms, so a
position-keyed draw would be reused after it was looked at: it draws from the generation's ``torch.Generator``.

Devices: the noise is drawn on the target's device; the same seed gives other texts on other devices (their
generators differ), as torch's own sampling does. A vocabulary-wide row is drawn in blocks of :data:`BLOCK` columns,
each from its own seed, so that a row of any width above ``BLOCK / 2`` is a prefix of a wider one (a draft model's
vocabulary may be padded otherwise than the target's); a narrower row (a toy vocabulary, a uniform) is one block of
the next power of two.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from flyspec.config import SamplingConfig
from flyspec.sampling.sampler import filtered_logits

BLOCK = 1 << 14  # columns drawn per seeded generator: rows of every width share their first columns
SMALL = 64  # the fewest columns drawn for a row (a uniform's)
KEPT_ROWS = 64  # noise rows remembered per generation (a step asks the same positions of the drafter and target)
_MASK64 = (1 << 64) - 1
COUPLED_SAMPLING = 1  # the scheme's version: a change to how noise is drawn changes every sampled text (cache keys)

# Streams: independent noises at one position. TOKEN is the target's (and a same-tokenizer drafter's) sample.
TOKEN = 0
ACCEPT = 1  # rejection sampling's uniform u_j
RESIDUAL = 2  # the token drawn from the residual after a rejection (or the bonus token)
LENIENCE = 3  # lenience's extra chance after a rejection
SECOND = 4  # the reference FLy rule's second target sample
TRANSLATED = 5  # a drafter of another tokenizer: its own positions, its own noise


def mix(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64's finaliser over each in turn): the seed of one generator."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 29
    return state


def block_size(width: int) -> int:
    """Columns per seeded block for a row of ``width``: :data:`BLOCK` for a vocabulary, else the next power of two
    (at least :data:`SMALL`), so a toy vocabulary or a uniform does not draw a vocabulary's worth."""
    if width > BLOCK // 2:
        return BLOCK
    return max(SMALL, 1 << (width - 1).bit_length())


RowKey = tuple[int, int, int, int]  # (key, stream, position, block size)


@dataclass
class NoiseRows:
    """Drawn noise rows, by (key, stream, position, block size): a pure function of them, so any generation of the
    same key may read a row another drew. A generation keeps its own, the last ``limit``; a caller that runs many
    generations of one seed over the same positions (a calibration's points, ``calibration/runner.py``) shares one
    (``Decoder.noise_rows``) and clears it when its seed changes (``limit=None``: until then, all)."""

    limit: int | None = KEPT_ROWS
    _rows: OrderedDict[RowKey, torch.Tensor] = field(default_factory=OrderedDict, repr=False)

    def get(self, key: RowKey, width: int) -> torch.Tensor | None:
        row = self._rows.get(key)
        if row is None or row.shape[0] < width:
            return None
        self._rows.move_to_end(key)
        return row

    def put(self, key: RowKey, row: torch.Tensor) -> None:
        self._rows[key] = row
        while self.limit is not None and len(self._rows) > self.limit:
            self._rows.popitem(last=False)

    def clear(self) -> None:
        self._rows.clear()


@dataclass
class CoupledNoise:
    """One generation's noise: Gumbel(0, 1) rows keyed by (``key``, stream, absolute position), drawn on ``device``.

    Rows are remembered (:class:`NoiseRows`), since a step asks the drafter's and the target's positions alike; a
    forgotten row is drawn again, identically.
    """

    key: int
    device: torch.device
    num_rows_drawn: int = 0  # rows drawn (a remembered row is not drawn again): what a step's sampling cost
    rows: NoiseRows = field(default_factory=NoiseRows, repr=False)

    @classmethod
    def draw(
        cls, generator: torch.Generator | None, device: torch.device | str, rows: NoiseRows | None = None
    ) -> CoupledNoise:
        """The generation's key: one draw from ``generator`` (torch's default one when None), so a generator made
        with a seed names one text, and one reused across generations gives each a new one. ``rows``: a store
        shared with other generations (default: its own)."""
        source = generator.device if generator is not None else torch.device(device)
        key = int(torch.randint(0, 1 << 62, (1,), generator=generator, device=source))
        return cls(key, torch.device(device), rows=rows if rows is not None else NoiseRows())

    def derived(self, stream: int) -> CoupledNoise:
        """Noise of another key, for a drafter whose positions are not the target's (another tokenizer)."""
        return CoupledNoise(mix(self.key, stream), self.device, rows=self.rows)

    def gumbel(self, position: int, width: int, stream: int = TOKEN) -> torch.Tensor:
        """``[width]`` i.i.d. Gumbel(0, 1) draws of ``position`` in ``stream``."""
        size = block_size(width)
        key = (self.key, stream, position, size)
        row = self.rows.get(key, width)
        if row is None:
            blocks = [
                self._block(mix(self.key, stream, position, size, block), size) for block in range(-(-width // size))
            ]
            row = torch.cat(blocks)[:width] if len(blocks) > 1 else blocks[0][:width]
            self.num_rows_drawn += 1
            self.rows.put(key, row)
        return row[:width]

    def _block(self, seed: int, size: int) -> torch.Tensor:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        # G = -log(-log U), U uniform on [0, 1): never +inf (U < 1), -inf only where U = 0 (never chosen, no NaN)
        return torch.rand(size, generator=generator, device=self.device).log_().neg_().log_().neg_()

    def uniform(self, position: int, stream: int) -> torch.Tensor:
        """``[]``: a uniform [0, 1) draw of ``position`` in ``stream`` (``U = exp(-exp(-G))`` back from its G)."""
        return torch.exp(-torch.exp(-self.gumbel(position, 1, stream)[0]))


@dataclass(frozen=True)
class Draws:
    """The random numbers of one step at T > 0: the coupled noise from ``position`` on (row ``i`` of a step's
    logits is position ``position + i``), and the generation's ``generator`` for the draws that must be fresh at
    every step (block verification's). Greedy decoding has none (``None`` wherever a ``Draws`` is taken)."""

    noise: CoupledNoise
    position: int  # the absolute position of the step's first draft token
    generator: torch.Generator | None = None

    @classmethod
    def seeded(cls, seed: int, position: int = 0, device: torch.device | str = "cpu") -> Draws:
        """A step's draws for a verifier or drafter called by hand: the noise a generation seeded with ``seed`` on
        ``device`` samples with, seen from ``position`` (what ``decoder.generate(generator=make_generator(seed))``
        passes to its first step after a prompt of ``position`` tokens)."""
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        return cls(CoupledNoise.draw(generator, device), position, generator)

    def at(self, position: int) -> Draws:
        """The same draws, seen from another absolute position (a drafter's own sequence)."""
        return Draws(self.noise, position, self.generator)

    def gumbel(self, rows: int, width: int, stream: int = TOKEN) -> torch.Tensor:
        """``[rows, width]``: the Gumbel noise of positions ``position .. position + rows - 1``."""
        if rows == 0:
            return torch.empty(0, width, device=self.noise.device)
        return torch.stack([self.noise.gumbel(self.position + i, width, stream) for i in range(rows)])

    def choose(self, logits: torch.Tensor, sampling: SamplingConfig, stream: int = TOKEN) -> torch.Tensor:
        """``[rows, vocab]`` logits → ``[rows]`` int64: the sampled token of each row's position (Gumbel-max over
        the filtered, temperature-scaled logits)."""
        scaled = filtered_logits(logits, sampling)  # [rows, vocab], -inf where filtered (a new tensor: ours to add to)
        for row in range(scaled.shape[0]):  # row by row, in place: no [rows, vocab] copy of the noise
            scaled[row] += self.noise.gumbel(self.position + row, scaled.shape[-1], stream)
        return scaled.argmax(-1)

    def sample(self, probs: torch.Tensor, offset: int, stream: int) -> int:
        """A token of ``probs`` (``[vocab]``) at position ``position + offset`` in ``stream`` (Gumbel-max on its
        log: exact for any distribution, zeros never drawn)."""
        noise = self.noise.gumbel(self.position + offset, probs.shape[-1], stream)
        return int((probs.float().log() + noise).argmax())

    def uniforms(self, rows: int, stream: int) -> torch.Tensor:
        """``[rows]`` uniform [0, 1) draws, one per position from ``position`` on."""
        if rows == 0:
            return torch.empty(0, device=self.noise.device)
        return torch.stack([self.noise.uniform(self.position + i, stream) for i in range(rows)])


def choose_tokens(logits: torch.Tensor, sampling: SamplingConfig, draws: Draws | None) -> torch.Tensor:
    """The target's (or a drafter's) choice per row: the argmax when greedy, else its coupled sample (row ``i`` at
    position ``draws.position + i``). ``[rows, vocab]`` → ``[rows]``."""
    if sampling.greedy:
        return logits.argmax(-1)
    if draws is None:
        raise ValueError("sampling (temperature > 0) needs the step's draws (flyspec.sampling.coupled.Draws)")
    return draws.choose(logits, sampling)
