"""Multi-key needle-in-a-haystack retrieval (RULER-style) under each KV format.

``weightszip eval niah --model M --formats bf16,fp8,int4-g32,kivi-2 --length N --n K [--seed S]``

Prompts. A haystack of real text (Paul Graham's essays by default, or ``--text``) holds
``keys + distractors`` needles "The special magic number for KEY is: VALUE." (KEY an
adjective-noun pair, VALUE a 7-digit number), inserted at sentence boundaries at random depths.
The question asks for the numbers of the ``keys`` queried needles; the distractors are needles
with other keys. The prompt (chat template, instruction, haystack, needles, question, and the
start of the answer "The special magic number for KEY is: ") is exactly ``--length`` tokens.
Everything is drawn from ``random.Random`` streams seeded by (seed, variant, prompt index), so a
seed gives the same prompts, answers and depths every time, and prompt i does not depend on --n.

Answers. Greedy decoding, scored by exact match: the answer must start with VALUE, not followed
by another digit, with nothing before it (the prompt ends with the answer's own beginning, "The
special magic number for KEY is: ", so a model that retrieves the number writes it at once).
With several queried keys the answer block is canonical between the numbers
("VALUE.\\nThe special magic number for KEY2 is: "); the model generates each number greedily
after the canonical block so far, and a prompt is correct when all its numbers are. Every
format answers the same prompts.

Decoding with a format (how, and why it is exact). Each forward runs inside
``weightszip.eval.kl.kv_format``: in every attention layer each query sees exactly the K/V the
format hands back (round-tripped, except the tokens a format keeps in bf16: sinks and a recent
window that moves with the query). That hook runs whole sequences without a cache, so a new
token costs a forward over prompt + generated tokens. Instead of one forward per new token, one
forward runs over the prompt plus the expected answer block (speculative verification with the
correct answer as the draft): the greedy token at each position is the argmax there, and as long
as the greedy tokens equal the draft, the positions that follow are exactly what one forward per
token would compute (the model and the formats are causal). The first token that differs decides
the answer wrong, unless it spells the same text in other tokens (then decoding goes on, one
forward per token). So each (prompt, format) costs one forward, and the result equals
token-by-token greedy decoding with the format applied to the prompt and to every new token
(tests/test_eval_niah.py checks this against one forward per token). One caveat, shared
with ``eval kl``: statistics that span tokens (fp8's per-head amax) are taken over the sequence
of the forward, i.e. the prompt plus the answer block.

Variant. Unless ``--variant`` is given, a bf16 pilot on prompts of its own (a separate random
stream, never scored) tries the variants from hardest to easiest (default 4x4, 2x2, 1x3, 1x1,
1x0: queried keys x distractors) and keeps the first on which bf16 answers at least 80% of the
pilot prompts (stopping a variant as soon as it cannot, or surely does, reach that). If none
does, the easiest is used and the report says so.

Statistics. Accuracy with a 95% Wilson score interval. Each format against bf16 (and against
int4-g32 when both run): the paired difference in accuracy on the same prompts with Newcombe's
hybrid score interval for paired proportions (Newcombe 1998, Stat Med 17:2635, method 10) and
the exact (binomial) McNemar p-value. The paired bootstrap and the exact conditional interval
both collapse to [0, 0] when no prompt is discordant, which at n = 20 says far more than the
data do; Newcombe's interval stays honest there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from weightszip.cli_args import positive_int, thread_count, torch_device
from weightszip.eval.stats import Z95, mcnemar_exact_p, newcombe_paired, paired_difference, wilson

INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)
NEEDLE = "The special magic number for {key} is: {value}."
ANSWER_PREFIX = "The special magic number for {key} is:"
SLOT_SEPARATOR = ".\n"
PLACEHOLDER = "\x00HAYSTACK\x00"
DEFAULT_LADDER = "4x4,2x2,1x3,1x1,1x0"
DEFAULT_FORMATS = "bf16,fp8,int4-g32,kivi-2"
DEFAULT_PILOT = 5
DEFAULT_THRESHOLD = 0.8
DEFAULT_MAX_NEW = 12  # tokens per number: 7 digits (and a space) with some to spare
SNAP_TOKENS = 64  # a needle moves at most this far to reach a sentence boundary
MAX_CORPUS_CHARS = 4_000_000

ADJECTIVES = (
    "amber ancient bitter bold brave bright brisk calm clever cold crimson curious damp dark eager "
    "early faint fierce gentle giant golden hollow humble icy idle jolly keen lazy little lively "
    "lonely loud lucky mellow merry misty modest narrow noble odd pale patient plain polite proud "
    "quick quiet rapid rare rough royal rusty silent silver simple sleepy slow smooth solid spare "
    "steady sticky stormy strange sunny swift tame tidy tiny vivid warm wild windy wise young"
).split()
NOUNS = (
    "anchor apple arrow badge barrel basket beacon bell blanket bottle bridge bucket button cabin "
    "camera candle canyon carpet castle cellar chair cloud compass copper cottage crystal desert "
    "diamond drum eagle engine falcon feather fence forest fountain garden glacier guitar hammer "
    "harbor helmet island jacket kettle ladder lantern lemon magnet meadow mirror monkey needle "
    "orchard otter paddle parrot pencil pepper pillow planet pocket rabbit river rocket saddle "
    "shovel spider statue tiger tunnel valley violin wagon whistle window"
).split()


# ------------------------------------------------------------------------------- the prompts


@dataclass(frozen=True)
class Variant:
    keys: int  # needles whose numbers are asked for
    distractors: int  # needles with other keys, not asked for

    @property
    def name(self) -> str:
        return f"{self.keys}x{self.distractors}"

    def describe(self) -> str:
        k = "key" if self.keys == 1 else "keys"
        d = "distractor" if self.distractors == 1 else "distractors"
        return f"{self.keys} queried {k} + {self.distractors} {d}"


def parse_variant(s: str) -> Variant:
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", s)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"a variant is KEYSxDISTRACTORS with KEYS >= 1 (e.g. 2x2), not {s!r}")
    return Variant(int(m.group(1)), int(m.group(2)))


@dataclass
class Corpus:
    """Haystack text as token ids; ``boundary[i]`` is 1 where token i follows the end of a
    sentence on the same line, 2 where it starts a line after a sentence end or a blank line."""

    ids: list[int]
    boundary: bytearray
    source: str
    files: list[str]


def package_text() -> Path:
    """The haystack when no other is found: the folder of the public-domain excerpt the package ships
    (weightszip/data: carroll-alice-excerpt.txt, about 11k tokens)."""
    return Path(__file__).resolve().parent.parent / "data"


def default_text() -> Path:
    """$WEIGHTSZIP_NIAH_TEXT, else ../shared/data/text/paul_graham as seen from the working directory
    (or the package's folders), else the text the package ships (``package_text()``)."""
    env = os.environ.get("WEIGHTSZIP_NIAH_TEXT")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for base in [Path.cwd(), *here.parents]:
        for cand in (base / ".." / "shared" / "data" / "text" / "paul_graham", base / "shared" / "data" / "text" / "paul_graham"):
            if cand.is_dir():
                return cand.resolve()
    # Installed without the project's shared texts: the public-domain text the package ships.
    return package_text()


def text_files(path: Path) -> list[Path]:
    """The haystack's files in reading order (a file, or a folder's .txt, .md and suffix-less files by name)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".md", ""))
        if not files:
            raise FileNotFoundError(f"no .txt or .md files in {path}")
        return files
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"no such file or folder: {path}")


def wrap_note(corpus: "Corpus", prompts) -> str | None:
    """A note when a prompt's haystack is longer than the corpus, so it repeats the text (the
    haystack wraps around the corpus), or None."""
    need = max((p.haystack_tokens for p in prompts), default=0)
    if need <= len(corpus.ids):
        return None
    return (f"note: the prompts' haystack (up to {need:,} tokens) is longer than the haystack text ({len(corpus.ids):,} "
            f"tokens of {corpus.source}): each prompt repeats the text, {need / len(corpus.ids):.2f} times; "
            "give a longer --text for prompts that do not")


def _read_texts(path: Path, max_chars: int) -> tuple[str, list[str]]:
    files = text_files(path)
    pieces, used, n = [], [], 0
    for p in files:
        t = p.read_text(encoding="utf-8", errors="replace").strip()
        if not t:
            continue
        pieces.append(t)
        used.append(str(p))
        n += len(t) + 2
        if n >= max_chars:
            break
    return "\n\n".join(pieces), used


def load_corpus(tok, path: str | os.PathLike | None = None, max_chars: int = MAX_CORPUS_CHARS) -> Corpus:
    """Read a text file, or a folder's text files in name order (up to ``max_chars``), and
    tokenize it once."""
    p = Path(path) if path is not None else default_text()
    text, files = _read_texts(p, max_chars)
    ids = list(tok.encode(text, add_special_tokens=False))
    if len(ids) < 64:
        raise ValueError(f"{p} holds only {len(ids)} tokens of text")
    # Per token: does it end a sentence (. ! ? before closing quotes and spaces), is it only
    # whitespace with a line break (hard-wrapped text breaks lines mid-sentence, so a line start
    # alone is no boundary).
    ends, breaks = {}, {}
    for i in set(ids):
        t = tok.decode([i])
        ends[i] = t.rstrip(" \t\"'\u201d\u2019)").endswith((".", "!", "?"))
        breaks[i] = t.strip() == "" and "\n" in t
    boundary = bytearray(len(ids))
    for j in range(1, len(ids)):
        prev = ids[j - 1]
        if ends[prev]:
            boundary[j] = 1  # after a sentence, on the same line
        elif breaks[prev] and (j < 2 or ends[ids[j - 2]] or breaks[ids[j - 2]] or tok.decode([prev]).count("\n") > 1):
            boundary[j] = 2  # the start of a line after a sentence end or a blank line
    return Corpus(ids=ids, boundary=boundary, source=str(p), files=files)


@dataclass
class Needle:
    key: str
    value: str
    queried: bool
    depth: float  # haystack tokens before the needle / haystack tokens
    token_index: int  # where its tokens start in the prompt
    n_tokens: int
    text: str  # as inserted (with the leading space when there is one)


@dataclass
class Slot:
    """One number to generate: the tokens that precede it in the answer block, its value and the
    value's canonical tokens."""

    key: str
    value: str
    prefix_ids: list[int]  # empty for the first slot: its prefix ends the prompt
    value_ids: list[int]
    lead: str = ""  # " " where the space before the number is not in the prompt (see space_in_prompt)

    @property
    def target(self) -> str:
        """The text the greedy answer must start with."""
        return self.lead + self.value


@dataclass
class NiahPrompt:
    index: int
    variant: Variant
    ids: list[int]  # exactly the requested length
    needles: list[Needle]
    slots: list[Slot]
    question: str
    haystack_offset: int  # where the haystack starts in the corpus, in tokens
    haystack_tokens: int

    def answer_block(self) -> list[int]:
        out: list[int] = []
        for s in self.slots:
            out += s.prefix_ids + s.value_ids
        return out

    def summary(self) -> dict:
        return {
            "index": self.index,
            "variant": self.variant.name,
            "question": self.question,
            "answers": [s.value for s in self.slots],
            "haystack_offset": self.haystack_offset,
            "haystack_tokens": self.haystack_tokens,
            "needles": [
                {k: v for k, v in asdict(n).items() if k != "text"} | {"depth": round(n.depth, 4)} for n in self.needles
            ],
        }


def _prompt_rng(seed: int, stream: str, variant: Variant, index: int) -> random.Random:
    # str seeds go through SHA-512 in CPython: the same on every run and platform.
    return random.Random(f"weightszip-niah|{seed}|{stream}|{variant.name}|{index}")


def _question(keys: list[str]) -> str:
    if len(keys) == 1:
        return f"What is the special magic number for {keys[0]} mentioned in the provided text?"
    listed = ", ".join(keys[:-1]) + f" and {keys[-1]}"
    return (
        f"What are the special magic numbers for {listed} mentioned in the provided text? "
        "Give each one as \"The special magic number for KEY is: NUMBER.\", one per line."
    )


def _bos_ids(tok) -> list[int]:
    with_sp = list(tok.encode("x", add_special_tokens=True))
    without = list(tok.encode("x", add_special_tokens=False))
    k = len(with_sp) - len(without)
    return with_sp[:k] if k > 0 and with_sp[k:] == without else []


def space_in_prompt(tok) -> bool:
    """True when the tokenizer writes " 1234567" as a space token then the digits (SmolLM2, Qwen2.5):
    the prompt then ends with "is: ", exactly as the needle reads, and the answer is the digits
    alone; otherwise the prompt ends with "is:" and the answer is " 1234567"."""
    enc = lambda t: list(tok.encode(t, add_special_tokens=False))  # noqa: E731
    return enc(" 1234567") == enc(" ") + enc("1234567")


def uses_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None)) and hasattr(tok, "apply_chat_template")


def _frame(tok, question: str, first_prefix: str, chat: bool) -> tuple[list[int], list[int]]:
    """Token ids before and after the haystack."""
    if chat:
        content = f"{INSTRUCTION}\n\n{PLACEHOLDER}\n\n{question}"
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        if text.count(PLACEHOLDER) != 1:
            raise RuntimeError("the chat template did not keep the message text intact")
        head, tail = text.split(PLACEHOLDER)
        # The rendered template holds its own special tokens (BOS included where it has one).
        return list(tok.encode(head, add_special_tokens=False)), list(tok.encode(tail + first_prefix, add_special_tokens=False))
    head = f"{INSTRUCTION}\n\n"
    tail = f"\n\n{question}\nAnswer: {first_prefix}"
    return _bos_ids(tok) + list(tok.encode(head, add_special_tokens=False)), list(tok.encode(tail, add_special_tokens=False))


def make_prompt(tok, corpus: Corpus, length: int, variant: Variant, seed: int, index: int, *,
                stream: str = "eval", chat: bool | None = None) -> NiahPrompt:
    """Prompt ``index`` of the (seed, stream, variant) sequence: exactly ``length`` tokens."""
    if chat is None:
        chat = uses_chat_template(tok)
    rng = _prompt_rng(seed, stream, variant, index)
    n_needles = variant.keys + variant.distractors
    if n_needles > min(len(ADJECTIVES), len(NOUNS)):
        raise ValueError(f"at most {min(len(ADJECTIVES), len(NOUNS))} needles")
    adjs = rng.sample(ADJECTIVES, n_needles)
    nouns = rng.sample(NOUNS, n_needles)
    keys = [f"{a}-{b}" for a, b in zip(adjs, nouns)]
    values: list[str] = []
    while len(values) < n_needles:
        v = str(rng.randrange(1_000_000, 10_000_000))
        if v not in values:
            values.append(v)
    queried = rng.sample(range(n_needles), variant.keys)  # in the order they are asked
    depths = [rng.random() for _ in range(n_needles)]
    offset = rng.randrange(len(corpus.ids))

    question = _question([keys[i] for i in queried])
    sp = " " if space_in_prompt(tok) else ""
    head, tail = _frame(tok, question, ANSWER_PREFIX.format(key=keys[queried[0]]) + sp, chat)

    def needle_ids(i: int, kind: int) -> tuple[str, list[int]]:
        t = NEEDLE.format(key=keys[i], value=values[i])
        t = t + "\n" if kind == 2 else " " + t  # its own line at a line start, else after the sentence
        return t, list(tok.encode(t, add_special_tokens=False))

    # Size the haystack for the longer form of each needle, then top it up at the end.
    longest = sum(max(len(needle_ids(i, 1)[1]), len(needle_ids(i, 2)[1])) for i in range(n_needles))
    hay_n = length - len(head) - len(tail) - longest
    if hay_n < 16:
        raise ValueError(f"--length {length} is too short for {variant.describe()} (needs > {length - hay_n + 16} tokens)")
    ids, n_ids = corpus.ids, len(corpus.ids)
    start = next(((offset + j) % n_ids for j in range(n_ids) if corpus.boundary[(offset + j) % n_ids]), offset)
    bnd = [corpus.boundary[(start + j) % n_ids] for j in range(hay_n)] + [0]
    bnd[0] = 2  # right after the instruction's blank line
    positions = []  # nearest boundary to each depth (ties toward the start), else the depth itself
    for d in depths:
        want = round(d * hay_n)
        best = want
        for delta in range(SNAP_TOKENS + 1):
            if 0 <= want - delta <= hay_n and bnd[want - delta]:
                best = want - delta
                break
            if want + delta <= hay_n and bnd[want + delta]:
                best = want + delta
                break
        positions.append(best)
    order = sorted(range(n_needles), key=lambda i: (positions[i], i))
    placed = {i: needle_ids(i, 2 if bnd[positions[i]] == 2 else 1) for i in order}
    hay_n = length - len(head) - len(tail) - sum(len(v[1]) for v in placed.values())
    hay = [ids[(start + j) % n_ids] for j in range(hay_n)]

    out = list(head)
    needles: list[Needle] = []
    prev = 0
    for i in order:
        p = positions[i]
        out += hay[prev:p]
        text, nids = placed[i]
        needles.append(Needle(key=keys[i], value=values[i], queried=i in queried, depth=p / hay_n,
                              token_index=len(out), n_tokens=len(nids), text=text))
        out += nids
        prev = p
    out += hay[prev:]
    out += tail
    assert len(out) == length, (len(out), length)

    slots = []
    lead = "" if sp else " "
    for j, i in enumerate(queried):
        pre = [] if j == 0 else list(tok.encode(SLOT_SEPARATOR + ANSWER_PREFIX.format(key=keys[i]) + sp, add_special_tokens=False))
        slots.append(Slot(key=keys[i], value=values[i], prefix_ids=pre, lead=lead,
                          value_ids=list(tok.encode(lead + values[i], add_special_tokens=False))))
    return NiahPrompt(index=index, variant=variant, ids=out, needles=needles, slots=slots, question=question,
                      haystack_offset=start, haystack_tokens=hay_n)


def make_prompts(tok, corpus: Corpus, length: int, variant: Variant, seed: int, n: int, *,
                 stream: str = "eval", start: int = 0, chat: bool | None = None) -> list[NiahPrompt]:
    return [make_prompt(tok, corpus, length, variant, seed, i, stream=stream, chat=chat) for i in range(start, start + n)]


# ------------------------------------------------------------------------------- answering

def judge(text: str, target: str, finished: bool) -> bool | None:
    """Exact match of a greedy answer so far: True / False once decided, None while undecided.
    The answer must start with ``target`` (the number, after the space where the prompt does not
    end with one), and no digit may follow it. ``finished``: no more tokens will come (EOS or the
    token limit)."""
    if text.startswith(target):
        rest = text[len(target) :]
        if rest:
            return not ("0" <= rest[0] <= "9")
        return True if finished else None
    if target.startswith(text):
        return False if finished else None  # so far so good (only a tokenization unlike the draft gets here)
    return False


@dataclass
class SlotResult:
    key: str
    value: str
    correct: bool
    generated: str  # the greedy tokens up to the decision


@dataclass
class PromptResult:
    correct: bool
    slots: list[SlotResult]
    forwards: int
    seconds: float


def score_prompt(prompt: NiahPrompt, predict, decode, eos_ids: set[int], max_new: int = DEFAULT_MAX_NEW) -> PromptResult:
    """Greedy answers to ``prompt`` through ``predict(ids, keep) -> argmax token of each of the
    last ``keep`` positions``, by verifying the expected answer block (module docstring)."""
    t0 = time.perf_counter()
    base_seq = prompt.ids + prompt.answer_block()
    base_keep = len(base_seq) - len(prompt.ids) + 1
    base_preds = predict(base_seq, base_keep)
    forwards = 1
    results: list[SlotResult] = []
    ctx_len = len(prompt.ids)  # the canonical context of the current slot is base_seq[:ctx_len]
    for slot in prompt.slots:
        ctx_len += len(slot.prefix_ids)

        def text(ids: list[int], lead=slot.lead) -> str:
            # Tokenizers that fold the space into the next token may decode it away on its own.
            t = decode(ids)
            return t[len(lead) :] if lead and t.startswith(lead) else t

        seq, preds, first = base_seq, base_preds, len(base_seq) - base_keep
        gen: list[int] = []
        verdict = None
        while verdict is None:
            p = ctx_len + len(gen) - 1  # the position whose prediction is the next token
            if not (first <= p < len(seq) and seq[ctx_len : p + 1] == gen):
                # Off the draft (the same text in other tokens): context + generated + the rest.
                done = text(gen)
                draft = list(decode.encode(slot.value[len(done) :])) if slot.value.startswith(done) else []
                seq = base_seq[:ctx_len] + gen + draft
                keep = len(gen) + len(draft) + 1
                preds, first = predict(seq, keep), len(seq) - keep
                forwards += 1
            t = preds[p - first]
            finished = t in eos_ids or len(gen) + 1 >= max_new
            if t not in eos_ids:
                gen.append(t)
            verdict = judge(text(gen), slot.value, finished)
        results.append(SlotResult(key=slot.key, value=slot.value, correct=verdict, generated=decode(gen)))
        if not verdict:
            break
        ctx_len += len(slot.value_ids)
    ok = len(results) == len(prompt.slots) and all(r.correct for r in results)
    return PromptResult(correct=ok, slots=results, forwards=forwards, seconds=time.perf_counter() - t0)


class _Decoder:
    """decode(ids) -> text, and .encode(text) -> ids without special tokens."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, ids):
        return self.tok.decode(ids) if ids else ""

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False) if text else []


def eos_token_ids(model, tok) -> set[int]:
    out: set[int] = set()
    for src in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), getattr(tok, "eos_token_id", None)):
        if src is None:
            continue
        out.update([src] if isinstance(src, int) else list(src))
    return out


def format_predictor(model, fmt):
    """predict(ids, keep): argmax of the last ``keep`` positions of one teacher-forced forward in
    which every attention layer sees K/V as ``fmt`` hands them back (``kl.kv_format``)."""
    import torch

    from weightszip.eval.kl import kv_format

    n_attn = sum(1 for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj"))

    def predict(ids: list[int], keep: int) -> list[int]:
        x = torch.tensor([ids], dtype=torch.long, device=model.device)
        with torch.inference_mode(), kv_format(model, fmt) as st:
            logits = model(input_ids=x, use_cache=False, logits_to_keep=keep).logits[0]
        if n_attn and st.calls != n_attn:
            raise RuntimeError(f"the format reached {st.calls} attention layers of {n_attn}")
        return logits.argmax(-1).tolist()

    return predict


# ------------------------------------------------------------------------------- the run


@dataclass
class NiahReport:
    meta: dict
    variant: Variant
    choice: dict
    prompts: list[NiahPrompt]
    results: dict[str, list[PromptResult]]  # format -> per prompt
    formats: list[dict] = field(default_factory=list)
    paired: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        per_prompt = []
        for i, p in enumerate(self.prompts):
            d = p.summary()
            d["results"] = {
                f: {"correct": r[i].correct, "forwards": r[i].forwards, "seconds": round(r[i].seconds, 2),
                    "generated": [s.generated for s in r[i].slots]}
                for f, r in self.results.items()
            }
            per_prompt.append(d)
        return {**self.meta, "variant": {"name": self.variant.name, "keys": self.variant.keys,
                                         "distractors": self.variant.distractors},
                "variant_choice": self.choice, "formats": self.formats, "paired": self.paired, "prompts": per_prompt}


def choose_variant(tok, corpus, predict_bf16, decode, eos, length: int, seed: int, ladder: list[Variant],
                   pilot: int, threshold: float, max_new: int, log) -> tuple[Variant, dict]:
    """The hardest variant of ``ladder`` (hardest first) on which bf16 answers >= threshold of
    ``pilot`` prompts of the pilot stream; stops a variant once the outcome is certain."""
    need = math.ceil(threshold * pilot - 1e-9)
    tried = []
    t0 = time.perf_counter()
    for v in ladder:
        right = run = 0
        for i in range(pilot):
            p = make_prompt(tok, corpus, length, v, seed, i, stream="pilot")
            r = score_prompt(p, predict_bf16, decode, eos, max_new)
            run += 1
            right += r.correct
            if right >= need or right + (pilot - run) < need:
                break
        ok = right >= need
        tried.append({"variant": v.name, "correct": right, "run": run, "accepted": ok})
        log(f"pilot {v.name} ({v.describe()}): bf16 {right}/{run} -> {'accepted' if ok else 'rejected'}")
        if ok:
            return v, {"chosen_by": "pilot", "threshold": threshold, "pilot_prompts": pilot, "tried": tried,
                       "seconds": round(time.perf_counter() - t0, 1)}
    v = ladder[-1]
    log(f"no variant reached {threshold:.0%} on the bf16 pilot; using the easiest, {v.name}")
    return v, {"chosen_by": f"fallback: no variant reached {threshold:.0%} on the bf16 pilot", "threshold": threshold,
               "pilot_prompts": pilot, "tried": tried, "seconds": round(time.perf_counter() - t0, 1)}


def run_niah(lm, formats: list[str], length: int, n: int, *, seed: int = 0, text=None, variant: Variant | None = None,
             ladder: list[Variant] | None = None, pilot: int = DEFAULT_PILOT, threshold: float = DEFAULT_THRESHOLD,
             max_new: int = DEFAULT_MAX_NEW, log=None, on_prompt=None, calibration: dict | None = None) -> NiahReport:
    """``lm``: a ``weightszip.models.LoadedModel``. bf16 is always run (first). ``on_prompt(report)``
    is called with the report so far after each prompt (``meta["partial"]`` true until the end).
    ``calibration``: what the report records of the calibration used (``provenance.describe``)."""
    from weightszip.eval.formats import get_format
    from weightszip.eval.kl import model_kv_shape

    log = log or (lambda s: None)
    t_start = time.perf_counter()
    names = ["bf16"] + [f for f in formats if f != "bf16"]
    fmts = {name: get_format(name) for name in names}  # fail early on an unknown or unavailable format
    model, tok = lm.model, lm.tokenizer
    check_length(model, length)
    decode = _Decoder(tok)
    eos = eos_token_ids(model, tok)
    t0 = time.perf_counter()
    corpus = load_corpus(tok, text)
    t_corpus = time.perf_counter() - t0
    log(f"haystack: {corpus.source} ({len(corpus.files)} files, {len(corpus.ids):,} tokens)"
        + (" -- the excerpt the package ships: ../shared/data/text/paul_graham was not found"
           if text is None and Path(corpus.source) == package_text() else ""))
    predictors = {name: format_predictor(model, f) for name, f in fmts.items()}

    if variant is None:
        variant, choice = choose_variant(tok, corpus, predictors["bf16"], decode, eos, length, seed,
                                         ladder or [parse_variant(s) for s in DEFAULT_LADDER.split(",")],
                                         pilot, threshold, max_new, log)
    else:
        choice = {"chosen_by": "--variant", "threshold": threshold, "pilot_prompts": 0, "tried": [], "seconds": 0.0}
    prompts = make_prompts(tok, corpus, length, variant, seed, n)
    wraps = wrap_note(corpus, prompts)
    if wraps:
        log(wraps)
    _, kv_heads, head_dim = model_kv_shape(model)
    bits = {name: f.bits_per_value(length, head_dim, kv_heads) for name, f in fmts.items()}
    results: dict[str, list[PromptResult]] = {name: [] for name in names}
    t_eval = time.perf_counter()

    def report(done: int) -> NiahReport:
        meta = {
            "model": lm.name, "model_source": lm.source, "length": length, "n": n, "seed": seed,
            "partial": done < n, "prompts_done": done,
            "text": corpus.source, "text_files": len(corpus.files), "corpus_tokens": len(corpus.ids),
            "haystack_repeats_text": wraps is not None, "calibration": calibration,
            "chat_template": uses_chat_template(tok), "max_new_tokens": max_new,
            "decoding": "greedy; each forward inside kl.kv_format (the format on every attention layer, prompt and "
                        "new tokens); verified against the expected answer block: one forward per (prompt, format)",
            "scoring": "exact match: the answer starts with the 7-digit number (nothing before it), no digit after "
                       "it; a prompt is right when all its queried numbers are",
            "intervals": "accuracy: Wilson score 95%; paired difference: Newcombe (1998) hybrid score 95% interval "
                         "for paired proportions (method 10); p: exact two-sided McNemar",
            "seconds": {"load": round(getattr(lm, "load_seconds", 0.0), 1), "corpus": round(t_corpus, 1),
                        "pilot": choice.get("seconds", 0.0), "eval": round(time.perf_counter() - t_eval, 1),
                        "total": round(time.perf_counter() - t_start + getattr(lm, "load_seconds", 0.0), 1)},
        }
        res = {name: r[:done] for name, r in results.items()}
        rows = []
        for name in names:
            c = [r.correct for r in res[name]]
            lo, hi = wilson(sum(c), len(c))
            rows.append({"format": name, "description": fmts[name].description, "bits_per_value": bits[name],
                         "correct": sum(c), "n": len(c), "accuracy": sum(c) / len(c) if c else 0.0,
                         "wilson95": [lo, hi], "seconds": round(sum(r.seconds for r in res[name]), 1),
                         "forwards": sum(r.forwards for r in res[name])})
        paired = []
        for ref in ["bf16"] + (["int4-g32"] if "int4-g32" in names else []):
            for name in names:
                if name not in ("bf16", ref) and done:
                    d = paired_difference([r.correct for r in res[name]], [r.correct for r in res[ref]])
                    paired.append({"format": name, "reference": ref, **d})
        return NiahReport(meta=meta, variant=variant, choice=choice, prompts=prompts[:done], results=res,
                          formats=rows, paired=paired)

    for done, p in enumerate(prompts, 1):
        line = []
        for name in names:
            r = score_prompt(p, predictors[name], decode, eos, max_new)
            results[name].append(r)
            line.append(f"{name} {'ok' if r.correct else 'wrong'} ({r.seconds:.1f} s)")
        log(f"prompt {done}/{n}: " + ", ".join(line))
        if on_prompt is not None and done < n:
            on_prompt(report(done))
    return report(n)


def _diff_cell(p: dict | None) -> str:
    if p is None:
        return "-"
    lo, hi = p["ci95"]
    return f"{p['diff']:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def render(rep: NiahReport) -> str:
    m, v = rep.meta, rep.variant
    tried = ", ".join(f"{t['variant']} {t['correct']}/{t['run']}" for t in rep.choice["tried"])
    how = rep.choice["chosen_by"]
    if tried:
        how += f"; bf16 pilot needs >= {rep.choice['threshold']:.0%} of {rep.choice['pilot_prompts']}: {tried}"
    lines = [
        f"weightszip eval niah: {m['model']}, {m['length']}-token prompts, {m['n']} prompts, seed {m['seed']}",
        f"haystack: {m['text']} ({m['text_files']} files, {m['corpus_tokens']:,} tokens); "
        f"chat template: {'yes' if m['chat_template'] else 'no'}",
        f"variant:  {v.name} = {v.describe()} (chosen by {how})",
        "",
    ]
    vs = {(p["format"], p["reference"]): p for p in rep.paired}
    has_int4 = any(r == "int4-g32" for _, r in vs)
    head = f"{'format':10s} {'bits/value':>10s} {'correct':>8s}  {'accuracy [95% CI]':19s}  {'vs bf16 [95% CI]':21s} {'McNemar p':>9s}"
    if has_int4:
        head += f"  {'vs int4-g32 [95% CI]':21s}"
    head += f" {'seconds':>8s}"
    lines += [head, "-" * len(head)]
    for r in rep.formats:
        lo, hi = r["wilson95"]
        acc = f"{r['accuracy']:.2f} [{lo:.2f}, {hi:.2f}]"
        p = vs.get((r["format"], "bf16"))
        pval = ("<0.001" if p["mcnemar_p"] < 0.001 else f"{p['mcnemar_p']:.3f}") if p else "-"
        row = f"{r['format']:10s} {r['bits_per_value']:10.3f} {r['correct']:>4d}/{r['n']:<3d}  {acc:19s}  {_diff_cell(p):21s} {pval:>9s}"
        if has_int4:
            row += f"  {_diff_cell(vs.get((r['format'], 'int4-g32'))):21s}"
        row += f" {r['seconds']:8.1f}"
        lines.append(row)
    s = m["seconds"]
    lines += [
        "",
        f"intervals: {m['intervals']}.",
        f"decoding:  {m['decoding']}.",
        f"time: load {s['load']} s, haystack {s['corpus']} s, pilot {s['pilot']} s, evaluation {s['eval']} s, total {s['total']} s",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ CLI


# The longest --length taken (16M tokens: past any model's context; a model's own
# max_position_embeddings bounds it further once loaded). 99999999k built a prompt of 1e11 tokens.
MAX_LENGTH = 1 << 24


def _tokens(s: str) -> int:
    t = s.strip().lower()
    mult = 1024 if t.endswith("k") else 1
    n = positive_int(t[:-1] if mult > 1 else t) * mult
    if n > MAX_LENGTH:
        raise argparse.ArgumentTypeError(f"at most {MAX_LENGTH} tokens ({MAX_LENGTH // 1024}k), got {s!r}")
    return n


def _threshold(s: str) -> float:
    """--threshold: a share in (0, 1] (nan, 0 and 1.5 were taken: nan failed after the model loaded,
    0 accepted the hardest variant on any pilot, > 1 never accepted one)."""
    try:
        t = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not 0 < t <= 1:  # (false for nan too)
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s!r}")
    return t


def check_length(model, length: int) -> None:
    """ValueError if ``length`` tokens are more than ``MAX_LENGTH`` or the model's
    ``max_position_embeddings`` (checked before any prompt is built)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(cfg, "max_position_embeddings", None)
    if length > MAX_LENGTH:
        raise ValueError(f"--length {length} is more than {MAX_LENGTH} tokens")
    if isinstance(limit, int) and limit > 0 and length > limit:
        raise ValueError(f"--length {length} is more than the model's max_position_embeddings ({limit} tokens)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``niah`` under ``weightszip eval``."""
    from weightszip.eval.cli import add_calibration_arg

    p = subparsers.add_parser(
        "niah",
        help="multi-key needle-in-a-haystack retrieval under each KV format (RULER-style)",
        description="Multi-key needles in a haystack of real text; every format answers the same prompts; exact-match "
        "accuracy and paired differences against bf16 (and int4-g32) with 95% intervals. The variant (queried keys x "
        "distractors) is the hardest on which bf16 still scores >= 80% on a pilot, unless --variant is given.",
    )
    p.add_argument("--model", required=True, help="smollm2 | qwen2.5 | a model folder | a .gguf file")
    p.add_argument("--formats", default=DEFAULT_FORMATS, help=f"comma-separated KV formats (default {DEFAULT_FORMATS}; bf16 always runs)")
    p.add_argument("--length", type=_tokens, required=True, help="prompt length in tokens (2048 or 2k)")
    p.add_argument("--n", type=positive_int, default=20, help="prompts (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    p.add_argument("--text", help="haystack: a text file or a folder of .txt files (default: $WEIGHTSZIP_NIAH_TEXT, else "
                   "../shared/data/text/paul_graham from the working directory, else the ~11k-token excerpt the package "
                   "ships, weightszip/data/carroll-alice-excerpt.txt; prompts longer than the text repeat it, with a note)")
    p.add_argument("--variant", type=parse_variant, help="KEYSxDISTRACTORS, e.g. 2x2: skip the pilot")
    p.add_argument("--variants", default=DEFAULT_LADDER, help=f"the pilot's variants, hardest first (default {DEFAULT_LADDER})")
    p.add_argument("--pilot", type=positive_int, default=DEFAULT_PILOT, help=f"pilot prompts per variant (default {DEFAULT_PILOT})")
    p.add_argument("--threshold", type=_threshold, default=DEFAULT_THRESHOLD,
                   help="bf16 pilot accuracy a variant needs, in (0, 1] (default 0.8)")
    p.add_argument("--max-new", type=positive_int, default=DEFAULT_MAX_NEW, help="greedy tokens per number at most (default 12)")
    p.add_argument("--threads", type=thread_count, default=0, help="torch CPU threads (default: torch's; at most 256)")
    add_calibration_arg(p, evaluates="haystack")
    p.add_argument("--device", type=torch_device, default="cpu", help="torch device for the model's forwards (default cpu; e.g. cuda)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON (per-prompt details included)")
    p.add_argument("-o", "--output", help="also write the JSON report to this file (updated after each prompt)")
    p.set_defaults(fn=run_cli)
    return p


def run_cli(args) -> int:
    from weightszip.eval.formats import FormatUnavailable, get_format
    from weightszip.models import ModelNotInstalled, load_causal_lm

    def fail(msg) -> int:
        print(f"weightszip: error: {msg}", file=sys.stderr)
        return 2

    from weightszip.eval import provenance
    from weightszip.eval.cli import _use_calibration, check_calibration_fits

    formats = [s.strip() for s in args.formats.split(",") if s.strip()]
    try:
        ladder = [parse_variant(s) for s in args.variants.split(",") if s.strip()]
        cal = _use_calibration(args.calibration)
        for name in formats:
            get_format(name)
    except (KeyError, FormatUnavailable, ValueError, OSError) as e:
        return fail(e.args[0] if e.args else e)
    if not ladder:
        return fail("--variants names no variant")
    try:
        haystack = text_files(Path(args.text) if args.text else default_text())
    except FileNotFoundError:
        haystack = []  # (said once the haystack is read)
    if args.output:  # before the model runs: never an input (the text, a haystack file, the model), a folder
        from weightszip.cli import refuse_output
        from weightszip.eval.cli import _make_folder_for

        inputs = [str(f) for f in haystack] + [t for t in (args.text, args.model) if t]
        why = refuse_output(args.output, inputs, force=True) or _make_folder_for(Path(args.output))
        if why is not None:
            return fail(f"-o {why}")
    overlap, why = provenance.held_out(cal, args.calibration, haystack, args.allow_calibration_text)
    if why is not None:
        return fail(why)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        lm = load_causal_lm(args.model, verbose=False)
    except (ModelNotInstalled, ImportError, ValueError) as e:
        return fail(e)
    why = check_calibration_fits(cal, args.calibration, lm.model)
    if why is not None:
        return fail(why)
    if args.device != "cpu":
        lm.model.to(args.device)

    def checkpoint(rep: NiahReport) -> None:  # a long run leaves its results so far in --output
        if args.output:
            Path(args.output).write_text(json.dumps(rep.to_json(), indent=1) + "\n")

    try:
        rep = run_niah(lm, formats, args.length, args.n, seed=args.seed, text=args.text, variant=args.variant,
                       ladder=ladder, pilot=args.pilot, threshold=args.threshold, max_new=args.max_new, log=log,
                       on_prompt=checkpoint,
                       calibration=None if cal is None else provenance.describe(args.calibration, cal, overlap))
    except (ValueError, FileNotFoundError) as e:
        return fail(e)
    data = rep.to_json()
    if args.output:
        Path(args.output).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data, indent=1) if args.json else render(rep))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m weightszip.eval.niah ...`` (the same as ``weightszip eval niah ...``)."""
    parser = argparse.ArgumentParser(prog="weightszip eval")
    sub = parser.add_subparsers(dest="eval_cmd", required=True)
    add_parser(sub)
    args = parser.parse_args(["niah", *(sys.argv[1:] if argv is None else argv)])
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
