"""Part-4 grid of issue 11 as run on 2026-11-23 (flyspec at commit 2ffdf12, before the SpeculationConfig redesign).

    python grid.py MODEL float32 passage,numbers,adversarial 30 \
        6:0.3:guard,4:0.15:guard,6:0.3:bare,4:0.3:bare,8:0.3:bare,6:0.15:bare,6:0.6:bare,6:1.0:bare

One JSON line per (task, window:threshold:rule); meaning change and new loop are flyspec eval's
metrics (``eval/trust.py``). Kept as the record of what ran; later API changes are not ported.
"""

import json
import sys

import torch

from flyspec.api import build_decoder, make_generator, resolve_model
from flyspec.config import DecodeConfig, FlyConfig, GuardConfig
from flyspec.decoding.plain import PlainDecoder
from flyspec.eval.data import LoadReport
from flyspec.eval.tasks import builtin_tasks, load_items
from flyspec.eval.trust import meaning_change, new_loop


def first_score(task, item, text: str) -> float:
    values = task.score(item, text).values
    return list(values.values())[0] if values else 0.0


def main() -> None:
    torch.set_num_threads(1)
    model, dtype, tasks, limit = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
    grid = [(int(c.split(":")[0]), float(c.split(":")[1]), c.split(":")[2] == "bare") for c in sys.argv[5].split(",")]
    target = resolve_model(model, dtype)
    for name in tasks:
        task = builtin_tasks()[name]
        items = load_items(task, limit, False, LoadReport())
        plain = PlainDecoder(target, DecodeConfig(max_new_tokens=task.max_new_tokens))
        decoders = {
            g: build_decoder(
                target, "ngram", "fly", num_draft_tokens=max(15, g[0] + 1), fly=FlyConfig(g[0], g[1]),
                guard=GuardConfig.bare() if g[2] else GuardConfig(), max_new_tokens=task.max_new_tokens,
            )
            for g in grid
        }
        zero = dict(score=0.0, tokens=0, forwards=0, ident=0, changed=0, loops=0, loose=0)
        totals = {g: {**zero, "vetoes": {}} for g in grid}
        plain_score = 0.0
        for item in items:
            prompt = task.prompt(item)
            ids = target.encode_prompt(prompt, None)
            p = plain.generate(ids)
            plain_score += first_score(task, item, p.text)
            for g, decoder in decoders.items():
                r = decoder.generate(ids, generator=make_generator(0))
                t = totals[g]
                t["score"] += first_score(task, item, r.text)
                t["tokens"] += r.stats.num_new_tokens
                t["forwards"] += r.stats.num_target_forwards
                t["ident"] += r.token_ids == p.token_ids
                t["loose"] += r.stats.num_loose_accepts
                change = meaning_change(
                    r.text, p.text, prompt,
                    method_truncated=r.finish_reason == "length", plain_truncated=p.finish_reason == "length",
                )
                t["changed"] += change.changed
                for guard, count in r.stats.guard_vetoes.items():
                    t["vetoes"][guard] = t["vetoes"].get(guard, 0) + count
                t["loops"] += new_loop(r.token_ids, p.token_ids) is not None
        n = len(items)
        for g, t in totals.items():
            print(json.dumps(dict(
                model=model, dtype=dtype, task=name, n=n, window=g[0], threshold=g[1], bare=g[2],
                plain_score=round(plain_score / n, 4), score=round(t["score"] / n, 4),
                tau=round(t["tokens"] / t["forwards"], 3), identical=t["ident"], meaning_changed=t["changed"],
                new_loops=t["loops"], loose=t["loose"], vetoes=t["vetoes"],
            )), flush=True)


if __name__ == "__main__":
    main()
