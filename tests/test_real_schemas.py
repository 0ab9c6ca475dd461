"""Real-world JSON schemas: documents from SchemaStore and other public projects, as
vendored in the `check-jsonschema` package (tests/data/schemas/README.md), each whole
and each of its definitions on its own. At least 97% run; every one either runs or
is refused up front (none is accepted and then fails at its first tokens); every row
that ends `stop` is `valid` exactly when jsonschema says its value meets the whole
schema (keys the mask cannot enforce are checked after)."""

import json
import re
from pathlib import Path

import pytest

from mlxnb import Engine
from mlxnb.core.constrain import Constraints
from mlxnb.core.rows import SamplingParams

DOCS = Path(__file__).parent / "data" / "schemas" / "documents.json"


def cases() -> list:
    """(name, schema): every document, and each of its definitions with the
    definitions it reaches, referred to from the root (as a user passes one part)."""
    out = []
    for name, doc in json.loads(DOCS.read_text(encoding="utf-8")).items():
        out.append((name, doc))
        key = "definitions" if "definitions" in doc else "$defs" if "$defs" in doc else None
        defs = doc.get(key) or {}
        for d in defs:
            need, todo = set(), [d]
            while todo:
                x = todo.pop()
                if x in need or x not in defs:
                    continue
                need.add(x)
                todo += re.findall(r'"#/' + re.escape(key) + r'/([^"/]+)', json.dumps(defs[x]))
            if re.search(r'"#/(?!' + re.escape(key) + r'/)', json.dumps([defs[x] for x in need])):
                continue  # it points into the rest of its document: not a part alone
            head = {"$schema": doc["$schema"]} if "$schema" in doc else {}
            out.append((f"{name}#{d}", {**head, key: {x: defs[x] for x in defs if x in need},
                                        "$ref": f"#/{key}/{d}"}))
    return out


CASES = cases()


def jsonschema_valid(schema, text) -> bool:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema).is_valid(json.loads(text))


def verdicts(tokenizer, names) -> dict:
    """name -> None (it runs) or its one-line refusal; `tokenizer` None: the default
    model's."""
    if tokenizer is None:
        from mlxnb.models.loading import load_model

        tokenizer = load_model("default")[1]
    cons, schemas = Constraints(tokenizer), dict(CASES)
    out = {}
    for name in names:
        try:
            cons.validate(SamplingParams(json_schema=schemas[name]))
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.fixture(scope="module")
def smollm2():
    from mlxnb.models.tiny import tiny_model

    return tiny_model(vocab="smollm2")


def generate(model, names, max_tokens: int, arun) -> list:
    schemas = dict(CASES)

    async def main():
        eng = Engine(model, kv_budget=None, warmup=False, max_batch=64)
        try:
            rows = [eng.submit("Write the JSON.", json_schema=schemas[n], max_tokens=max_tokens,
                               tag=n) for n in names]
            await eng.wait()
            return rows
        finally:
            await eng.aclose()

    return arun(main, timeout=900)


def check_rows(rows) -> None:
    schemas = dict(CASES)
    for r in rows:
        assert r.finish_reason in ("stop", "length"), (r.tag, r.finish_reason, r.error)
        if r.finish_reason == "stop":
            assert r.valid == jsonschema_valid(schemas[r.tag], r.text), (
                r.tag, r.text[:200], r.constraint_error)


def test_a_sample_of_real_schemas_runs_or_is_refused_up_front(smollm2, arun):
    """Every tenth case (the unit tier's share; the integration test takes them all):
    at least 97% accepted, refusals in one line, and the accepted ones run greedy on
    the tiny model with the real tokenizer: none ends in error, every stopped row's
    `valid` agrees with jsonschema."""
    names = [n for n, _ in CASES[::10]]
    got = {n: v for n, v in verdicts(smollm2[1], names).items()}
    ok = [n for n, why in got.items() if why is None]
    assert len(ok) >= 0.97 * len(names), {n: w for n, w in got.items() if w}
    assert all("\n" not in why for why in got.values() if why)
    check_rows(generate(smollm2, ok, 40, arun))


@pytest.mark.integration
def test_all_real_schemas_run_or_are_refused_up_front(smollm2, arun):
    got = verdicts(smollm2[1], [n for n, _ in CASES])
    ok = [n for n, why in got.items() if why is None]
    assert len(ok) >= 0.97 * len(CASES), {n: w for n, w in got.items() if w}
    assert all("\n" not in why for why in got.values() if why)
    rows = generate(smollm2, ok, 64, arun)
    check_rows(rows)
    assert sum(r.finish_reason == "stop" for r in rows) >= len(rows) // 3  # not all cut


@pytest.mark.integration
def test_real_schemas_on_the_default_model(arun):
    """A few cases on the bundled SmolLM2: a real model writes real values."""
    names = [n for n, _ in CASES[::120]]  # every document: the tiny model's tests
    got = verdicts(None, names)
    ok = [n for n, why in got.items() if why is None]
    rows = generate("default", ok, 128, arun)
    check_rows(rows)
