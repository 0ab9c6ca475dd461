"""Rebuild the vendored schemas here from the `check-jsonschema` wheel
(`pip download check-jsonschema==0.39.0 --no-deps`, then unzip it):

    python tests/data/schemas/build_sample.py path/to/check_jsonschema/builtin_schemas

Each document is kept whole, its annotations' texts emptied (descriptions,
examples, comments: nothing that decides what is valid; the keys stay where they
were), written compactly, into documents.json. Documents over mlxnb's size limit, and those under copyleft
licences, are left out. tests/test_real_schemas.py draws its cases from them.
"""

import json
import sys
from pathlib import Path

LEAVE_OUT = {"renovate", "snapcraft"}  # AGPL-3.0, GPL-3.0
MAX_CHARS = 128_000  # mlxnb.core.constrain.MAX_CONSTRAINT_CHARS
ANNOTATIONS = {"description", "markdownDescription", "examples", "$comment",
               "deprecationMessage", "errorMessage", "doNotSuggest"}
NAMED = {"properties", "patternProperties", "definitions", "$defs", "dependentSchemas"}
DATA = {"enum", "const", "default", "required"}


def strip(node, named: bool = False):
    """`node` (a schema, or with `named` a map of names to schemas) with empty
    annotation texts."""
    if isinstance(node, list):
        return [strip(x) for x in node]
    if not isinstance(node, dict):
        return node
    if named:
        return {k: strip(v) for k, v in node.items()}
    return {k: (type(v)() if k in ANNOTATIONS and isinstance(v, (str, list)) else
                v if k in DATA else strip(v, k in NAMED)) for k, v in node.items()}


def main(root: str) -> None:
    docs = {}
    for path in sorted(Path(root).glob("*/*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        if path.stem in LEAVE_OUT or len(json.dumps(doc)) > MAX_CHARS:
            continue
        docs[path.name] = strip(doc)
    Path(__file__).with_name("documents.json").write_text(
        json.dumps(docs, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"{len(docs)} documents")


if __name__ == "__main__":
    main(sys.argv[1])
