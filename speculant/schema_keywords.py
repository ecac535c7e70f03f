"""Every JSON-schema keyword either held or refused: a schema rewritten into the forms that
lm-format-enforcer's JsonSchemaParser (0.11) enforces exactly, or a SpeculantError naming the
keyword and where it is.

What the parser does with each keyword (read from its source, checked by feeding it text):
- holds: ``type`` (one name), ``properties`` (only the listed keys are written), ``required``,
  ``additionalProperties`` (a schema, for an object without ``properties``), ``items`` (one schema),
  ``minItems``, ``maxItems``, ``minLength``, ``pattern`` (matched whole), ``enum`` (all strings or
  all numbers), ``anyOf``, ``$ref`` (by its last segment, in the root's ``$defs``);
- mishandles: ``maxLength`` (a string's leading spaces go uncounted), ``allOf`` (merges properties
  only), ``oneOf`` (objects only, not exclusive), ``const`` (strings only), a ``type`` list (drops the
  other keywords), booleans in ``enum``, ``{}`` or a schema without ``type`` (an error mid-output),
  ``additionalProperties: true``, a ``required`` key not in ``properties`` (a dead end), a
  ``$ref`` beside ``type`` or nested below tool parameters (unresolved);
- ignores everything else (``minimum``, ``multipleOf``, ``format``, ``uniqueItems``, ``not``, ...).

``enforceable`` rewrites the mishandled ones into held forms where that is exact (every output the
parser allows meets the schema), and refuses what it cannot hold and what nothing can meet. The
walk is iterative (a schema nested deep costs a loop, not Python's stack).
"""
from __future__ import annotations

import json
import math
import re

from .errors import SpeculantError

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
ANY = {"anyOf": [{"type": t} for t in TYPES if t != "integer"]}  # what the parser takes for "any JSON"
# annotations: they constrain nothing ("nullable" is OpenAPI's; plain JSON Schema ignores it, so a
# non-null output meets it either way)
DESCRIPTIVE = frozenset({"title", "description", "examples", "example", "default", "$comment", "$schema", "$id",
                         "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "deprecated", "readOnly",
                         "writeOnly", "discriminator", "nullable", "$defs", "definitions"})
FAMILY = {  # the keywords that apply to one type of value (integer shares number's)
    "string": {"minLength", "maxLength", "pattern", "format", "contentEncoding", "contentMediaType",
               "contentSchema"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "object": {"properties", "required", "additionalProperties", "patternProperties", "propertyNames",
               "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "dependencies",
               "unevaluatedProperties"},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
              "minContains", "maxContains", "unevaluatedItems"},
}
GENERIC = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"}
NEVER = {"not": "the parser has no negation", "if": "the parser has no conditionals",
         "then": "the parser has no conditionals", "else": "the parser has no conditionals",
         "$dynamicRef": "only '$ref' to this schema is followed",
         "$recursiveRef": "only '$ref' to this schema is followed"}
KNOWN = DESCRIPTIVE | GENERIC | set(NEVER) | set().union(*FAMILY.values())
FORMATS = {  # formats rewritten to a pattern that only matches valid values
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    # day 29 only outside February and 30, 31 only in months that have them: every date it writes exists
    "date": "[0-9]{4}-((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)",
}
OWN_PATTERN = re.compile(r"\(?\[!-~\]\[ -~\]\{\d+,\d+\}(\)\?)?")  # maxLength's, made below
MAX_ENUM_RANGE = 256  # integers in a bounded range written out as an enum
MAX_LENGTH_PATTERN = 4096  # repeats in a pattern (its automaton has a state per repeat)
MAX_PATTERN_STATES = 8192  # states of the patterns' automata walked to find dead ends, in one schema
MAX_STEPS = 20_000  # schema nodes visited (rewrites add some): past it the schema is refused
MAX_INLINED = 64  # $refs followed to merge one allOf


def _where(path: str, key: str) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def cannot(keyword: str, path: str, why: str) -> SpeculantError:
    return SpeculantError(f"the JSON schema uses '{keyword}' at {path}, which speculant cannot enforce: {why}")


def unmeetable(path: str, why: str) -> SpeculantError:
    return SpeculantError(f"the JSON schema cannot be met at {path}: {why}")


def unusable(path: str, why: str) -> SpeculantError:
    return SpeculantError(f"unusable JSON schema at {path}: {why}")


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", dict: "object", list: "array"}.get(type(value), "?")


def _key(value):
    """A value as JSON compares it (1 == 1.0, as Python's numbers do; true is not 1)."""
    kind = _kind(value)
    if kind in ("integer", "number"):
        return "number", value
    return kind, json.dumps(value, sort_keys=True)


def _types(node: dict, path: str) -> set[str] | None:
    t = node.get("type")
    if t is None:
        return None
    names = [t] if isinstance(t, str) else t
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise unusable(path, "'type' must be a type name or a list of them")
    for n in names:
        if n not in TYPES:
            raise unusable(path, f"'type' '{n}' is not one of {', '.join(TYPES)}")
    return set(names)


def _number(node: dict, key: str, path: str, whole: bool = False, positive: bool = False):
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and _kind(value) != "integer") \
            or (positive and value <= 0) or (whole and value < 0):
        what = "a whole number >= 0" if whole else "a number > 0" if positive else "a number"
        raise unusable(path, f"'{key}' must be {what}, got {json.dumps(value)}")
    return int(value) if whole else value


def _old_exclusive(node: dict) -> dict:
    """Draft 4's boolean exclusiveMinimum/Maximum in today's numeric form."""
    if not any(isinstance(node.get(k), bool) for k in ("exclusiveMinimum", "exclusiveMaximum")):
        return node
    node = dict(node)
    for bound, ex in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if node.get(ex) is True and bound in node:
            node[ex] = node.pop(bound)
        elif isinstance(node.get(ex), bool):
            del node[ex]
    return node


class _Doc:
    """The document a walk resolves ``$ref``s in, and the names its targets get in the root's ``$defs``."""

    def __init__(self, root, prefix: str):
        self.root, self.prefix = root, prefix
        self.names: dict[str, str] = {}  # a target's pointer -> its name in the output's $defs
        self.pattern_states = 0  # walked so far (each costs ~0.2 ms)

    def resolve(self, ref, path: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise cannot("$ref", path, f"only references inside this schema ('#/...') are followed, got {ref!r}")
        pointer = re.sub(r"%([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), ref[1:])
        node = self.root
        if pointer:
            if not pointer.startswith("/"):
                raise cannot("$ref", path, f"only JSON pointers ('#/...') are followed, got {ref!r}")
            for part in pointer[1:].split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    raise unusable(path, f"'$ref' {ref!r} points at nothing")
        return "#" + pointer, node


def _flatten(members: list, doc: _Doc, path: str) -> list[dict]:
    """allOf's members with their $refs and nested allOfs opened (no recursion: a to-do list)."""
    out, todo, inlined = [], list(reversed(members)), 0
    while todo:
        m = todo.pop()
        if m is True:
            continue
        if not isinstance(m, dict):
            if m is False:
                raise unmeetable(path, "'allOf' holds the schema false, which nothing meets")
            raise unusable(path, "'allOf' must hold schemas")
        if "$ref" in m or "allOf" in m:
            inlined += 1
            if inlined > MAX_INLINED:
                raise cannot("allOf", path, f"it opens more than {MAX_INLINED} '$ref's (a recursive one?)")
            rest = {k: v for k, v in m.items() if k not in ("$ref", "allOf")}
            more = [doc.resolve(m["$ref"], path)[1]] if "$ref" in m else []
            if "allOf" in m:
                if not isinstance(m["allOf"], list) or not m["allOf"]:
                    raise unusable(path, "'allOf' must be a non-empty list of schemas")
                more += m["allOf"]
            todo.extend(reversed(more + [rest]))
        else:
            out.append(m)
    return out


LOWER = ("minLength", "minItems", "minimum", "exclusiveMinimum", "minProperties", "minContains")
UPPER = ("maxLength", "maxItems", "maximum", "exclusiveMaximum", "maxProperties", "maxContains")


def _merge(a: dict, b: dict, path: str) -> dict:
    """Two schemas' intersection (allOf of both), keyword by keyword, where it is exact."""
    a, b = _old_exclusive(a), _old_exclusive(b)
    out = dict(a)
    for k, vb in b.items():
        if k not in a or k in DESCRIPTIVE:
            out.setdefault(k, vb)
        elif k in ("properties", "additionalProperties", "required", "const"):
            pass  # below
        elif k == "type":
            ta, tb = _types(a, path), _types(b, path)
            both = (ta & tb) | ({"integer"} if ("integer" in ta and "number" in tb) or
                                ("number" in ta and "integer" in tb) else set())
            if not both:
                raise unmeetable(path, f"'allOf' asks for type {sorted(ta)} and {sorted(tb)}")
            out["type"] = sorted(both)
        elif k in LOWER or k in UPPER:
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a[k], vb)):
                raise unusable(path, f"'{k}' must be a number")
            out[k] = max(a[k], vb) if k in LOWER else min(a[k], vb)
        elif k == "enum":
            if not isinstance(a[k], list) or not isinstance(vb, list):
                raise unusable(path, "'enum' must be a list")
            keys = {_key(v) for v in vb}
            out[k] = [v for v in a[k] if _key(v) in keys]
        elif k == "items" and (isinstance(a[k], dict) or isinstance(vb, dict)):
            out[k] = vb if a[k] is True else a[k] if vb is True else {"allOf": [a[k], vb]}
        elif k == "uniqueItems":
            out[k] = a[k] or vb
        elif a[k] != vb:
            if k == "multipleOf" and all(_kind(v) == "integer" and v > 0 for v in (a[k], vb)):
                out[k] = math.lcm(int(a[k]), int(vb))
            else:
                raise cannot("allOf", path, f"its members give '{k}' two different values")
    for key in ("const",):
        if key in a and key in b and _key(a[key]) != _key(b[key]):
            raise unmeetable(path, "'allOf' asks for two different 'const' values")
    out["required"] = list(dict.fromkeys((a.get("required") or []) + (b.get("required") or [])))
    if not out["required"]:
        del out["required"]
    # properties: a key one side does not list meets that side's additionalProperties
    pa, pb = a.get("properties"), b.get("properties")
    if pa is not None or pb is not None:
        props = {}
        for k in dict.fromkeys([*(pa or {}), *(pb or {})]):
            parts = []
            for side, p in ((a, pa), (b, pb)):
                extra = p[k] if p is not None and k in p else side.get("additionalProperties", True)
                if extra is False:
                    break
                if extra is not True:
                    parts.append(extra)
            else:
                props[k] = parts[0] if len(parts) == 1 else {"allOf": parts} if parts else {}
        out["properties"] = props
    ea, eb = a.get("additionalProperties", True), b.get("additionalProperties", True)
    if ea is False or eb is False:
        out["additionalProperties"] = False
    elif ea is not True and eb is not True:
        out["additionalProperties"] = {"allOf": [ea, eb]}
    elif ea is not True or eb is not True:
        out["additionalProperties"] = ea if ea is not True else eb
    else:
        out.pop("additionalProperties", None)
    return out


def _deref(node, doc: _Doc):
    """A schema that is only a ``$ref`` (beside annotations): its target (a few steps of a chain)."""
    for _ in range(8):
        if not (isinstance(node, dict) and "$ref" in node and set(node) - DESCRIPTIVE == {"$ref"}):
            break
        try:
            node = doc.resolve(node["$ref"], "#")[1]
        except SpeculantError:
            break
    return node


def _values(node) -> set | None:
    """The finite set of values a schema allows (``const``/``enum``); None if it is not finite."""
    if isinstance(node, dict) and "const" in node:
        return {_key(node["const"])}
    if isinstance(node, dict) and isinstance(node.get("enum"), list):
        return {_key(v) for v in node["enum"]}
    return None


def _kinds(node) -> set[str]:
    """The kinds of JSON value a schema may allow (integer counted as number), at a glance."""
    values = _values(node)
    if values is not None:
        return {kind for kind, _ in values}
    t = node.get("type") if isinstance(node, dict) else None
    if isinstance(t, (str, list)):
        return {"number" if n == "integer" else n for n in ([t] if isinstance(t, str) else t)}
    return set(TYPES)


def _disjoint(a, b, doc: _Doc) -> bool:
    """True where no value can meet both schemas (told by kinds, by values, or by a property both
    require with values that differ: a discriminated union's tag)."""
    a, b = _deref(a, doc), _deref(b, doc)
    if not _kinds(a) & _kinds(b):
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not va & vb:
        return True
    if not all(isinstance(x, dict) and isinstance(x.get("properties"), dict) and isinstance(x.get("required"), list)
               for x in (a, b)):
        return False
    for key in set(a["required"]) & set(b["required"]):
        pa, pb = _values(_deref(a["properties"].get(key), doc)), _values(_deref(b["properties"].get(key), doc))
        if pa is not None and pb is not None and not pa & pb:
            return True
    return False


def _text_ok(s: str) -> bool:
    """A string the parser writes as it is: no escapes (a quote, a backslash, a control character)
    and no leading whitespace (which it skips)."""
    return not re.search(r'["\\\x00-\x1f]', s) and not s[:1].isspace()


def _meets(value, node: dict, path: str) -> bool:
    """Whether one enum value meets the schema's other keywords (those that apply to its kind)."""
    kind = _kind(value)
    types = _types(node, path)
    if types is not None and kind not in types and not (kind == "integer" and "number" in types):
        return False
    if kind == "string":
        if "format" in node:
            raise cannot("format", path, "a format beside 'enum' or 'const' is not checked")
        if len(value) < (_number(node, "minLength", path, whole=True) or 0):
            return False
        if _number(node, "maxLength", path, whole=True) is not None and len(value) > node["maxLength"]:
            return False
        if "pattern" in node:
            try:
                return re.search(node["pattern"], value) is not None
            except (re.error, TypeError):
                raise unusable(path, f"'pattern' {node['pattern']!r} is not a regular expression") from None
    if kind in ("integer", "number"):
        for key, ok in (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
                        ("exclusiveMinimum", lambda b: value > b), ("exclusiveMaximum", lambda b: value < b)):
            bound = _number(node, key, path)
            if bound is not None and not ok(bound):
                return False
        step = _number(node, "multipleOf", path, positive=True)
        if step is not None and not (value / step).is_integer():
            return False
    return True


def _enum_node(values: list, path: str) -> dict:
    """The parser's forms for a list of allowed values: strings in one enum, numbers in another,
    null and true/false by type; an anyOf where they mix."""
    parts, kinds = [], {}
    for v in values:
        kinds.setdefault("number" if _kind(v) == "integer" else _kind(v), []).append(v)
    for kind, vs in kinds.items():
        if kind == "string":
            bad = next((s for s in vs if not _text_ok(s)), None)
            if bad is not None:
                raise cannot("enum", path, f"the value {json.dumps(bad)} holds a quote, a backslash or a control "
                                           "character, or starts with whitespace: the parser cannot write it")
            parts.append({"enum": vs})
        elif kind == "number":
            parts.append({"enum": vs})
        elif kind == "null":
            parts.append({"type": "null"})
        elif kind == "boolean":
            if len({bool(v) for v in vs}) == 1:
                raise cannot("enum", path, "a single true or false value (the parser writes both or neither)")
            parts.append({"type": "boolean"})
        else:
            raise cannot("enum", path, f"{kind} values (only strings, numbers, booleans and null)")
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _bounded_numbers(node: dict, integer: bool, path: str) -> dict | None:
    """minimum/maximum/exclusive*/multipleOf as an enum of the values in range, where they are
    whole numbers and few; None where the node has none of them."""
    keys = [k for k in FAMILY["number"] if k in node]
    if not keys:
        return None
    lo, hi = -math.inf, math.inf
    if _number(node, "minimum", path) is not None:
        lo = max(lo, node["minimum"])
    if _number(node, "maximum", path) is not None:
        hi = min(hi, node["maximum"])
    ex_lo, ex_hi = _number(node, "exclusiveMinimum", path), _number(node, "exclusiveMaximum", path)
    step = _number(node, "multipleOf", path, positive=True)
    key = next(k for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "multipleOf") if k in node)
    named = " and ".join(f"'{k}' {json.dumps(node[k])}" for k in sorted(keys))
    if lo > hi or (ex_lo is not None and ex_lo >= hi) or (ex_hi is not None and lo >= ex_hi) or \
            (ex_lo is not None and ex_hi is not None and ex_lo >= ex_hi):
        raise unmeetable(path, f"no number meets {named}")
    whole = integer or (step is not None and float(step).is_integer())
    if not whole:
        if lo == hi and ex_lo is None and ex_hi is None and (step is None or (lo / step).is_integer()):
            return {"enum": [lo]}
        raise cannot(key, path, "bounds are enforced on integers only (a range of at most "
                                f"{MAX_ENUM_RANGE} of them is written out as an enum)")
    first = math.ceil(lo) if lo != -math.inf else None
    last = math.floor(hi) if hi != math.inf else None
    if ex_lo is not None:
        first = max(first, math.floor(ex_lo) + 1) if first is not None else math.floor(ex_lo) + 1
    if ex_hi is not None:
        last = min(last, math.ceil(ex_hi) - 1) if last is not None else math.ceil(ex_hi) - 1
    if first is None or last is None:
        raise cannot(key, path, f"an integer is held within bounds only where both ends are given (a range of "
                                f"at most {MAX_ENUM_RANGE} integers is written out as an enum)")
    step = int(step) if step is not None else 1
    first = -(-first // step) * step
    if first > last:
        raise unmeetable(path, f"no integer meets {named}")
    if (last - first) // step + 1 > MAX_ENUM_RANGE:
        raise cannot(key, path, f"the range holds {(last - first) // step + 1:,} integers: at most "
                                            f"{MAX_ENUM_RANGE} are written out as an enum")
    return {"enum": list(range(first, last + 1, step))}


def _pattern(pattern, path: str, doc: _Doc) -> str:
    """A pattern the parser can follow to its end from every state it reaches (it cannot write a
    quote or a backslash inside a pattern-held string, and builds its automaton on demand)."""
    if not isinstance(pattern, str):
        raise unusable(path, "'pattern' must be a string")
    if pattern in FORMATS.values() or OWN_PATTERN.fullmatch(pattern):  # made here (a schema rewritten again)
        return pattern
    try:
        from lmformatenforcer.regexparser import RegexParser
    except ImportError:  # json_schema_processor says what to install
        return pattern
    if any(int(n) > MAX_LENGTH_PATTERN for n in re.findall(r"\{(\d+)", pattern) + re.findall(r",(\d+)\}", pattern)):
        raise cannot("pattern", path, f"a repeat count over {MAX_LENGTH_PATTERN} (its automaton would have a state "
                                      "per repeat)")
    body = pattern[1:] if pattern.startswith("^") else pattern  # what the parser does with it
    body = body[:-1] if body.endswith("$") else body
    try:
        start = RegexParser(body)
    except Exception:  # noqa: BLE001 -- interegular's many errors: the pattern is what is wrong
        raise cannot("pattern", path, f"{pattern!r} is not a regular expression the parser reads") from None
    seen, todo, edges = {start.current_state: start}, [start], {}
    while todo:
        p = todo.pop()
        chars = p.get_allowed_characters().replace('"', "").replace("\\", "")
        if re.search(r"[\x00-\x1f\x7f]", chars):  # the parser would write it raw: not JSON
            raise cannot("pattern", path, f"{pattern!r} allows a control character (a newline or tab: '\\s' has "
                                          "them), which a JSON string holds only escaped: write ' ' for '\\s'")
        edges[p.current_state] = []
        for c in chars:
            q = p.add_character(c)
            edges[p.current_state].append(q.current_state)
            if q.current_state not in seen:
                doc.pattern_states += 1
                if doc.pattern_states > MAX_PATTERN_STATES:
                    raise cannot("pattern", path, f"the schema's patterns have more than {MAX_PATTERN_STATES:,} "
                                                  "states in all (each is checked for dead ends)")
                seen[q.current_state] = q
                todo.append(q)
    live = {s for s, p in seen.items() if p.can_end()}
    grew = True
    while grew:
        grew = False
        for s, nexts in edges.items():
            if s not in live and any(n in live for n in nexts):
                live.add(s)
                grew = True
    if len(live) < len(seen):
        raise cannot("pattern", path, f"{pattern!r} can reach a point where no text the parser writes (printable "
                                      "ASCII, no quote or backslash) completes it")
    return pattern


def _string(node: dict, path: str, doc: _Doc) -> dict:
    out = {"type": "string"}
    for key in ("contentEncoding", "contentMediaType", "contentSchema"):
        if key in node:
            raise cannot(key, path, "the parser does not check a string's content")
    lo, hi = _number(node, "minLength", path, whole=True), _number(node, "maxLength", path, whole=True)
    pattern = node.get("pattern")
    if "format" in node:
        if node["format"] not in FORMATS:
            raise cannot("format", path, f"'{node['format']}' is not held (held: {', '.join(FORMATS)}, as patterns)")
        if pattern is not None or lo is not None or hi is not None:
            raise cannot("format", path, "a format beside 'pattern', 'minLength' or 'maxLength'")
        return {"type": "string", "pattern": FORMATS[node["format"]]}
    if lo is not None and hi is not None and lo > hi:
        raise unmeetable(path, f"'minLength' {lo} is more than 'maxLength' {hi}")
    if pattern is not None:
        if lo or hi is not None:
            raise cannot("pattern", path, "a pattern beside 'minLength' or 'maxLength' (the parser holds one or "
                                          "the other)")
        return out | {"pattern": _pattern(pattern, path, doc)}
    if hi is not None:
        # the parser leaves a string's leading spaces uncounted, as many as it allows in a row: a
        # maxLength that leaves room for them is held natively that much lower (its free-text path is
        # fast); a shorter one by a pattern whose first character is not a space (a pattern costs a
        # walk of the vocabulary per character written)
        if hi == 0:
            return {"enum": [""]}
        spaces = _spaces_in_a_row()
        if hi - spaces >= max(lo or 0, 1):
            return out | {"maxLength": hi - spaces} | ({"minLength": lo} if lo else {})
        first = max(lo or 0, 1) - 1
        body = f"[!-~][ -~]{{{first},{hi - 1}}}"
        return out | {"pattern": body if lo else f"({body})?"}
    return out | ({"minLength": lo} if lo else {})


def _spaces_in_a_row() -> int:
    try:
        from lmformatenforcer import CharacterLevelParserConfig
    except ImportError:
        return 12  # its default
    return CharacterLevelParserConfig().max_consecutive_whitespaces


def _object(node: dict, path: str, children: list) -> dict:
    props, required = node.get("properties"), node.get("required", [])
    # all of a schema's keys are its own here (allOf and anyOf merged into it): those unevaluated
    # are those additionalProperties would take
    extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
    if props is not None and not isinstance(props, dict):
        raise unusable(path, "'properties' must be an object")
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise unusable(path, "'required' must be a list of strings")
    for key in ("patternProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies"):
        if key in node:
            raise cannot(key, path, "the parser holds only 'properties', 'required' and 'additionalProperties'")
    if props is None and not required and extra is not False:  # a dictionary: any keys
        if "minProperties" in node or "maxProperties" in node:
            key = "minProperties" if "minProperties" in node else "maxProperties"
            raise cannot(key, path, "the number of keys is held only where 'properties' lists them")
        out = {"type": "object"}
        if extra is not True:
            children.append((extra, _where(path, "additionalProperties"), out, "additionalProperties"))
        return out
    props = dict(props or {})
    for k in required:  # a required key not listed takes the additionalProperties schema
        if k not in props:
            if extra is False:
                raise unmeetable(path, f"'required' '{k}' is not in 'properties' and 'additionalProperties' is false")
            props[k] = extra
    props = {k: v for k, v in props.items() if v is not False or k in required}
    # the parser writes only the listed keys: every one of them is evaluated, so these hold
    lo, hi = _number(node, "minProperties", path, whole=True), _number(node, "maxProperties", path, whole=True)
    if lo is not None and lo > len(required):
        raise cannot("minProperties", path, "more keys than 'required' names (the parser holds 'required')")
    if hi is not None and hi < len(props):
        raise cannot("maxProperties", path, "fewer keys than 'properties' lists (the parser holds 'properties')")
    out = {"type": "object", "properties": {}}
    for k, v in props.items():
        if not _text_ok(k):
            raise cannot("properties", path, f"the key {json.dumps(k)} holds a quote, a backslash or a control "
                                              "character, or starts with whitespace: the parser cannot write it")
        out["properties"][k] = None
        children.append((v, _where(_where(path, "properties"), k), out["properties"], k))
    if required:
        out["required"] = list(dict.fromkeys(required))
    return out


def _array(node: dict, path: str, children: list) -> dict:
    items = node.get("items", True)
    if isinstance(items, list) or "prefixItems" in node:
        raise cannot("prefixItems" if "prefixItems" in node else "items", path,
                     "tuples (a schema per position): the parser holds one 'items' schema for all")
    if "contains" in node:
        raise cannot("contains", path, "the parser holds one 'items' schema for all items")
    if node.get("unevaluatedItems", True) is not True and "items" not in node:
        raise cannot("unevaluatedItems", path, "give 'items' instead")
    lo, hi = _number(node, "minItems", path, whole=True), _number(node, "maxItems", path, whole=True)
    if lo is not None and hi is not None and lo > hi:
        raise unmeetable(path, f"'minItems' {lo} is more than 'maxItems' {hi}")
    if items is False:
        if lo:
            raise unmeetable(path, f"'items' is false (no items) and 'minItems' is {lo}")
        hi = 0
    if node.get("uniqueItems") is True and (hi is None or hi > 1):
        raise cannot("uniqueItems", path, "the parser does not compare items (allowed with 'maxItems' 1)")
    out = {"type": "array"} | ({"minItems": lo} if lo else {}) | ({"maxItems": hi} if hi is not None else {})
    if items not in (True, False):
        children.append((items, _where(path, "items"), out, "items"))
    return out


def _node(node, path: str, doc: _Doc, children: list, refs: list) -> dict:
    """One schema's held form; the subschemas it holds go to ``children`` (the node to rewrite,
    where, the dict and key its form goes to), its $ref targets to ``refs``."""
    if node is True:
        return dict(ANY)
    if node is False:
        raise unmeetable(path, "the schema false, which nothing meets")
    if not isinstance(node, dict):
        raise unusable(path, f"a schema must be a JSON object, got {type(node).__name__}")
    for key in node:
        if key in NEVER:
            raise cannot(key, path, NEVER[key])
        if key not in KNOWN and not key.startswith("x-"):
            raise cannot(key, path, "it is not a keyword speculant knows (a misspelling?)")
    node = _old_exclusive(node)
    rules = {k: v for k, v in node.items() if k not in DESCRIPTIVE and not k.startswith("x-")}
    if "$ref" in rules and len(rules) == 1:
        target, value = doc.resolve(rules["$ref"], path)
        if target not in doc.names:
            doc.names[target] = f"{doc.prefix}{len(doc.names)}"
            refs.append((value, target))
        return {"$ref": f"#/$defs/{doc.names[target]}"}
    if "allOf" in rules or "$ref" in rules:  # merged into one schema, rewritten again
        members = rules.get("allOf", [])
        if not isinstance(members, list) or ("allOf" in rules and not members):
            raise unusable(path, "'allOf' must be a non-empty list of schemas")
        rest = {k: v for k, v in rules.items() if k != "allOf"}
        flat = _flatten(members + [rest], doc, path + "/allOf")
        if sum(1 for m in flat for k in ("anyOf", "oneOf") if k in m) > 1:
            raise cannot("allOf", path, "its members hold more than one 'anyOf'/'oneOf'")
        merged = flat[0] if flat else {}
        for m in flat[1:]:
            merged = _merge(merged, m, path)
        children.append((merged, path, None, None))
        return {}
    for key in ("anyOf", "oneOf"):
        if key in rules:
            options = rules[key]
            if not isinstance(options, list) or not options:
                raise unusable(path, f"'{key}' must be a non-empty list of schemas")
            if "anyOf" in rules and "oneOf" in rules:
                raise cannot("oneOf", path, "beside 'anyOf' (give one of them)")
            if key == "oneOf":
                for i, a in enumerate(options):
                    for j in range(i):
                        if not _disjoint(options[j], a, doc):
                            raise cannot("oneOf", path, f"its options {j} and {i} may both match a value (held: "
                                                        "options told apart by type, by value, or by a required "
                                                        "property of different values)")
            rest = {k: v for k, v in rules.items() if k != key}
            out = {"anyOf": [None] * len(options)}
            for i, option in enumerate(options):  # the keywords beside anyOf go into each option
                children.append(({"allOf": [rest, option]} if rest else option, _where(_where(path, key), i),
                                 out["anyOf"], i))
            return out
    if "const" in rules:
        enum = [rules["const"]]
        if "enum" in rules:
            keys = {_key(v) for v in rules["enum"]} if isinstance(rules["enum"], list) else set()
            enum = [v for v in enum if _key(v) in keys]
        rules = {k: v for k, v in rules.items() if k != "const"} | {"enum": enum}
    if "enum" in rules:
        if not isinstance(rules["enum"], list):
            raise unusable(path, "'enum' must be a list")
        values = [v for v in rules["enum"] if _meets(v, rules, path)]
        if not values:
            raise unmeetable(path, "no value of 'enum'/'const' meets the schema's other keywords" if rules["enum"]
                             else "'enum' is empty")
        return _enum_node(values, path)
    types = _types(rules, path)
    if types is None:  # no type: those its keywords apply to (narrower than JSON Schema's "any", and met)
        types = {t for t, keys in FAMILY.items() if keys & set(rules)} or set(TYPES) - {"integer"}
    if "integer" in types and "number" in types:
        types.discard("integer")
    if len(types) > 1:  # one option per type, each with its own keywords (the parser drops them)
        order = [t for t in TYPES if t in types]
        out = {"anyOf": [None] * len(order)}
        for i, t in enumerate(order):
            family = FAMILY.get("number" if t == "integer" else t, set())
            children.append(({"type": t} | {k: v for k, v in rules.items() if k in family}, path, out["anyOf"], i))
        return out
    (t,) = types
    if t == "string":
        return _string(rules, path, doc)
    if t in ("integer", "number"):
        return _bounded_numbers(rules, t == "integer", path) or {"type": t}
    if t == "object":
        return _object(rules, path, children)
    if t == "array":
        return _array(rules, path, children)
    return {"type": t}


def _eager_cycle(root: dict, defs: dict) -> str | None:
    """A $defs name whose schema reaches itself through anyOf and $ref alone, before any value
    starts: the parser would build it forever."""
    def eager(node):  # the names a schema's parser builds at once
        todo, names = [node], []
        while todo:
            n = todo.pop()
            if "$ref" in n:
                names.append(n["$ref"].rsplit("/", 1)[-1])
            todo.extend(n.get("anyOf", []))
        return names

    for start in defs:
        seen, todo = set(), eager(defs[start])
        while todo:
            name = todo.pop()
            if name == start:
                return start
            if name not in seen:
                seen.add(name)
                todo.extend(eager(defs[name]))
    return None


def enforceable(schema: dict, prefix: str = "s") -> dict:
    """``schema`` in the forms the parser holds exactly (the targets of its ``$ref``s in the root's
    ``$defs``, named ``prefix`` and a number), or a SpeculantError naming the first keyword it cannot
    hold or that nothing meets, and where."""
    try:
        return _enforceable(schema, prefix)
    except SpeculantError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:  # a malformed part
        raise SpeculantError(f"unusable JSON schema: a keyword has a value of the wrong kind ({type(e).__name__})") \
            from None


def _enforceable(schema: dict, prefix: str) -> dict:
    doc = _Doc(schema, prefix)
    holder: dict = {}
    defs: dict = {}
    todo: list = [(schema, "#", holder, "root")]
    refs: list = []
    steps = 0
    while todo or refs:
        if not todo:  # a $ref's target: rewritten once, at its own place in the document
            value, target = refs.pop()
            todo.append((value, target, defs, doc.names[target]))
        node, path, into, key = todo.pop()
        steps += 1
        if steps > MAX_STEPS:
            raise SpeculantError(f"the JSON schema takes more than {MAX_STEPS:,} steps to check: send a simpler one")
        children: list = []
        out = _node(node, path, doc, children, refs)
        if into is not None:
            into[key] = out
        for child, where, parent, k in children:
            todo.append((child, where, parent if parent is not None else into, k if parent is not None else key))
    root = dict(holder["root"])
    if defs:
        cycle = _eager_cycle(root, defs)
        if cycle is not None:
            target = next(t for t, n in doc.names.items() if n == cycle)
            raise cannot("$ref", target, "it refers back to itself before any value starts (it would never end)")
        root["$defs"] = defs
    return root
