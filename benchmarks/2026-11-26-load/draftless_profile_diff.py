"""Per function, tottime and cumtime of the speculative engine's profile minus plain's (draftless_profile.py)."""

import pstats


def times(path: str, column: int) -> dict[str, float]:
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    return {f"{k[0].split('site-packages/')[-1]}:{k[1]}:{k[2]}": v[column] for k, v in stats.items()}


if __name__ == "__main__":
    for column, name in ((2, "tottime"), (3, "cumtime")):
        spec, plain = times("/tmp/prof/vllm-flyspec-ngram.prof", column), times("/tmp/prof/vllm-plain.prof", column)
        print("==", name, "speculative - plain")
        for key in sorted(set(spec) | set(plain), key=lambda k: -(spec.get(k, 0) - plain.get(k, 0)))[:40]:
            delta = spec.get(key, 0) - plain.get(key, 0)
            print(f"{delta:+.3f}  spec {spec.get(key, 0):.3f} plain {plain.get(key, 0):.3f}  {key}")
