"""service/frontends/json_codec.py count_top_arrays: the element count of a body's top-level arrays, taken without
parsing them, agrees with json.loads on what it counts, and leaves every body that is not plain JSON to the
parser (json.loads is the oracle)."""

from __future__ import annotations

import json
import random

from relserve.service.frontends.json_codec import count_top_arrays

CAP = 3


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 2 else 4)
    if kind == 0:
        return rng.choice(["", "a", 'quo"te', "back\\slash", "ünï", "\u2028", "[not, an, array]"])
    if kind == 1:
        return rng.choice([0, -1, 2.5, 1e300])
    if kind == 2:
        return rng.choice([True, False])
    if kind == 3:
        return None
    if kind in (4, 5):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(3))}


def _dump(obj, rng: random.Random) -> bytes:
    separators = rng.choice([(",", ":"), (", ", ": "), (" ,\n", " :\t")])
    text = json.dumps(obj, separators=separators, ensure_ascii=rng.random() < 0.5)
    return (rng.choice(["", " ", "\n\t "]) + text + rng.choice(["", " \r\n"])).encode("utf-8")


def test_counts_agree_with_json_loads_on_random_bodies():
    rng = random.Random(7)
    for _ in range(600):
        body = {}
        for key in rng.sample(["texts", "textPairs", "model", "topK", "other"], rng.randrange(1, 6)):
            if key in ("texts", "textPairs") and rng.random() < 0.8:
                body[key] = [_random_value(rng, 1) for _ in range(rng.randrange(7))]
            elif key == "model" and rng.random() < 0.8:
                body[key] = rng.choice(["m", "other", ""])
            else:
                body[key] = _random_value(rng)
        raw = _dump(body, rng)
        parsed = json.loads(raw)
        over = [k for k in parsed if k in ("texts", "textPairs") and isinstance(parsed[k], list)
                and len(parsed[k]) > CAP]
        got = count_top_arrays(raw, {"texts": CAP, "textPairs": CAP})
        if not over:
            assert got is None, (raw, got)
            continue
        first = min(over, key=list(parsed).index)  # the walk stops at the first array over its cap
        keys = list(parsed)
        model = parsed.get("model") if "model" in keys[:keys.index(first)] else ""
        assert got == (first, model if isinstance(model, str) else ""), (raw, got)


def test_anything_but_a_plain_json_object_is_left_to_the_parser():
    for raw in (b"", b"[1, 2, 3, 4, 5]", b'"texts"', b'{"texts": ["a", "b"', b"\xff\xfe{}", b'{"texts" ["a"]}',
                b'{"texts": ["a" "b", "c", "d", "e"]}', b"{'texts': [1, 2, 3, 4, 5]}", b'{"a": 1,}'):
        assert count_top_arrays(raw, {"texts": CAP}) is None, raw
    # a million texts: refused after CAP + 1 scans (the walk does not read on)
    million = b'{"model": "m", "texts": [' + b'"a", ' * 1_000_000 + b'"a"]}'
    assert count_top_arrays(million, {"texts": CAP}) == ("texts", "m")
