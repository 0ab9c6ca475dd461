"""A JSON schema as llguidance reads it: the subschemas its mask is built from (each
with what its context requires), its local $refs, and copies without annotations or
with refs moved."""

from __future__ import annotations

from typing import Optional
from urllib.parse import unquote


# The keywords whose subschemas llguidance builds into its grammar. The others it
# checks after, leniently, or not at all (not, if/then/else, contains,
# dependentSchemas, vendor x- keys): what sits there is never a part of the mask.
_MASKED_NAMED = ("properties", "patternProperties")
_MERGED = ("anyOf", "oneOf", "allOf")  # members llguidance merges their holder into


def _required(node: dict) -> frozenset:
    r = node.get("required")
    return frozenset(x for x in r if isinstance(x, str)) if isinstance(r, list) else frozenset()


# drafts whose `items` may be a list, with `additionalItems` (later: `prefixItems`)
_ITEMS_AS_LIST = frozenset({"http://json-schema.org/draft-04/schema",
                            "http://json-schema.org/draft-06/schema",
                            "http://json-schema.org/draft-07/schema",
                            "https://json-schema.org/draft/2019-09/schema"})
_WALK_BUDGET = 200_000  # subschemas visited at most (a node is revisited per context)


def _names(node) -> frozenset:
    props = node.get("properties") if isinstance(node, dict) else None
    return frozenset(props) if isinstance(props, dict) else frozenset()


def masked_nodes(schema: dict):
    """(subschema, its JSON pointer, the property names its context requires, alone)
    for the schema and every subschema the mask is built from; a local $ref's target
    counts where it sits. llguidance merges a node into its anyOf / oneOf / allOf
    members and its $ref's target, so those get the node's `required` (and its allOf
    members') as context; and it intersects same-named properties across what it
    merges, so a property another merged schema defines too is not `alone` (its
    schema is not what the mask builds), nor is anything below it. A node reached
    again in a context that requires no more (and no less alone) is not walked again.
    Arrays as llguidance reads them: `items` as a list with `additionalItems`
    (drafts before 2020-12), else `items` with `prefixItems`. Iterative: a long
    chain of $refs costs no stack."""
    old = str(schema.get("$schema", "")).rstrip("#") in _ITEMS_AS_LIST
    anchors = named_anchors(schema)
    stack = [(schema, "", frozenset(), frozenset(), True)]
    seen: dict = {}  # id(node) -> [(ctx, alone)] walked
    budget = _WALK_BUDGET
    while stack and budget:
        budget -= 1
        node, at, ctx, shadow, alone = stack.pop()
        if not isinstance(node, dict):
            continue
        walked = seen.setdefault(id(node), [])
        if any(c <= ctx and (a or not alone) for c, a in walked):
            continue
        walked.append((ctx, alone))
        yield node, at, ctx, alone
        all_of = [m for m in node.get("allOf") or () if isinstance(m, dict)] \
            if isinstance(node.get("allOf"), list) else []
        branches = [m for k in ("anyOf", "oneOf") if isinstance(node.get(k), list)
                    for m in node[k] if isinstance(m, dict)]
        own = _names(node)
        group = [own] + [_names(m) for m in all_of]  # what merges with every member
        anywhere = frozenset().union(*group)
        # properties: another schema merged with this one defines them too
        also = shadow | frozenset().union(*[_names(m) for m in all_of + branches])
        for k in _MASKED_NAMED:
            v = node.get(k)
            if isinstance(v, dict):
                stack += [(x, f"{at}/{k}/{pointer_step(n)}", frozenset(), frozenset(),
                           alone and n not in also) for n, x in v.items()]
        stack.append((node.get("additionalProperties"), f"{at}/additionalProperties",
                      frozenset(), frozenset(), alone))
        items = node.get("items")
        if isinstance(items, list):
            stack += [(x, f"{at}/items/{i}", frozenset(), frozenset(), alone)
                      for i, x in enumerate(items)]
            stack.append((node.get("additionalItems"), f"{at}/additionalItems",
                          frozenset(), frozenset(), alone))
        else:
            stack.append((items, f"{at}/items", frozenset(), frozenset(), alone))
            prefix = node.get("prefixItems")
            if isinstance(prefix, list) and "additionalItems" not in node and not old:
                stack += [(x, f"{at}/prefixItems/{i}", frozenset(), frozenset(), alone)
                          for i, x in enumerate(prefix)]
        merged = ctx | _required(node)
        for m in all_of:
            merged |= _required(m)
        for k in _MERGED:
            v = node.get(k)
            if not isinstance(v, list):
                continue
            for i, x in enumerate(v):
                if k == "allOf":  # the others in the group, not its own
                    others = [g for g, m in zip(group[1:], all_of) if m is not x]
                    mine = shadow | own | frozenset().union(*others)
                else:
                    mine = shadow | anywhere
                stack.append((x, f"{at}/{k}/{i}", merged, mine, alone))
        ref = anchors.get(node.get("$ref"), node.get("$ref"))
        if local_ref(ref):  # (pushed last: walked first)
            stack.append((resolve(schema, ref), ref[1:], merged, shadow | anywhere, alone))


def pointer_step(name: str) -> str:
    """A property name as a step of a JSON pointer (RFC 6901)."""
    return str(name).replace("~", "~0").replace("/", "~1")


def named_anchors(schema) -> dict:
    """{"#name": the JSON pointer ref of its subschema} for the plain-name fragments a
    $ref may use: `$anchor` (2019-09 on) and an `$id` of the form "#name" (drafts 06
    and 07); the first of a name wins."""
    found, stack, budget = {}, [(schema, "#")], _WALK_BUDGET
    while stack and budget:
        budget -= 1
        node, at = stack.pop()
        if isinstance(node, dict):
            for key in ("$anchor", "$id"):
                v = node.get(key)
                if isinstance(v, str) and v and (key == "$anchor" or v.startswith("#")):
                    found.setdefault("#" + v.lstrip("#"), at)
            stack += [(v, f"{at}/{pointer_step(k)}") for k, v in node.items()
                      if k not in _DATA and isinstance(v, (dict, list))]
        elif isinstance(node, list):
            stack += [(v, f"{at}/{i}") for i, v in enumerate(node) if isinstance(v, (dict, list))]
    return {name: at for name, at in found.items() if not local_ref(name)}


def local_ref(ref) -> bool:
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def resolve(schema, ref: str) -> Optional[object]:
    """What a local $ref points to in `schema` (None: nothing)."""
    node = schema
    for step in ref[2:].split("/") if ref != "#" else ():
        step = unquote(step).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return None
    return node


# Keys that say nothing about what is valid. llguidance refuses a recursive $ref with
# any sibling key, annotations included (SchemaStore's schemas often describe a $ref
# beside it), so the mask's copy of a schema goes without them; the full check after
# generating reads the schema as given.
_ANNOTATIONS = frozenset({"description", "markdownDescription", "title", "examples",
                          "$comment", "deprecationMessage", "errorMessage",
                          "markdownEnumDescriptions", "enumDescriptions", "doNotSuggest"})
_NAMED = frozenset({"properties", "patternProperties", "definitions", "$defs",
                    "dependentSchemas", "dependencies"})  # maps of names (kept) to schemas
_DATA = frozenset({"enum", "const", "default", "required", "dependentRequired",
                   "x-guidance"})  # values, not schemas


def rewritten(node, drop=frozenset(), ref=None, named: bool = False):
    """A copy of a JSON schema (or with `named` a map of names to schemas), at any
    depth, without the keys in `drop` (with "$id#" in it, plain-name `$id`s too) and
    with each `$ref` as `ref` gives it; values that are data (enum, const, default,
    ...) unchanged."""
    if isinstance(node, list):
        return [rewritten(x, drop, ref) for x in node]
    if not isinstance(node, dict):
        return node
    if named:
        return {k: rewritten(v, drop, ref) for k, v in node.items()}
    return {k: (ref(v) if k == "$ref" and ref is not None else v if k in _DATA
                else rewritten(v, drop, ref, k in _NAMED))
            for k, v in node.items() if k not in drop
            and not (k == "$id" and "$id#" in drop and str(v).startswith("#"))}


def without_annotations(node):
    """A JSON schema without annotation keys, at any depth."""
    return rewritten(node, drop=_ANNOTATIONS)
