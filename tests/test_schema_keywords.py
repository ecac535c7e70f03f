"""Structured output is valid or refused, keyword by keyword (speculant/schema_keywords.py):

- what nothing can meet (minLength > maxLength, minItems > maxItems, minimum > maximum, enum []) is a
  400 naming the keyword and where it is, never invalid JSON with finish_reason "stop";
- what lm-format-enforcer does not hold (format: email, not, patternProperties, a minimum without a
  maximum, ...) is a 400 naming it, never silently ignored;
- what is rewritten into held forms (an integer range into an enum, const, allOf, oneOf told apart,
  a type list, maxLength) is exact: the parser takes a text iff JSON Schema does;
- tool parameters with $defs/$ref (pydantic's) give valid tool_calls through "required";
- an ordinary schema works as before.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

import speculant
from speculant.errors import SpeculantError
from helpers import H, Served, assert_openai_error, chat, post_json

lmfe = pytest.importorskip("lmformatenforcer")
from speculant.schema_keywords import enforceable  # noqa: E402


def parser_takes(schema: dict, text: str) -> bool:
    """Whether lm-format-enforcer's parser, fed ``text`` a character at a time, takes it whole."""
    p = lmfe.JsonSchemaParser(schema)
    for c in text:
        if c not in p.get_allowed_characters():
            return False
        p = p.add_character(c)
    return p.can_end()


def valid(schema: dict, value) -> bool:
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return checker.is_valid(value)


# ---- refused up front: nothing meets it, or the parser does not hold it ----
UNMEETABLE = [
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 3}}}, "minLength",
     "#/properties/a"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 4, "maxItems": 2}, "minItems", "#"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 9, "maximum": 3}}}, "minimum",
     "#/properties/n"),
    ({"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": 2, "maximum": 2}}},
     "exclusiveMinimum", "#/properties/x"),
    ({"type": "object", "properties": {"e": {"enum": []}}}, "enum", "#/properties/e"),
    ({"type": "object", "properties": {"e": {"type": "string", "enum": [1, 2]}}}, "enum", "#/properties/e"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf", "#"),
    ({"type": "object", "required": ["k"], "additionalProperties": False}, "required", "#"),
    ({"type": "object", "properties": {"i": {"type": "integer", "minimum": 1.2, "maximum": 1.8}}}, "minimum",
     "#/properties/i"),
]

UNHELD = [
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5}}}, "minimum", "#/properties/a"),
    ({"type": "number", "minimum": 0, "maximum": 1}, "minimum", "#"),
    ({"type": "object", "properties": {"m": {"type": "string", "format": "email"}}}, "format", "#/properties/m"),
    ({"not": {"type": "string"}}, "not", "#"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if", "#"),
    ({"type": "object", "patternProperties": {"^x": {"type": "string"}}}, "patternProperties", "#"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired", "#"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "#"),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "prefixItems", "#"),
    ({"type": "integer", "minimum": 0, "maximum": 100000}, "minimum", "#"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "#"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}, "pattern", "#"),
    ({"type": "string", "pattern": "^a\\sb$"}, "pattern", "#"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLenght": 3}}}, "maxLenght", "#/properties/a"),
    ({"$ref": "https://example.com/schema.json"}, "$ref", "#"),
    ({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}}, "$ref": "#/$defs/A"}, "$ref", "#/$defs/A"),
]


@pytest.mark.parametrize("schema,keyword,where", UNMEETABLE, ids=lambda x: json.dumps(x)[:40] if isinstance(x, dict)
                         else None)
def test_what_nothing_meets_is_refused_naming_the_keyword(schema, keyword, where):
    with pytest.raises(SpeculantError, match="cannot be met") as e:
        enforceable(schema)
    assert f"at {where}:" in str(e.value) and (keyword in str(e.value) or "enum" in str(e.value)), e.value


@pytest.mark.parametrize("schema,keyword,where", UNHELD, ids=lambda x: json.dumps(x)[:40] if isinstance(x, dict)
                         else None)
def test_what_the_parser_does_not_hold_is_refused_naming_the_keyword(schema, keyword, where):
    with pytest.raises(SpeculantError, match="cannot enforce") as e:
        enforceable(schema)
    assert f"uses '{keyword}' at {where}," in str(e.value), e.value


def test_the_walk_is_iterative():
    deep = {"type": "string"}
    for _ in range(15_000):  # past Python's stack (the server refuses past 64 levels before this walk)
        deep = {"type": "array", "items": deep}
    out = enforceable(deep)
    for _ in range(15_000):
        out = out["items"]
    assert out == {"type": "string"}


# ---- rewritten: the parser takes a text iff JSON Schema does ----
def exact_on(schema: dict, texts, also=()) -> None:
    """The parser takes each of ``texts`` iff JSON Schema does, and none of ``also`` that JSON Schema
    refuses (other spellings of a value, which it may refuse where they are valid: narrower is met)."""
    held = enforceable(schema)
    for text in [*texts, *also]:
        try:
            value = json.loads(text)
        except ValueError:
            value = ...
        expected = value is not ... and valid(schema, value)
        if text in texts:
            assert parser_takes(held, text) == expected, (schema, held, text)
        else:
            assert not parser_takes(held, text) or expected, (schema, held, text)


def test_integer_bounds_become_an_exact_enum():
    numbers, spellings = [str(n) for n in range(-20, 40)], ["5.0", "6.5", "1e1", "-0", "07", "1.5", '"5"']
    for schema in ({"type": "integer", "minimum": 5, "maximum": 7},
                   {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 12, "multipleOf": 3},
                   {"type": "integer", "minimum": 4.5, "maximum": 30, "multipleOf": 5},
                   {"type": "number", "minimum": 0, "maximum": 20, "multipleOf": 2},
                   {"type": "integer", "minimum": 1, "exclusiveMaximum": 3}):
        exact_on(schema, numbers, spellings)
    assert enforceable({"type": "integer", "minimum": 1, "maximum": 3, "exclusiveMinimum": True}) == {"enum": [2, 3]}


def test_const_enum_type_lists_and_strings_are_exact():
    texts = ['"a"', '"ab"', '" ab"', '"abc"', '"abcd"', '""', "null", "true", "false", "1", "2", "1.5", '"x"', "[]",
             '"2024-02-28"', '"2023-13-01"', '"2024-04-31"', '"10.0.0.255"', '"10.0.0.256"']
    for schema in ({"const": "ab"}, {"const": 2}, {"enum": [True, False, None, "x", 1.5]},
                   {"type": ["string", "null"], "maxLength": 3}, {"type": "string", "minLength": 2, "maxLength": 3},
                   {"type": ["integer", "boolean"], "minimum": 1, "maximum": 2}, {"type": "string", "format": "date"},
                   {"type": "string", "format": "ipv4"}, {"enum": ["a", "ab", 1], "type": "string", "maxLength": 1}):
        held = enforceable(schema)
        for text in texts:  # the parser never takes what JSON Schema refuses
            if parser_takes(held, text):
                assert valid(schema, json.loads(text)), (schema, held, text)
    exact_on({"const": "ab"}, texts)
    exact_on({"enum": [True, False, None, "x", 1.5]}, texts)
    exact_on({"type": ["string", "null"], "maxLength": 3}, [t for t in texts if not t.startswith('" ')])
    # the parser's own maxLength leaves a string's leading spaces uncounted: rewritten, they count
    assert parser_takes({"type": "string", "maxLength": 3}, '"   abc"')
    assert not parser_takes(enforceable({"type": "string", "maxLength": 3}), '"   abc"')
    for n in (19, 20, 21):  # a longer one: held natively, 12 lower (the spaces it may skip)
        text = '"' + " " * 12 + "a" * (n - 12) + '"'
        assert parser_takes({"type": "string", "maxLength": 20}, text)
        assert parser_takes(enforceable({"type": "string", "maxLength": 20}), text) == (n <= 20)


def test_allof_oneof_and_refs_are_merged_exactly():
    schema = {
        "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer",
                                                                                                "minimum": 1,
                                                                                                "maximum": 9}},
                          "required": ["kind", "lives"], "additionalProperties": False},
                  "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"],
                          "additionalProperties": False},
                  "Named": {"type": "object", "properties": {"name": {"enum": ["a", "b"]}}, "required": ["name"]}},
        "type": "object",
        "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]},
                       "owner": {"allOf": [{"$ref": "#/$defs/Named"},
                                           {"properties": {"age": {"type": "integer", "minimum": 0, "maximum": 3}},
                                            "required": ["age"]}]}},
        "required": ["pet", "owner"], "additionalProperties": False}
    texts = ['{"pet":{"kind":"cat","lives":3},"owner":{"name":"a","age":2}}',
             '{"pet":{"kind":"dog"},"owner":{"age":0,"name":"b"}}',
             '{"pet":{"kind":"cat","lives":10},"owner":{"name":"a","age":2}}',
             '{"pet":{"kind":"dog","lives":1},"owner":{"name":"a","age":2}}',
             '{"pet":{"kind":"dog"},"owner":{"name":"c","age":2}}',
             '{"pet":{"kind":"dog"},"owner":{"name":"a","age":4}}',
             '{"pet":{"kind":"dog"},"owner":{"name":"a"}}']
    exact_on(schema, texts)


# ---- through the server: a tiny model whose tokens are the printable characters ----
@pytest.fixture(scope="module")
def served_chars(tmp_path_factory):
    from helpers import tiny_llama
    from test_hardening import save_char_folder

    folder = save_char_folder(tmp_path_factory.mktemp("chars") / "chars", seed=1)
    tiny_llama(1, vocab=97, eos=1, context=1024).save_pretrained(folder)  # room for 400 tokens
    gen = speculant.load(str(folder), drafter="ngram", device="cpu", dtype="float32")
    # a template that takes the tools (and shows none of them): the prompt stays short
    gen.tokenizer.chat_template = "{# tools #}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n" \
                                  "{% endfor %}assistant:"
    s = Served(gen)
    yield s
    s.close()


def ask(url, schema=None, **kw):
    body = chat(messages=[{"role": "user", "content": "answer in JSON"}], max_tokens=200, temperature=0) | kw
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return post_json(url + H, body)


def test_unmeetable_and_unheld_schemas_are_a_400_naming_the_keyword(served_chars):
    url = served_chars.url
    err = assert_openai_error(ask(url, UNMEETABLE[0][0]), 400, "response_format")
    assert err["param"] == "response_format" and "'minLength' 5" in err["message"], err
    assert "#/properties/a" in err["message"], err
    err = assert_openai_error(ask(url, UNHELD[0][0]), 400, "response_format")
    assert "'minimum' at #/properties/a" in err["message"], err
    tool = {"type": "function", "function": {"name": "mail", "parameters": UNHELD[2][0]}}
    err = assert_openai_error(ask(url, tools=[tool], tool_choice="required"), 400, "tools")
    assert err["param"] == "tools" and "tools.0.function.parameters" in err["message"] and \
        "'format' at #/properties/m" in err["message"], err


def outputs(r) -> list:
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert all(c["finish_reason"] == "stop" for c in choices), choices
    return [json.loads(c["message"]["content"]) for c in choices]


def test_rewritten_keywords_give_output_that_meets_them(served_chars):
    schema = {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 5, "maximum": 7},
        "b": {"type": "integer", "exclusiveMinimum": 0, "maximum": 40, "multipleOf": 10},
        "c": {"const": "yes"}, "d": {"type": ["boolean", "null"]},
        "e": {"type": "string", "maxLength": 3},
        "f": {"allOf": [{"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]},
                        {"properties": {"y": {"type": "integer", "minimum": -1, "maximum": 1}}, "required": ["y"]}]}},
        "required": ["a", "b", "c", "d", "e", "f"], "additionalProperties": False}
    got = outputs(ask(served_chars.url, schema, max_tokens=400))
    for seed in range(3):
        got += outputs(ask(served_chars.url, schema, temperature=1.0, seed=seed, n=2, max_tokens=400))
    for value in got:
        jsonschema.validate(value, schema)
        assert 5 <= value["a"] <= 7 and value["b"] in (10, 20, 30, 40) and len(value["e"]) <= 3


def test_tool_parameters_with_defs_give_valid_tool_calls(served_chars):
    place = {"$defs": {"Unit": {"enum": ["c", "f"], "title": "Unit"},
                       "Place": {"type": "object", "title": "Place",
                                 "properties": {"zip": {"type": "integer", "minimum": 10, "maximum": 20},
                                                "unit": {"$ref": "#/$defs/Unit"}},
                                 "required": ["zip", "unit"], "additionalProperties": False}},
             "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
             "additionalProperties": False}
    other = {"$defs": {"Unit": {"type": "boolean"}}, "type": "object",  # the same $defs name, another schema
             "properties": {"on": {"$ref": "#/$defs/Unit"}}, "required": ["on"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": place}},
             {"type": "function", "function": {"name": "lamp", "parameters": other}}]
    params = {"weather": place, "lamp": other}
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 3},
               {"tool_choice": {"type": "function", "function": {"name": "weather"}}}):
        body = {"tool_choice": "required", "max_tokens": 300} | kw
        r = ask(served_chars.url, tools=tools, **body)
        assert r.status_code == 200, r.text[:300]
        for c in r.json()["choices"]:
            assert c["finish_reason"] in ("tool_calls", "stop") and c["message"]["content"] is None, c
            call = c["message"]["tool_calls"][0]["function"]
            jsonschema.validate(json.loads(call["arguments"]), params[call["name"]])


def test_an_ordinary_schema_works_as_before(served_chars):
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                        "maxItems": 2},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "tags", "ok"], "title": "Thing", "description": "a thing"}
    r = ask(served_chars.url, schema, max_tokens=400)
    assert r.status_code == 200, r.text[:300]
    c = r.json()["choices"][0]
    if c["finish_reason"] == "stop":  # a random model may write a long name: cut short is "length"
        jsonschema.validate(json.loads(c["message"]["content"]), schema)
    else:
        assert c["finish_reason"] == "length" and c["message"]["content"].lstrip().startswith("{")
