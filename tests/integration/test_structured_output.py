"""response_format through the real daemon: constrained output always validates
(checked with the jsonschema package), drafting and jump-forward never change
greedy output, and a constraint that does not compile is a typed error."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.experiments.structured import CORPUS, SYSTEM, valid  # the benchmark's corpus, prompt and validity test
from tandem.client import RequestFailed
from tandem.protocol import ErrorCode, FinishReason


def extract(client, item: dict, **kw):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item["text"]}]
    rf = {"type": "json_schema", "json_schema": {"name": "facts", "schema": item["schema"], "strict": True}}
    params = {"temperature": 0.0, "max_tokens": 200, **kw}
    return client.complete(messages=messages, response_format=rf, **params)


@pytest.mark.model  # its daemon fixture is looked up by name, so tests/conftest.py cannot see it
@pytest.mark.parametrize("which", ["smollm2", "coder"])
def test_every_constrained_extraction_validates(which, request):
    """(How often the same requests give valid JSON unconstrained: bench/experiments/structured.py.)"""
    d = request.getfixturevalue("daemon" if which == "smollm2" else "coder_daemon")
    with d.client() as c:
        for item in CORPUS:
            done = extract(c, item)
            assert done.finish_reason == FinishReason.STOP, (item["text"], done.text)
            assert valid(done.text, item["schema"]), (item["text"], done.text)
            assert done.draft is not None and done.draft.forced > 0  # the fixed keys were jumped over


def test_greedy_constrained_output_is_the_same_with_and_without_jump_forward_and_drafting(start_daemon):
    plain = start_daemon("--ctx-size", "1024", "--jump-forward", "off")
    fast = start_daemon("--ctx-size", "1024", "--drafter", "ngram", "--draft-tokens", "4")
    items = CORPUS[:8]
    with plain.client() as a, fast.client() as b:
        for item in items:
            one = extract(a, item)
            assert one.draft is None or one.draft.forced == 0  # every token sampled one by one
            for draft in ("on", "off"):
                other = extract(b, item, draft=draft)
                assert other.text == one.text, (item["text"], draft)
                assert other.draft.forced > 0 and other.usage.completion_tokens == one.usage.completion_tokens


def test_regex_and_grammar_constraints(daemon):
    with daemon.client() as c:
        date = c.complete(
            prompt="The date today is",
            max_tokens=20,
            temperature=0.9,
            seed=3,
            response_format={"type": "regex", "pattern": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"},
        )
        assert date.finish_reason == FinishReason.STOP
        assert len(date.text) == 11 and date.text[5] == "-" and date.text[1:5].isdigit()
        lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
        answer = c.complete(
            prompt="Is water wet?", max_tokens=20, temperature=0.0, response_format={"type": "grammar", "lark": lark}
        )
        assert answer.text in ("The answer is yes.", "The answer is no.")
        obj = c.complete(
            prompt="A JSON object about a cat:", max_tokens=60, temperature=0.0, response_format={"type": "json_object"}
        )
        assert obj.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if obj.finish_reason == FinishReason.STOP:
            assert isinstance(json.loads(obj.text), dict)


def test_a_constrained_request_cut_by_max_tokens_says_length(daemon):
    with daemon.client() as c:
        item = CORPUS[0]
        done = extract(c, item, max_tokens=5)
        assert done.finish_reason == FinishReason.LENGTH and not valid(done.text, item["schema"])
        assert done.incomplete
        whole = extract(c, item)
        assert valid(whole.text, item["schema"]) and not whole.incomplete


def test_a_stop_string_inside_a_constrained_output_says_so_and_incomplete(daemon):
    """The stop string ends the output where the grammar is not complete: finish stop with the string
    that ended it, and incomplete, never an output that passes for a finished one."""
    with daemon.client() as c:
        item = CORPUS[0]
        done = extract(c, item, stop=['":'])
    assert done.finish_reason == FinishReason.STOP and done.stop_sequence == '":'
    assert done.incomplete and not valid(done.text, item["schema"])


@pytest.mark.parametrize(
    "rf,field",
    [
        ({"type": "regex", "pattern": "(unclosed"}, "response_format.pattern"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "json_schema.schema"),
        ({"type": "grammar", "lark": "start: undefined_rule"}, "response_format.lark"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_before_decoding(daemon, rf, field):
    with daemon.client() as c:
        before = c.status().tokens.get("completion", 0)
        with pytest.raises(RequestFailed) as info:
            c.complete(prompt="x", max_tokens=8, response_format=rf)
        assert info.value.code == ErrorCode.BAD_CONSTRAINT and field in info.value.message
        assert c.status().tokens.get("completion", 0) == before  # nothing was decoded
        assert c.complete(prompt="Hello", max_tokens=3, temperature=0.0).usage.completion_tokens > 0


def test_a_malformed_response_format_is_an_invalid_request(daemon):
    with daemon.client() as c:
        for rf in ({"type": "xml"}, {"type": "regex"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
            with pytest.raises(Exception) as info:
                c.complete(prompt="x", response_format=rf)
            assert "response_format" in str(info.value)


def test_the_cli_takes_a_schema_file_a_grammar_file_and_a_regex(tandem_cli, daemon, tmp_path):
    item = CORPUS[0]
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(item["schema"]))
    out = tandem_cli(daemon.socket, "run", "--temperature", "0", "--json-schema", str(schema_file), item["text"])
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), item["schema"])
    grammar = tmp_path / "yesno.lark"
    grammar.write_text('start: "yes" | "no"\n')
    out = tandem_cli(daemon.socket, "run", "--temperature", "0", "--grammar", str(grammar), "Is water wet?")
    assert out.returncode == 0 and out.stdout.strip() in ("yes", "no"), out.stderr
    out = tandem_cli(daemon.socket, "run", "--raw", "--regex", "[0-9]{3}", "Three digits:")
    assert out.returncode == 0 and out.stdout.strip().isdigit() and len(out.stdout.strip()) == 3
    out = tandem_cli(daemon.socket, "run", "--json-schema", str(tmp_path / "missing.json"), "x")
    assert out.returncode != 0 and "missing.json" in out.stderr


def test_a_grammar_llguidance_fails_on_is_an_error_not_a_finished_answer(daemon):
    """llguidance's limits show as an error state that reads as 'stopped': the
    daemon must not report that as a complete, matching output."""
    with daemon.client() as c:
        with pytest.raises(RequestFailed) as info:
            c.complete(prompt="x", max_tokens=8, response_format={"type": "grammar", "lark": 'start: "a" start'})
        assert info.value.code == ErrorCode.BAD_CONSTRAINT and "response_format" in info.value.message
        assert c.complete(prompt="Hello", max_tokens=3, temperature=0.0).usage.completion_tokens > 0


def test_response_format_fields_of_the_wrong_type_are_refused_by_the_client(daemon):
    from tandem.client import InvalidRequest

    with daemon.client() as c:
        for rf in ({"type": "json_schema", "json_schema": "x"}, {"type": "regex", "pattern": 5}, {"kind": "x"}):
            with pytest.raises(InvalidRequest, match="response_format"):
                c.complete(prompt="x", response_format=rf)
