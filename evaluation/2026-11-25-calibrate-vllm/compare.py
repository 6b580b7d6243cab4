"""Compare the two calibrations of this directory (flyspec's engine in flyspec/, vLLM in vllm/), point by point.

For every point: prompts run, loose accepts, outputs that changed meaning, status; then every (prompt, point)
whose output differs between the engines, with the first position where the two outputs part and why:

- ``position 0``: flyspec's engine loosely accepted the first output token; vLLM's first token comes from the
  prefill, where no draft is verified;
- ``near the limit``: the first loose accept the engines disagree on is within the last k tokens before the
  task's token limit, where flyspec's engine drafts only the tokens left and vLLM drafts its full k (so the
  windows and the guards that read the draft see different tokens);
- ``near-tie``: the target's top-2 logits at the parting position (a cache-free float32 forward with
  transformers) are within 1e-3: a batched forward may round them the other way;
- ``unexplained``: none of these (listed in full).

Usage: ``python compare.py [DIRECTORY]`` (default: this one; reads its flyspec/ and vllm/, writes compare.md and
compare.json there).
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from flyspec.calibration import data as calibration_data
from flyspec.runtime.loading import load_model

HERE = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
NEAR_TIE = 1e-3


def records(name: str) -> dict[tuple[str, str], dict]:
    found = {}
    path = HERE / name / "records.jsonl"
    text = path.read_text() if path.is_file() else gzip.decompress(path.with_suffix(".jsonl.gz").read_bytes()).decode()
    for line in text.splitlines():
        record = json.loads(line)
        found[(record["item"], record["point"])] = record
    return found


def tokens(records_: dict, item: str, point: str) -> list[int]:
    record = records_[(item, point)]
    return record.get("token_ids", records_[(item, "plain")]["token_ids"]) if point != "plain" else record["token_ids"]


def main() -> None:
    flyspec, vllm = records("flyspec"), records("vllm")
    profiles = {name: json.loads((HERE / name / "profile.json").read_text()) for name in ("flyspec", "vllm")}
    k = profiles["vllm"]["drafter"]["speculation"]["num_draft_tokens"]
    items = calibration_data.load(calibration_data.resolve_tasks("generated,adversarial", "contains"), 400, False)
    by_key = {item.key: item for item in items}
    target = load_model("smollm2-135m-instruct", dtype="float32", kernels="stock")
    points = [summary["name"] for summary in profiles["flyspec"]["frontier"]]
    rows, differences = [], []
    for point in points:
        summaries = {name: next(s for s in profiles[name]["frontier"] if s["name"] == point) for name in profiles}
        fields = ("status", "n", "loose_accepts")
        row = {f"{name} {field}": summaries[name][field] for name in profiles for field in fields}
        row.update({f"{name} changed": summaries[name]["meaning_changed"]["count"] for name in profiles})
        row.update({f"{name} tau": summaries[name]["tau"] for name in profiles})
        rows.append({"point": point, **row})
    for key in sorted(set(flyspec) & set(vllm)):
        item, point = key
        if point == "plain" or tokens(flyspec, item, point) == tokens(vllm, item, point):
            continue
        a, b = tokens(flyspec, item, point), tokens(vllm, item, point)
        part = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        loose_a = {entry["index"] for entry in flyspec[key].get("loose_accepts", [])}
        loose_b = {entry["index"] for entry in vllm[key].get("loose_accepts", [])}
        disputed = min((loose_a ^ loose_b) or {part})
        limit = by_key[item].task.max_new_tokens
        prompt_ids = target.encode_prompt(by_key[item].task.prompt(by_key[item].item))
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt_ids + a[:part]])).logits[0, -1]
        top2 = logits.topk(2).values
        if 0 in loose_a and 0 not in loose_b:
            reason = "position 0"
        elif disputed >= limit - k - 1:
            reason = "near the limit"
        elif float(top2[0] - top2[1]) < NEAR_TIE:
            reason = "near-tie"
        else:
            reason = "unexplained"
        differences.append({
            "item": item, "point": point, "parts_at": part, "first_disputed_loose_accept": disputed,
            "limit": limit, "flyspec_loose": sorted(loose_a), "vllm_loose": sorted(loose_b),
            "top2_gap": float(top2[0] - top2[1]), "reason": reason,
        })  # fmt: skip
    reasons = Counter(difference["reason"] for difference in differences)
    compared = sum(1 for key in set(flyspec) & set(vllm) if key[1] != "plain")
    summary = {
        "compared": compared,
        "different_outputs": len(differences),
        "reasons": dict(reasons),
        "plain_identical": sum(
            tokens(flyspec, item, "plain") == tokens(vllm, item, "plain") for item, point in flyspec if point == "plain"
        ),
        "chosen": {name: (profiles[name]["chosen"] or {}).get("name") for name in profiles},
        "points": rows,
        "differences": differences,
    }
    (HERE / "compare.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [
        "# flyspec's engine vs vLLM: the same calibration, point by point",
        "",
        f"Outputs compared (prompt × point, plain excluded): {compared}; different: {len(differences)} "
        f"({', '.join(f'{reason}: {count}' for reason, count in reasons.most_common()) or 'none'}).",
        f"Plain decoding identical on {summary['plain_identical']} prompts. Chosen: {summary['chosen']}.",
        "",
        "| point | flyspec status | n | τ | loose | changed | vLLM status | n | τ | loose | changed |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['point']} | {row['flyspec status']} | {row['flyspec n']} | {row['flyspec tau']:.3f} | "
            f"{row['flyspec loose_accepts']} | {row['flyspec changed']} | {row['vllm status']} | {row['vllm n']} | "
            f"{row['vllm tau']:.3f} | {row['vllm loose_accepts']} | {row['vllm changed']} |"
        )
    lines += ["", "## Every output that differs", "", "| prompt | point | parts at | first disputed loose accept | "
              "limit | flyspec loose | vLLM loose | top-2 gap | why |", "|---|---|---:|---:|---:|---|---|---:|---|"]
    for d in differences:
        lines.append(
            f"| {d['item']} | {d['point']} | {d['parts_at']} | {d['first_disputed_loose_accept']} | {d['limit']} | "
            f"{d['flyspec_loose'][:6]} | {d['vllm_loose'][:6]} | {d['top2_gap']:.4f} | {d['reason']} |"
        )
    (HERE / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:4]))


if __name__ == "__main__":
    main()
